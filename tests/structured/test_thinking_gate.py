"""The grammar after the thinking block (structured/thinking.py), with the real grammar
library over SmolLM2's tokenizer with <think> and </think> added as single tokens: the mask
in each state, the state carried through rollback and reset, all-or-nothing acceptance, and
through the whole engine a random model whose answer, after </think>, validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from tests.support.engine import build_engine, drain
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tinyserve.structured.backend import GrammarBackend
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.structured.thinking import GRAMMAR, THINKING, UNDECIDED, ThinkingGate
from tinyserve.testing.checkpoints import llama_config, write_checkpoint

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def thinking_tokenizer(smollm2_tokenizer, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer.name_or_path)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    path = tmp_path_factory.mktemp("think_tok")
    tok.save_pretrained(path)
    return tok, path


@pytest.fixture(scope="module")
def backend(thinking_tokenizer):
    tok, _ = thinking_tokenizer
    b = GrammarBackend(tok, len(tok))
    return b, b.compile(StructuredOutputSpec.json_schema(SCHEMA, "response_format"))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _mask(matcher, backend) -> torch.Tensor:
    bitmask = backend.allocate_bitmask(1)
    bitmask.zero_()
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def test_each_state_masks_as_it_should(thinking_tokenizer, backend):
    tok, _ = thinking_tokenizer
    b, compiled = backend
    start, end = _ids(tok, "<think>")[0], _ids(tok, "</think>")[0]
    plain = _mask(b.matcher(compiled), b)
    gate = ThinkingGate(b.matcher(compiled), start, end)
    assert gate.state == UNDECIDED
    first = _mask(gate, b)
    assert _allowed(first, start) and not _allowed(plain, start)
    first_without_start = first.clone()
    first_without_start[start // 32] = plain[start // 32]
    assert torch.equal(first_without_start, plain)  # otherwise the grammar's own set
    assert gate.accept_tokens([start]) and gate.state == THINKING
    assert torch.equal(_mask(gate, b), torch.full_like(plain, -1))  # anything while thinking
    prose = _ids(tok, "Hmm, not JSON at all.")
    assert not b.matcher(compiled).accept_tokens(prose[:1])  # the grammar would refuse it
    assert gate.accept_tokens(prose) and gate.state == THINKING
    assert gate.accept_tokens([end]) and gate.state == GRAMMAR
    assert torch.equal(_mask(gate, b), plain)  # the grammar from its start
    answer = _ids(tok, '{"ok": true}')
    assert gate.accept_tokens(answer)
    assert not gate.accept_tokens(_ids(tok, "x"))


def test_rollback_and_reset_restore_the_state(thinking_tokenizer, backend):
    tok, _ = thinking_tokenizer
    b, compiled = backend
    start, end = _ids(tok, "<think>")[0], _ids(tok, "</think>")[0]
    gate = ThinkingGate(b.matcher(compiled), start, end)
    tokens = [start, *_ids(tok, "so"), end, *_ids(tok, '{"ok"')]
    masks, states = [], []
    for t in tokens:
        masks.append(_mask(gate, b))
        states.append(gate.state)
        assert gate.accept_tokens([t])
    for n in range(len(tokens), 0, -1):  # back over every token, across both boundaries
        gate.rollback(1)
        assert gate.state == states[n - 1] and torch.equal(_mask(gate, b), masks[n - 1]), n
    assert gate.accept_tokens(tokens)
    assert not gate.accept_tokens([*_ids(tok, ": true}"), start])  # all or nothing
    assert torch.equal(_mask(gate, b), _mask(_replayed(b, compiled, start, end, tokens), b))
    gate.reset()
    assert gate.state == UNDECIDED and torch.equal(_mask(gate, b), masks[0])
    opened = ThinkingGate(b.matcher(compiled), start, end, thinking=True)
    assert opened.state == THINKING and opened.accept_tokens([end]) and opened.state == GRAMMAR
    opened.reset()
    assert opened.state == THINKING


def _replayed(b, compiled, start, end, tokens):
    gate = ThinkingGate(b.matcher(compiled), start, end)
    assert gate.accept_tokens(tokens)
    return gate


def test_through_the_engine_the_answer_after_thinking_validates(thinking_tokenizer, tmp_path):
    """A random model, the prompt already inside <think>: a bias makes </think> its first
    token (free while thinking); then the schema holds whatever the weights want."""
    tok, tok_dir = thinking_tokenizer
    cfg = llama_config(vocab_size=len(tok), num_hidden_layers=2, bos_token_id=None,
                       eos_token_id=tok.eos_token_id, tie_word_embeddings=True)  # fmt: skip
    path = write_checkpoint(tmp_path / "m", cfg, seed=3, tokenizer_dir=tok_dir)
    engine = build_engine(model=str(path), num_blocks=64, block_size=16)
    start, end = _ids(tok, "<think>")[0], _ids(tok, "</think>")[0]
    prompt = _ids(tok, "Answer in JSON. <think>")
    for seed in range(4):
        so = StructuredOutputsParams(json=SCHEMA, think_end_id=end, think_start_id=start,
                                     thinking_open=True)  # fmt: skip
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, logit_bias={end: 100},
                                structured_outputs=so)  # fmt: skip
        engine.add_request(f"r{seed}", prompt, params)
    out = drain(engine)
    for seed in range(4):
        choice = out.choices[f"r{seed}"][0]
        assert choice.token_ids[0] == end
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(
            json.loads(tok.decode(choice.token_ids[1:], skip_special_tokens=True)), SCHEMA
        )


def test_the_server_gates_only_where_the_tags_are_single_tokens(
    thinking_tokenizer, smollm2_tokenizer
):
    from tinyserve.entrypoints.reasoning import grammar_gate

    tok, _ = thinking_tokenizer
    gate = grammar_gate(tok, opened=False)
    assert gate == {"think_end_id": _ids(tok, "</think>")[0],
                    "think_start_id": _ids(tok, "<think>")[0], "thinking_open": False}  # fmt: skip
    assert grammar_gate(smollm2_tokenizer, opened=True) is None  # "</think>" is 3 tokens there

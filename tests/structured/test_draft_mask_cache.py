"""Masks over speculative drafts against the grammar library's mask cache. llguidance keeps
the last mask it computed, keyed by the lexer state and the Earley row index, and neither its
rollback nor its reset drops it: walked over drafts and rolled back, a matcher handed a state
reached by other tokens with the same key the rolled-back draft's mask. The agent-loop
benchmark's 500 "the grammar rejected token 23597" (``"}``): a suffix draft of an earlier
read_file call, rejected at the name, left read_file's mask for the path string; the model
wrote edit_file, whose path must be followed by ``, "old"``, and the mask allowed ``"}``."""

from __future__ import annotations

import pytest
import torch

from tinyserve.engine.structured_output import _fill_with_drafts
from tinyserve.entrypoints import tools as T
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.structured.thinking import GRAMMAR, THINKING, UNDECIDED, ThinkingGate


def _tool(name: str, *params: str) -> T.Tool:
    props = {p: {"type": "string"} for p in params}
    return T.Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}})  # fmt: skip


# benchmarks/bench_agent_loop.py's tools
TOOLS = [_tool("read_file", "path"), _tool("run_tests", "path"),
         _tool("edit_file", "path", "old", "new")]  # fmt: skip


def _mask(matcher) -> torch.Tensor:
    bitmask = matcher._backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


def _fresh_mask(backend, compiled, token_ids) -> torch.Tensor:
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(token_ids)
    return _mask(matcher)


def test_a_rejected_draft_leaves_its_mask_to_no_later_step(backend, smollm2_tokenizer):
    """The engine's calls, step by step: each step's rows over its drafts, then the kept
    tokens accepted one by one. A suffix draft into read_file's path is rejected at the
    name; the grammar's forced tokens follow edit_file; every row sampled from is the
    mask of the tokens before it, and inside edit_file's path ``"}`` is not allowed."""
    enc = lambda s: smollm2_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    schema = T.envelope_schema(TOOLS, "auto", True)
    compiled = backend.compile(StructuredOutputSpec.json_schema(schema, "tools"))
    matcher = backend.matcher(compiled)
    kept = enc('{"tool_calls": [{"name": "')
    assert matcher.accept_tokens(kept)
    real = enc('edit_file", "arguments": {"path": "shop/cart1.py", "old": "x"')
    drafts = enc('read_file", "arguments": {"path": "shop/cart1.py')  # an earlier call
    quote_brace = smollm2_tokenizer.convert_tokens_to_ids('"}')
    inside_path = 0
    i = 0
    while i < len(real):
        bitmask = backend.allocate_bitmask(1 + len(drafts))
        _fill_with_drafts(matcher, drafts, bitmask, 0)
        n = 0  # the model keeps the drafts that are its own tokens
        while n < len(drafts) and i + n < len(real) and drafts[n] == real[i + n]:
            n += 1
        for j in range(n + 1):  # every row sampled from: the mask after the drafts before it
            assert torch.equal(
                bitmask[j], _fresh_mask(backend, compiled, kept + real[i : i + j])
            ), f"row {j} after {smollm2_tokenizer.decode(kept + real[i : i + j])!r}"
        row = bitmask[n]
        text = smollm2_tokenizer.decode(kept + real[i : i + n])
        if '"path": "' in text and not text.endswith('"path": "') and '"old"' not in text:
            inside_path += 1
            assert not row[quote_brace // 32] >> (quote_brace % 32) & 1
        for t in real[i : i + n + 1]:
            assert matcher.accept_tokens([t])
        kept += real[i : i + n + 1]
        i += n + 1
        drafts = matcher.forced_tokens()
    assert inside_path >= 3


@pytest.mark.parametrize("undo", ["rollback", "reset"])
def test_rollback_and_reset_forget_the_masks_of_the_states_they_leave(
    backend, smollm2_tokenizer, undo
):
    """``c x`` then ``a x``: the same lexer state (inside X) at the same row, but only
    ``b`` may follow the second, only ``d`` the first."""
    enc = lambda s: smollm2_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    compiled = backend.compile(
        StructuredOutputSpec.grammar('start: "a" X "b" | "c" X "d"\nX: /x+/')
    )
    matcher = backend.matcher(compiled)
    _mask(matcher)
    assert matcher.accept_tokens(enc("c") + enc("x"))
    _mask(matcher)  # the state rolled back below
    if undo == "rollback":
        matcher.rollback(2)
    else:
        matcher.reset()
    assert matcher.accept_tokens(enc("a") + enc("x"))
    assert torch.equal(_mask(matcher), _fresh_mask(backend, compiled, enc("a") + enc("x")))


def test_a_fork_moves_alone(backend, smollm2_tokenizer):
    """A fork (a matcher or a thinking gate) takes tokens; the original keeps its state."""
    enc = lambda s: smollm2_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    compiled = backend.compile(StructuredOutputSpec.json_schema({"type": "object"}))
    matcher = backend.matcher(compiled)
    start = _mask(matcher).clone()
    fork = matcher.fork()
    assert fork.accept_tokens(enc('{"a": 1}'))
    assert fork.is_terminated() and not matcher.is_terminated()
    assert torch.equal(_mask(matcher), start)
    assert matcher.accept_tokens(enc('{"a"'))  # a fork holds none of the tokens before it:
    fork = matcher.fork()  # rebuilt, it would replay its own only, from the start
    assert fork.accept_tokens(enc(": 1"))
    with pytest.raises(ValueError, match="does not roll back"):
        fork.rollback(1)
    think, end = enc(" think")[0], enc(" done")[0]  # any two ids serve as <think>, </think>
    gate = ThinkingGate(backend.matcher(compiled), think, end)
    fork = gate.fork()
    assert fork.accept_tokens([think]) and fork.state == THINKING
    assert gate.state == UNDECIDED
    assert gate.accept_tokens(enc("{")) and gate.state == GRAMMAR
    assert fork.accept_tokens([end]) and fork.accept_tokens(enc("{"))
    assert fork.state == GRAMMAR and fork.forced_tokens() == gate.forced_tokens()

"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): our loader + decoder + paged
cache vs transformers loading the same GGUF, fp32 (kernel activations float32: the bf16 default
on AVX512-BF16 CPUs is bounded against this reference in test_batch_invariance.py). Slow:
transformers reads the GGUF twice."""

from __future__ import annotations

import pytest
import torch

from tinyserve.testing.paged_runner import PagedRunner, greedy_generate

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4  # small, so every sequence crosses many block boundaries
MAX_NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def our_model(smollm2_gguf_path):
    from tinyserve.models.loader import load_model

    model, source = load_model(smollm2_gguf_path, dtype=torch.float32, kernel_activations="float32")
    assert source.kind == "gguf"
    return model


def _chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    return [int(t) for t in ids]


def test_config_matches_transformers(hf_model, our_model):
    hc, oc = hf_model.config, our_model.config
    assert oc.architecture == "LlamaForCausalLM"
    assert (oc.vocab_size, oc.hidden_size, oc.intermediate_size) == (
        hc.vocab_size,
        hc.hidden_size,
        hc.intermediate_size,
    )
    assert (oc.num_hidden_layers, oc.num_attention_heads, oc.num_key_value_heads) == (
        hc.num_hidden_layers,
        hc.num_attention_heads,
        hc.num_key_value_heads,
    )
    assert oc.rms_norm_eps == pytest.approx(hc.rms_norm_eps)
    assert oc.tie_word_embeddings == bool(hc.tie_word_embeddings)


def test_prefill_and_teacher_forced_decode_logits(hf_model, our_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    question = [{"role": "user", "content": "Tell me one fact about the Moon."}]
    answer = "The Moon is slowly drifting away from Earth, about four centimetres every year."
    prompt = _chat_ids(tok, question, add_generation_prompt=True)
    full = _chat_ids(tok, question + [{"role": "assistant", "content": answer}], False)
    assert full[: len(prompt)] == prompt
    assert len(full) - len(prompt) >= 16
    assert len(prompt) % BLOCK_SIZE != 0  # the first decode writes into a partly filled block

    with torch.no_grad():
        expected = hf_model(torch.tensor([full])).logits[0].float()  # [len, vocab]
    runner = PagedRunner(our_model, BLOCK_SIZE, num_blocks=64, seed=0)
    prefill = runner.step([("s", prompt)])[0]
    torch.testing.assert_close(prefill, expected[: len(prompt)], atol=1e-3, rtol=0)
    for pos in range(len(prompt), len(full)):
        row = runner.step([("s", [full[pos]])])[0][0]
        torch.testing.assert_close(
            row, expected[pos], atol=1e-3, rtol=0, msg=lambda m, p=pos: f"position {p}: {m}"
        )
        # Same prediction, so greedy decoding would follow the same path.
        assert int(row.argmax()) == int(expected[pos].argmax())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers_generate(
    hf_model, our_model, smollm2_tokenizer, prompt
):
    tok = smollm2_tokenizer
    ids = _chat_ids(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    eos = {int(e) for e in our_model.config.eos_token_ids}
    hf_eos = hf_model.generation_config.eos_token_id
    hf_eos = {hf_eos} if isinstance(hf_eos, int) else set(hf_eos or [])
    assert eos and eos == hf_eos

    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=min(eos),
        )
    expected = out[0, len(ids) :].tolist()
    # generate stops after the first EOS (kept); ours does the same.
    assert 0 < len(expected) <= MAX_NEW_TOKENS
    got = greedy_generate(our_model, ids, MAX_NEW_TOKENS, BLOCK_SIZE, eos)
    assert got == expected, (tok.decode(got), tok.decode(expected))

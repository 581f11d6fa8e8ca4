"""Tiny random Llama (llama3 RoPE scaling, GQA, tied embeddings) and Qwen2 (q/k/v bias,
untied head, GQA) checkpoints written by transformers: our loader + decoder + paged cache
give the same fp32 logits as the transformers model, at prefill and at every teacher-forced
decode step, alone and batched with other sequences."""

from __future__ import annotations

import json

import pytest
import torch

from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import (
    LLAMA3_ROPE,
    VOCAB,
    build_hf,
    hf_logits,
    llama_config,
    qwen2_config,
    random_tokens,
    save_hf,
)
from tinyserve.testing.paged_runner import PagedRunner

PROMPT_LEN = 20
DECODE_STEPS = 20
BLOCK_SIZE = 4


def _save(tmp_path_factory, name, config):
    hf = build_hf(config)
    return save_hf(hf, tmp_path_factory.mktemp(name)), hf


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return _save(tmp_path_factory, "llama", llama_config(rope_parameters=dict(LLAMA3_ROPE)))


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    return _save(tmp_path_factory, "qwen2", qwen2_config())


@pytest.fixture(params=["llama", "qwen2"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_ckpt")


def test_saved_checkpoints_have_the_features_under_test(llama_ckpt, qwen2_ckpt):
    llama_path, llama_hf = llama_ckpt
    cfg = json.loads((llama_path / "config.json").read_text())
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] == 64
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]

    qwen_path, qwen_hf = qwen2_ckpt
    qcfg = json.loads((qwen_path / "config.json").read_text())
    assert qcfg["architectures"] == ["Qwen2ForCausalLM"]
    assert qcfg["tie_word_embeddings"] is False
    attn = qwen_hf.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
    assert attn.q_proj.bias.abs().max() > 0.1  # not the all-zero default init
    assert attn.o_proj.bias is None
    assert qwen_hf.lm_head.weight.data_ptr() != qwen_hf.model.embed_tokens.weight.data_ptr()

    ours, _ = load_model(llama_path, dtype=torch.float32)
    assert ours.config.rope_type == "llama3" and ours.config.tie_word_embeddings
    ours_q, _ = load_model(qwen_path, dtype=torch.float32)
    assert ours_q.config.attention_bias and not ours_q.config.tie_word_embeddings


def test_llama3_scaling_matters_at_the_tested_positions(llama_ckpt):
    """Guards the parity test's power: without the llama3 schedule the logits would differ."""
    _, hf = llama_ckpt
    plain = build_hf(llama_config())
    plain.load_state_dict(hf.state_dict())
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, seed=5)
    diff = (hf_logits(hf, tokens) - hf_logits(plain, tokens)).abs().amax(-1)
    assert diff[PROMPT_LEN:].min() > 1e-2, diff


@pytest.mark.device
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_and_teacher_forced_decode_match_transformers(ckpt, seed, test_device):
    path, hf = ckpt
    ours, _ = load_model(path, dtype=torch.float32, device=torch.device(test_device))
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, seed)
    expected = hf_logits(hf, tokens)
    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=seed)

    prefill = runner.step([("s", tokens[:PROMPT_LEN])])[0]
    assert prefill.shape == (PROMPT_LEN, VOCAB)
    torch.testing.assert_close(prefill, expected[:PROMPT_LEN], atol=1e-4, rtol=0)
    for pos in range(PROMPT_LEN, len(tokens)):
        row = runner.step([("s", [tokens[pos]])])[0]
        torch.testing.assert_close(
            row[0], expected[pos], atol=1e-4, rtol=0, msg=lambda m, p=pos: f"position {p}: {m}"
        )
    table = runner.tables["s"]
    assert len(table) == (PROMPT_LEN + DECODE_STEPS) // BLOCK_SIZE
    assert table != list(range(table[0], table[0] + len(table)))  # not one contiguous run


@pytest.mark.device
def test_batched_step_matches_each_sequence_alone(ckpt, test_device):
    """One flat step mixing a prefill chunk with a cached prefix (starting at a block
    boundary), a chunk with an unaligned prefix and decode rows gives each sequence the logits
    it gets when run alone."""
    path, hf = ckpt
    ours, _ = load_model(path, dtype=torch.float32, device=torch.device(test_device))
    a, b, c = random_tokens(19, 10), random_tokens(11, 11), random_tokens(9, 12)
    # Per sequence, the chunk it contributes to each step.
    plan = {
        "a": [a[:8], a[8:15], a[15:16], a[16:17], a[17:19]],
        "b": [b[:6], b[6:7], b[7:8], b[8:9], b[9:11]],
        "c": [c[:3], c[3:6], c[6:7], c[7:8], c[8:9]],
    }
    alone = {}
    for seq, chunks in plan.items():
        runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=32, seed=ord(seq))
        alone[seq] = [runner.step([(seq, ch)])[0] for ch in chunks]

    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=99)
    orders = [["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"], ["b", "c", "a"]]
    for step, order in enumerate(orders):
        out = runner.step([(s, plan[s][step]) for s in order])
        for s, logits in zip(order, out, strict=True):
            torch.testing.assert_close(
                logits,
                alone[s][step],
                atol=1e-5,
                rtol=0,
                msg=lambda m, s=s, step=step: f"seq {s} step {step}: {m}",
            )

    # And both agree with transformers on the full sequences.
    for seq, tokens in (("a", a), ("b", b), ("c", c)):
        torch.testing.assert_close(torch.cat(alone[seq]), hf_logits(hf, tokens), atol=1e-4, rtol=0)

"""Gemma 3 text (models/gemma3.py) against transformers' Gemma3ForCausalLM on a tiny random
checkpoint with every feature weighted away from its default: fp32 logits at prefill and at
every teacher-forced decode step through the paged cache (within its 64-position window;
past a window: test_sliding_window.py), greedy tokens, batch invariance, on the CPU kernels and the torch
path. Its GGUF (norms as 1 + w, llama.cpp's norm names, every 6th layer global) is one of
test_families.py's GGUF round trips."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.kernels import attention, step
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, hf_logits, random_tokens, save_hf, tiny_config
from tinyserve.testing.paged_runner import (
    PagedRunner,
    batched_and_alone,
    greedy_generate,
    mixed_steps,
)
from tinyserve.worker.executor import resolve_max_model_len

BLOCK_SIZE, PROMPT_LEN, DECODE_STEPS = 4, 20, 12


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    hf = build_hf(tiny_config("gemma3"))
    return save_hf(hf, tmp_path_factory.mktemp("gemma3")), hf


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_teacher_forced_decode_match_transformers(gemma, kernels):
    path, hf = gemma
    ours, _ = load_model(path, dtype=torch.float32, cpu_kernels=kernels)
    assert ours.config.architecture == "Gemma3ForCausalLM"
    assert ours.config.local_layers == (1, 0, 1)
    on_kernels = kernels and attention.library() is not None
    assert ours.attention_method.name == ("kernel" if on_kernels else "torch")
    assert (ours.model.step_plan is not None) == (on_kernels and step.library() is not None)
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, seed=7)
    got = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=3).prefill_then_decode(
        tokens, PROMPT_LEN
    )
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(gemma):
    path, hf = gemma
    ours, _ = load_model(path, dtype=torch.float32)
    prompt = random_tokens(PROMPT_LEN, seed=11)
    want = []
    while len(want) < DECODE_STEPS:
        want.append(int(hf_logits(hf, prompt + want)[-1].argmax()))
    assert greedy_generate(ours, prompt, DECODE_STEPS, BLOCK_SIZE, eos=set()) == want


def test_a_batched_step_gives_each_sequence_its_logits_alone_bitwise(gemma):
    ours, _ = load_model(gemma[0], dtype=torch.float32)
    for label, batched, alone in batched_and_alone(ours, BLOCK_SIZE):
        assert torch.equal(batched, alone), label


@pytest.mark.skipif(step.library() is None, reason="needs the CPU kernels' one-call step")
def test_layers_in_one_c_call_equal_the_python_loop_bitwise(gemma):
    """step.c's output norms, GeGLU kernel and second RoPE table: the loop's bits."""
    fused, _ = load_model(gemma[0], torch.float32, "cpu")
    loop, _ = load_model(gemma[0], torch.float32, "cpu", fused_step=False)
    assert fused.model.step_plan is not None and loop.model.step_plan is None
    a = mixed_steps(PagedRunner(fused, 4, num_blocks=64, seed=1), random.Random(2))
    b = mixed_steps(PagedRunner(loop, 4, num_blocks=64, seed=1), random.Random(2))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_the_context_is_not_capped_at_the_window(gemma):
    ours, _ = load_model(gemma[0], dtype=torch.float32)
    assert resolve_max_model_len(ours.config, None, 10**6) == 512
    assert [layer.self_attn.window for layer in ours.model.layers] == [64, None, 64]


# What each feature is, turned off in transformers: the logits must then move.
WITHOUT = {
    "local rope base": {"rope_parameters": {"full_attention": {"rope_type": "linear",
                                                               "factor": 8.0,
                                                               "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 1e6}}},
    "query_pre_attn_scalar": {"query_pre_attn_scalar": 32},
    "every layer global": {"layer_types": ["full_attention"] * 3},
}  # fmt: skip


@pytest.mark.parametrize("name", list(WITHOUT))
def test_each_feature_moves_the_logits(name):
    tokens = random_tokens(PROMPT_LEN, seed=7)
    before = hf_logits(build_hf(tiny_config("gemma3")), tokens)
    after = hf_logits(build_hf(tiny_config("gemma3", **WITHOUT[name])), tokens)
    assert (after - before).abs().max() > 1e-2


def test_the_post_norms_and_the_norm_offset_matter(gemma, tmp_path):
    """Our model with a post-feedforward norm's weights at 0 (a norm times 1, its offset)
    against the same with them at 1 (times 2): the logits move."""
    _, hf = gemma
    tokens = random_tokens(PROMPT_LEN, seed=7)
    logits = []
    for value in (0.0, 1.0):
        with torch.no_grad():
            hf.model.layers[1].post_feedforward_layernorm.weight.fill_(value)
        ours, _ = load_model(save_hf(hf, tmp_path / str(value)), dtype=torch.float32)
        logits.append(PagedRunner(ours, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0])
        torch.testing.assert_close(logits[-1], hf_logits(hf, tokens), atol=1e-4, rtol=0)
    assert (logits[0] - logits[1]).abs().max() > 1e-2


# gemma-3-1b-it's config.json (transformers 4.50 layout: no layer_types).
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
             "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
             "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "query_pre_attn_scalar": 256, "rope_theta": 1000000,
             "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
             "sliding_window_pattern": 6, "max_position_embeddings": 32768,
             "final_logit_softcapping": None, "attn_logit_softcapping": None}  # fmt: skip


def test_a_gemma3_1b_config_json():
    c = ModelConfig.from_hf_config(GEMMA3_1B)
    assert c.local_layers == tuple(int((i + 1) % 6 != 0) for i in range(26))
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 10000.0, None)
    assert (c.attention_multiplier, c.sliding_window, c.head_dim) == (1 / 16, 512, 256)
    assert resolve_max_model_len(c, None, 10**6) == 32768
    assert [c.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf_config({**GEMMA3_1B, "final_logit_softcapping": 30.0})


@torch.no_grad()
def test_bf16_norms_are_transformers_own(gemma, tmp_path):
    """In bf16 Gemma scales a normed row in float32 by 1 + w (float32), then rounds
    (transformers' Gemma3RMSNorm): on a bf16 checkpoint each of our norms — the layers' four,
    q's and k's per head, the final one — gives its bits on random bf16 rows (bf16(1 + w) and
    a bf16 product, Llama's order, differ in them), and the logits are as near float32's as
    transformers' bf16 logits are."""
    _, hf = gemma
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ours, _ = load_model(save_hf(hf16, tmp_path / "bf16"), dtype=torch.bfloat16)
    pairs = [(ours.model.norm, hf16.model.norm)]
    for a, b in zip(ours.model.layers, hf16.model.layers, strict=True):
        pairs += [(getattr(a, n), getattr(b, n)) for n in ("input_layernorm",
                  "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")]  # fmt: skip
        pairs += [
            (a.self_attn.q_norm, b.self_attn.q_norm),
            (a.self_attn.k_norm, b.self_attn.k_norm),
        ]
    g = torch.Generator().manual_seed(5)
    for mine, theirs in pairs:
        assert theirs.weight.abs().max() > 0.05  # weighted away from the offset alone
        x = (torch.randn(7, theirs.weight.shape[0], generator=g) * 3).to(torch.bfloat16)
        assert torch.equal(mine.plain(x), theirs(x))
    tokens = random_tokens(PROMPT_LEN, seed=7)
    ref = hf_logits(copy.deepcopy(hf16).float(), tokens)  # the bf16 weights, in float32
    hf_err = (hf_logits(hf16, tokens) - ref).abs().max()
    got = PagedRunner(ours, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0].float()
    assert (got - ref).abs().max() <= 2 * hf_err + 1e-3 * ref.abs().max()

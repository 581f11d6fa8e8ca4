"""Phi-3 / Phi-4-mini (models/phi3.py): fused qkv_proj / gate_up_proj checkpoints, partial
rotary and LongRoPE, each against transformers' Phi3ForCausalLM on tiny random checkpoints
(fp32 logits at prefill and at every teacher-forced decode step through the paged cache,
greedy tokens), on the CPU kernels with the one-call step and on the torch path; GGUF files
as llama.cpp's converter writes them (attn_qkv, ffn_up holding gate and up, LongRoPE factor
tensors) equal to the safetensors, their Q4_1 / Q8_0 blocks served by the kernels."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.kernels import attention, step
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import (
    build_hf,
    hf_logits,
    phi3_longrope,
    random_tokens,
    save_hf,
    tiny_config,
)
from tinyserve.testing.paged_runner import (
    PagedRunner,
    batched_and_alone,
    greedy_generate,
    mixed_steps,
)
from tinyserve.worker.executor import resolve_max_model_len

BLOCK_SIZE, DECODE_STEPS = 4, 12
# name -> (config fields, served length (None: max_position_embeddings 512), tokens). The
# LongRoPE checkpoints' original context is 64: served at 64, the short factors (transformers
# too, on sequences of at most 64); served at 512, the long ones (transformers on 80 tokens).
CASES = {
    "partial": ({}, None, 32),
    "partial-longrope-short": (phi3_longrope(12), 64, 32),
    "partial-longrope-long": (phi3_longrope(12), None, 80),
    "full-longrope-long": ({"partial_rotary_factor": 1.0, **phi3_longrope(16)}, None, 80),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    over, served, n = CASES[request.param]
    hf = build_hf(tiny_config("phi3", **over))
    return request.param, save_hf(hf, tmp_path_factory.mktemp(request.param)), hf, served, n


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_teacher_forced_decode_match_transformers(case, kernels):
    name, path, hf, served, n = case
    ours, _ = load_model(path, dtype=torch.float32, cpu_kernels=kernels, max_position=served)
    assert ours.config.architecture == "Phi3ForCausalLM"
    on_kernels = kernels and attention.library() is not None
    assert ours.attention_method.name == ("kernel" if on_kernels else "torch")
    assert (ours.model.step_plan is not None) == (on_kernels and step.library() is not None)
    tokens = random_tokens(n, seed=7)
    expected = hf_logits(hf, tokens)
    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=3)
    got = runner.prefill_then_decode(tokens, n - DECODE_STEPS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


def test_greedy_tokens_match_transformers(case):
    name, path, hf, served, n = case
    ours, _ = load_model(path, dtype=torch.float32, max_position=served)
    prompt = random_tokens(n - DECODE_STEPS, seed=11)
    got = greedy_generate(ours, prompt, DECODE_STEPS, BLOCK_SIZE, eos=set())
    want = []
    while len(want) < DECODE_STEPS:
        want.append(int(hf_logits(hf, prompt + want)[-1].argmax()))
    assert got == want, name


def test_a_batched_step_gives_each_sequence_its_logits_alone_bitwise(case):
    name, path, _, served, _ = case
    ours, _ = load_model(path, dtype=torch.float32, max_position=served)
    for label, batched, alone in batched_and_alone(ours, BLOCK_SIZE):
        assert torch.equal(batched, alone), f"{name} {label}"


@pytest.mark.skipif(step.library() is None, reason="needs the CPU kernels' one-call step")
def test_layers_in_one_c_call_equal_the_python_loop_bitwise(case):
    """Partial rotary and LongRoPE are tables and a row order: step.c serves them as is."""
    _, path, _, served, _ = case
    fused, _ = load_model(path, torch.float32, "cpu", max_position=served)
    loop, _ = load_model(path, torch.float32, "cpu", fused_step=False, max_position=served)
    assert fused.model.step_plan is not None and loop.model.step_plan is None
    a = mixed_steps(PagedRunner(fused, 4, num_blocks=64, seed=1), random.Random(2))
    b = mixed_steps(PagedRunner(loop, 4, num_blocks=64, seed=1), random.Random(2))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_each_feature_moves_the_logits(tmp_path):
    """Full rotary instead of partial (transformers), and the short factors instead of the
    long ones (ours, the same checkpoint served at 64 and at 512 positions)."""
    tokens = random_tokens(40, seed=7)
    partial = hf_logits(build_hf(tiny_config("phi3")), tokens)
    full = hf_logits(build_hf(tiny_config("phi3", partial_rotary_factor=1.0)), tokens)
    assert (partial - full).abs().max() > 1e-2
    path = save_hf(build_hf(tiny_config("phi3", **phi3_longrope(12))), tmp_path / "lr")
    logits = []
    for served in (64, 512):
        ours, _ = load_model(path, dtype=torch.float32, max_position=served)
        logits.append(PagedRunner(ours, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0])
    assert (logits[0] - logits[1]).abs().max() > 1e-2


# Phi-4-mini-instruct's config.json (transformers 4.x layout), its factors shortened.
PHI4_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064,
             "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 24, "num_key_value_heads": 8, "rope_theta": 10000.0,
             "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
             "partial_rotary_factor": 0.75, "sliding_window": 262144,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                              "long_factor": [2.0] * 48}}  # fmt: skip


def test_a_phi4_mini_config_json():
    c = ModelConfig.from_hf_config(PHI4_MINI)
    assert (c.head_dim, c.rotary_dim, c.sliding_window) == (128, 96, 262144)
    assert c.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 48,
                              "long_factor": [2.0] * 48,
                              "original_max_position_embeddings": 4096}  # fmt: skip
    su = {**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "type": "su"}}
    assert ModelConfig.from_hf_config(su).rope_scaling == c.rope_scaling
    assert resolve_max_model_len(c, None, 10**6) == 131072  # the window is past the context


def test_phi3_mini_4k_window_is_every_layers_and_does_not_cap_the_context():
    cfg = {**PHI4_MINI, "max_position_embeddings": 4096, "sliding_window": 2047,
           "rope_scaling": None, "partial_rotary_factor": 1.0}  # fmt: skip
    c = ModelConfig.from_hf_config(cfg)
    assert c.rope_scaling is None and c.rotary_dim == c.head_dim
    assert {c.layer_window(i) for i in range(c.num_hidden_layers)} == {2047}
    assert resolve_max_model_len(c, None, 10**6) == 4096


@pytest.mark.parametrize(
    "cfg, match",
    [({"architectures": ["LlamaForCausalLM"]}, "Phi-3 only"),
     ({"partial_rotary_factor": 0.7}, "rotary dims"),
     ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
      "need 48 values")],
)  # fmt: skip
def test_what_phi3_cannot_serve_is_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        c = ModelConfig.from_hf_config({**PHI4_MINI, **cfg, "num_hidden_layers": 1,
                                        "vocab_size": 64, "max_position_embeddings": 8192})  # fmt: skip
        load_model_shapes_only(c)


def load_model_shapes_only(config: ModelConfig) -> None:
    """Build the model without weights (its RoPE tables check the LongRoPE factors)."""
    from tinyserve.models.registry import model_class

    model_class(config)(config, torch.float32)


GGUF_CASES = {"partial": {}, "partial-longrope": phi3_longrope(12)}


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_equals_safetensors_and_quantised_blocks_serve(name, tmp_path):
    """llama.cpp's phi3 layout: F32 gives the safetensors' logits to the bit (the LongRoPE
    factors and attention factor read back from its tensors and keys); with Q4_1 / Q8_0
    attn_qkv / ffn_up / attn_output / ffn_down, transformers' logits with those exact weights
    on the kernels' own blocks (q/k rows taken in our order) through the one-call step."""
    from tinyserve.testing.gguf_writer import write_gguf

    hf = build_hf(tiny_config("phi3", **GGUF_CASES[name]))
    tokens = random_tokens(80, seed=9)
    st, _ = load_model(save_hf(hf, tmp_path / "st"), dtype=torch.float32)
    write_gguf(hf, tmp_path / "f32.gguf", {})
    gg, source = load_model(tmp_path / "f32.gguf", dtype=torch.float32)
    assert source.kind == "gguf" and gg.config.architecture == "Phi3ForCausalLM"
    floats = {"rms_norm_eps": pytest.approx(st.config.rms_norm_eps, rel=1e-6)}
    if st.config.rope_scaling is not None:  # float32 factors; the attention factor written
        rope = st.config.rope_scaling
        floats["rope_scaling"] = {**rope, "attention_factor": pytest.approx(1.5**0.5, rel=1e-6),
                                  **{k: pytest.approx(rope[k], rel=1e-6)
                                     for k in ("short_factor", "long_factor")}}  # fmt: skip
    assert dataclasses.asdict(gg.config) == {**dataclasses.asdict(st.config), **floats}
    one = PagedRunner(st, BLOCK_SIZE, num_blocks=32).step([("s", tokens)])[0]
    two = PagedRunner(gg, BLOCK_SIZE, num_blocks=32).step([("s", tokens)])[0]
    assert torch.equal(one, two)
    mix = {"attn_qkv": "Q4_1", "attn_output": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
    exact = write_gguf(hf, tmp_path / "q.gguf", mix)
    q, _ = load_model(tmp_path / "q.gguf", dtype=torch.float32, kernel_activations="float32")
    if attention.library() is not None:
        assert {m.method.name for n, m in q.linear_layers().items() if "layers" in n} == {
            "kernel-q4_1", "kernel-q8_0"}  # fmt: skip
        assert (q.model.step_plan is not None) == (step.library() is not None)
    hf.load_state_dict({**hf.state_dict(), **exact})
    got = PagedRunner(q, BLOCK_SIZE, num_blocks=32).prefill_then_decode(tokens, 70)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)

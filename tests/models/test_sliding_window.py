"""Sliding-window attention through the paged cache (issue 41 deliver 2), past the window: tiny
random Mistral (every layer windowed), Phi-3 (every layer) and Gemma 3 (local layers
windowed, one global) checkpoints with windows of 5-7 positions, against transformers' fp32
logits at a prefill that crosses the kernels' 64-key chunk boundary and at every
teacher-forced decode step after it, on the CPU kernels (the one-call fused step) and the
torch path; a batched step gives each sequence its logits alone; the fused step gives the
Python loop's bits; a prefix-cache hit past the window gives the miss's logits. The window is
transformers' convention: a query at position p sees keys p - window + 1 .. p."""

from __future__ import annotations

import random

import pytest
import torch

from tinyserve.kernels import attention, step
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, hf_logits, random_tokens, save_hf, tiny_config
from tinyserve.testing.paged_runner import PagedRunner, batched_and_alone, mixed_steps

BLOCK_SIZE, PROMPT_LEN, DECODE_STEPS = 4, 58, 12  # positions 0 .. 69: past key 64
WINDOWS = {"mistral": 5, "phi3": 7, "gemma3": 6}
# What layer_window gives per layer (the tiny Gemma 3: layer 1 of 3 global).
LAYER_WINDOWS = {"mistral": [5, 5, 5], "phi3": [7, 7, 7], "gemma3": [6, None, 6]}


@pytest.fixture(scope="module", params=list(WINDOWS))
def windowed(request, tmp_path_factory):
    name = request.param
    hf = build_hf(tiny_config(name, sliding_window=WINDOWS[name]))
    return name, save_hf(hf, tmp_path_factory.mktemp(name)), hf


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_every_decode_step_past_the_window_match_transformers(windowed, kernels):
    name, path, hf = windowed
    ours, _ = load_model(path, dtype=torch.float32, cpu_kernels=kernels)
    assert [layer.self_attn.window for layer in ours.model.layers] == LAYER_WINDOWS[name]
    on_kernels = kernels and attention.library() is not None
    assert ours.attention_method.name == ("kernel" if on_kernels else "torch")
    assert (ours.model.step_plan is not None) == (on_kernels and step.library() is not None)
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, seed=7)
    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=3)
    got = runner.prefill_then_decode(tokens, PROMPT_LEN)  # [every position, vocab]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_the_window_matters(windowed):
    """The same checkpoint without its window: transformers' logits past it move, so the
    parity above could not pass with full attention."""
    name, _, hf = windowed
    tokens = random_tokens(PROMPT_LEN, seed=7)
    # (Gemma 3's transformers code needs a window: every layer global instead.)
    over = {"layer_types": ["full_attention"] * 3} if name == "gemma3" else {"sliding_window": None}
    full = build_hf(tiny_config(name, **over))
    assert (hf_logits(full, tokens) - hf_logits(hf, tokens))[WINDOWS[name] :].abs().max() > 1e-2


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_chunked_prefill_past_the_window_matches_transformers(windowed, kernels):
    """Prompt chunks of 9 (each after a cached part longer than the window) then decode."""
    name, path, hf = windowed
    ours, _ = load_model(path, dtype=torch.float32, cpu_kernels=kernels)
    tokens = random_tokens(40, seed=8)
    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=4)
    got = torch.cat([runner.step([("s", tokens[i : i + 9])])[0] for i in range(0, 40, 9)])
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_a_batched_step_gives_each_sequence_its_logits_alone_bitwise(windowed):
    """batched_and_alone's sequences run to 13 and 9 tokens: past every window here (the
    CPU kernels, the batch-invariant path, as for every family)."""
    name, path, _ = windowed
    ours, _ = load_model(path, dtype=torch.float32)
    for label, batched, alone in batched_and_alone(ours, BLOCK_SIZE):
        assert torch.equal(batched, alone), f"{name} {label}"


@pytest.mark.skipif(step.library() is None, reason="needs the CPU kernels' one-call step")
def test_layers_in_one_c_call_equal_the_python_loop_bitwise(windowed):
    """step.c passes each layer's window to the attention: the loop's bits, on mixed
    prefill / decode steps and on 30 decode steps after a 10-token prompt."""
    models = [load_model(windowed[1], torch.float32, "cpu", fused_step=f)[0] for f in (1, 0)]
    assert [m.model.step_plan is not None for m in models] == [True, False]
    runs = [mixed_steps(PagedRunner(m, 4, num_blocks=64, seed=1), random.Random(2))
            + [PagedRunner(m, 4, num_blocks=64).prefill_then_decode(random_tokens(40, 3), 10)]
            for m in models]  # fmt: skip
    for fused, loop in zip(*runs, strict=True):
        assert torch.equal(fused, loop)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_a_prefix_cache_hit_past_the_window_gives_the_miss_logits(windowed, kernels):
    """Sequence b starts on a's first 24 tokens (6 blocks, several windows long) as a
    prefix-cache hit does, then computes its own 14: its logits are those of computing all
    38 itself (bitwise on the kernels, whose rows depend only on their position and keys)."""
    _, path, _ = windowed
    ours, _ = load_model(path, dtype=torch.float32, cpu_kernels=kernels)
    shared, own = random_tokens(24, seed=5), random_tokens(14, seed=6)
    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=2)
    runner.step([("a", shared + random_tokens(3, seed=9))])
    runner.share_prefix("b", "a", 24)
    hit = runner.step([("b", own)])[0]
    miss = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=8).step([("c", shared + own)])[0]
    if kernels and attention.library() is not None:
        assert torch.equal(hit, miss[24:])
    else:
        torch.testing.assert_close(hit, miss[24:], atol=1e-5, rtol=0)

"""--kv-cache-dtype bfloat16 on the CPU kernels: rope_and_cache stores K and V rounded as
torch rounds them; the attention kernel on a bf16 cache is bitwise the float32 kernel on
the same rounded values widened; step.c equals llama.py's loop on a bf16 cache; and an
engine with a bf16 cache holds twice the blocks, stays batch-invariant, refuses what it
cannot serve and answers like the float32 cache within bf16's rounding."""

from __future__ import annotations

import random

import pytest
import torch

from tinyserve.kernels import attention as attention_kernel
from tinyserve.kernels import ops, step
from tinyserve.layers.attention import AttentionMetadata, paged_attention
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, llama_config, qwen2_config, save_hf
from tinyserve.testing.paged_runner import PagedRunner, mixed_steps, random_paged_case

needs_kernels = pytest.mark.skipif(
    attention_kernel.library() is None or ops.library() is None,
    reason="needs an x86 CPU with AVX2/FMA and a C compiler",
)
BF16 = torch.bfloat16


@needs_kernels
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 2, 16, 4), (8, 1, 128, 8)]
)
def test_attention_on_a_bf16_cache_is_the_float_kernel_on_its_values(
    heads, kv_heads, dim, block_size
):
    query_lens, seq_lens = [1, 1, 7, 16, 2], [1, 37, 140, 200, 65]
    q, kc, vc, tables = random_paged_case(
        heads, kv_heads, dim, block_size, query_lens, seq_lens, heads
    )
    kb, vb = kc.to(BF16), vc.to(BF16)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, use_kernel=True)
    got = paged_attention(q, kb, vb, meta, dim**-0.5)
    want = paged_attention(q, kb.float(), vb.float(), meta, dim**-0.5)
    assert torch.equal(got, want)
    # ... and is not the float32 cache's answer (the rounding is real, and small).
    full = paged_attention(q, kc, vc, meta, dim**-0.5)
    assert 0 < (got - full).abs().max() < 0.05


@needs_kernels
def test_rope_and_cache_rounds_k_and_v_like_torch():
    H, KVH, D, T, block_size = 4, 2, 32, 5, 4
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen) * 3
    # Ties (low half exactly 0x8000, odd and even kept halves), infinities and a huge value.
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40808000 & 0xFFFFFFFF, 0x7F800000,
                         0xFF800000, 0x7F7FFFFF], dtype=torch.int64)  # fmt: skip
    qkv[0, (H + KVH) * D : (H + KVH) * D + 6] = ties.to(torch.int32).view(torch.float32)
    cos, sin = torch.randn(T, D // 2, generator=gen), torch.randn(T, D // 2, generator=gen)
    slots = torch.tensor([3, 0, 9, 14, 6])
    shape = (4, block_size, KVH, D)
    caches = {
        dt: (torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt))
        for dt in (torch.float32, BF16)
    }
    rotated = {}
    for dt, (k, v) in caches.items():
        x = qkv.clone()
        ops.rope_and_cache(x, cos, sin, k, v, slots, H, KVH)
        rotated[dt] = x
    assert torch.equal(rotated[torch.float32], rotated[BF16])  # q and k rotate the same
    for f32, b16 in zip(caches[torch.float32], caches[BF16], strict=True):
        assert torch.equal(b16.view(torch.int16), f32.to(BF16).view(torch.int16))
    assert caches[BF16][1].view(-1, KVH * D)[3].isinf().sum() == 3  # inf, -inf, overflow


@pytest.mark.skipif(step.library() is None, reason="needs the CPU kernels (AVX2/FMA, cc)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_c_call_equals_the_python_loop_on_a_bf16_cache(tmp_path, arch):
    path = save_hf(build_hf(llama_config() if arch == "llama" else qwen2_config()), tmp_path)
    fused, _ = load_model(path, torch.float32, "cpu")
    loop, _ = load_model(path, torch.float32, "cpu", fused_step=False)
    runs = [mixed_steps(PagedRunner(m, 4, num_blocks=64, seed=1, kv_dtype=dt), random.Random(2))
            for m, dt in ((fused, BF16), (loop, BF16), (fused, torch.float32))]  # fmt: skip
    for x, y, z in zip(*runs, strict=True):
        assert torch.equal(x, y)
        assert (x - z).abs().max() < 0.05 * z.abs().max()  # bf16 K/V: close, not equal
    assert any(not torch.equal(x, z) for x, z in zip(runs[0], runs[2], strict=True))

"""The GGUF block kernel (tinyserve/kernels): block parsing equals the gguf package's
dequantisation, the matmul equals dense fp32 on those weights, the model dispatches to it
only for few-row matmuls, and SmolLM2's logits do not move beyond float rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize
from paged_runner import PagedRunner
from torch import nn

from tinyserve.kernels import gguf_gemv
from tinyserve.layers import linear as linear_mod
from tinyserve.models.loader import load_model

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


def random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF bytes for an [n, k] tensor with random scales and codes."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    if qtype == Q4_1:
        d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
        m = rng.uniform(-0.2, 0.0, (n, nb, 1)).astype(np.float16).view(np.uint8)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        return np.concatenate([d, m, qs], axis=-1).reshape(n, nb * 20)
    d = rng.uniform(0.001, 0.02, (n, nb, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, qs], axis=-1).reshape(n, nb * 34)


needs_kernel = pytest.mark.skipif(
    not gguf_gemv.available(), reason="needs an x86 CPU with AVX2/FMA and a C compiler"
)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_blocks_dequantise_like_the_gguf_package(qtype):
    raw = random_blocks(qtype, 37, 96, seed=1)
    qw = gguf_gemv.from_gguf(raw, int(qtype), (37, 96))
    want = torch.from_numpy(dequantize(raw, qtype).reshape(37, 96).astype(np.float32))
    assert torch.equal(qw.dequantize(), want)


@needs_kernel
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_equals_dense_fp32(qtype, rows, threads):
    n, k = 203, 320  # n not a multiple of anything; k = 10 blocks
    qw = gguf_gemv.from_gguf(random_blocks(qtype, n, k, seed=rows), int(qtype), (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = (x.double() @ qw.dequantize().double().T).float()
    got = gguf_gemv.matmul(x, qw, num_threads=threads)
    assert got.shape == (rows, n)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
def test_take_rows_and_cat_rows_keep_rows_with_their_blocks():
    a = gguf_gemv.from_gguf(random_blocks(Q4_1, 8, 64, 2), int(Q4_1), (8, 64))
    b = gguf_gemv.from_gguf(random_blocks(Q4_1, 4, 64, 3), int(Q4_1), (4, 64))
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    fused = gguf_gemv.cat_rows([a.take_rows(order), b])
    want = torch.cat([a.dequantize()[order], b.dequantize()])
    assert torch.equal(fused.dequantize(), want)
    x = torch.randn(2, 64)
    assert torch.allclose(gguf_gemv.matmul(x, fused), x @ want.T, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_linear_uses_the_blocks_only_for_few_rows():
    qw = gguf_gemv.from_gguf(random_blocks(Q8_0, 16, 64, 4), int(Q8_0), (16, 64))
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(16, 64), requires_grad=False)  # differs on purpose
    module.quant = qw
    limit = linear_mod.QUANT_MAX_ROWS
    few, many = torch.randn(limit, 64), torch.randn(limit + 1, 64)
    assert torch.allclose(linear_mod.linear(few, module), few @ qw.dequantize().T, atol=1e-5)
    assert torch.equal(linear_mod.linear(many, module), torch.zeros(limit + 1, 16))


@needs_kernel
def test_smollm2_logits_with_and_without_the_kernel(smollm2_gguf_path):
    with_k, _ = load_model(smollm2_gguf_path, torch.float32, "cpu")
    without, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", gguf_kernels=False)
    quantised = [m for m in with_k.modules() if getattr(m, "quant", None) is not None]
    assert len(quantised) == 4 * with_k.config.num_hidden_layers + 1  # 4 per layer + LM head
    assert not any(getattr(m, "quant", None) is not None for m in without.modules())
    tokens = list(range(200, 236))
    a = PagedRunner(with_k, 16).prefill_then_decode(tokens, 20)  # decode rows use the kernel
    b = PagedRunner(without, 16).prefill_then_decode(tokens, 20)
    assert torch.equal(a[:20], b[:20])  # prefill (20 rows) takes the fp32 GEMM either way
    assert (a[20:] - b[20:]).abs().max() < 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("TINYSERVE_GGUF_KERNELS", "0")
    gguf_gemv.library.cache_clear()
    try:
        assert not gguf_gemv.available()
    finally:
        monkeypatch.delenv("TINYSERVE_GGUF_KERNELS")
        gguf_gemv.library.cache_clear()

"""gemm.c's bf16-activation path (kernels/gemm_bf16.h, ``--kernel-activations bfloat16``):
on Q4_1 / Q8_0 blocks it equals the float64 product of the bf16-rounded activations and the
exact weights to float32 accumulation, stays within one bf16 rounding of the unrounded
product, and every output is bitwise the same whatever the row count, the row's place in
the batch and the thread count (the batch-invariance contract). Runs where the CPU has
AVX512-BF16; elsewhere the flag must be refused, and "auto" must pick float32."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from tests.support.kernels import random_blocks, tp1
from tinyserve.kernels import gemm
from tinyserve.layers.linear import PackedMethod, resolve_kernel_activations

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
BF16_EPS = 2.0**-8  # bf16's round-to-nearest: relative error <= 2^-9, taken with 2x margin

needs_bf16 = pytest.mark.skipif(
    not gemm.bf16_available(),
    reason="needs a CPU with AVX512-BF16 (vdpbf16ps) and a C compiler",
)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)  # round to nearest even, as cvtneps_pbh


@needs_bf16
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_bf16_kernel_equals_its_reference_and_is_batch_invariant(qtype):
    n, k, m = 203, 320, 300  # 203 outputs: a tail group of 11 lanes
    w = gemm.from_gguf(random_blocks(qtype, n, k, seed=21), int(qtype), (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(22)) * 3
    x[7] = 0.0  # an all-zero row
    dense = w.dequantize().double()
    want = _bf16(x).double() @ dense.T
    full = gemm.matmul(x, w, num_threads=2, bf16=True)
    assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(full[7], torch.zeros(n))
    exact = x.double() @ dense.T
    err = (full.double() - exact).abs()
    bound = BF16_EPS * (x.double().abs() @ dense.abs().T) + 1e-5 * exact.abs().max()
    assert (err <= bound).all()
    assert err.max() > 1e-4 * exact.abs().max()  # the rounding is real: not the float kernel
    # Few-row tiles (codes converted in registers), panel tiles (through the buffer), row
    # counts across one and several panels, 1 and 2 threads: the same bits per row.
    # 7-12 rows: one wide tile of 1 group (gemm_bf16.h, bf16_rows).
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 10, 12, 13, 24, 25, 64, 129, 300):  # few-row: <= 24
        for threads in (1, 2):
            got = gemm.matmul(x[:rows], w, num_threads=threads, bf16=True)
            assert torch.equal(got, full[:rows]), (rows, threads)
    assert torch.equal(gemm.matmul(x[37:38], w, bf16=True), full[37:38])
    assert torch.equal(gemm.matmul(x[150:161], w, bf16=True), full[150:161])


@needs_bf16
def test_a_float_weight_has_no_bf16_kernel():
    w = gemm.from_dense(torch.randn(8, 64))
    with pytest.raises(ValueError, match="no bf16-activation kernel"):
        gemm.matmul(torch.randn(2, 64), w, bf16=True)
    assert PackedMethod(w, bf16=True).name == "kernel-f32"  # the flag does not apply to it


@pytest.mark.skipif(not gemm.available() or gemm.bf16_available(), reason="needs a CPU "
                    "with the kernels but without AVX512-BF16, where the flag is refused")  # fmt: skip
def test_without_avx512_bf16_the_call_is_refused_and_auto_is_float32():
    w = gemm.from_gguf(random_blocks(Q4_1, 16, 64, seed=1), int(Q4_1), (16, 64))
    with pytest.raises(ValueError, match="no bf16-activation kernel"):
        gemm.matmul(torch.randn(2, 64), w, bf16=True)
    assert PackedMethod(w, bf16=True).name == "kernel-q4_1"
    assert resolve_kernel_activations("auto") == "float32"


def test_kernel_activations_are_checked():
    want = "bfloat16" if gemm.bf16_available() else "float32"
    assert resolve_kernel_activations("auto") == want
    assert resolve_kernel_activations("float32") == "float32"
    with pytest.raises(ValueError, match="kernel_activations 'fp8'"):
        resolve_kernel_activations("fp8")


@needs_bf16
def test_packed_method_rounds_prompt_rows_to_bf16_and_keeps_int8_decode_rows():
    from tinyserve.layers.linear import LinearBase

    w = gemm.from_gguf(random_blocks(Q8_0, 70, 96, seed=9), int(Q8_0), (70, 96))
    layer = LinearBase(96, 70, bias=False, dtype=torch.float32, tp=tp1())
    layer.set_method(PackedMethod(w, int8_decode=True, bf16=True))
    assert layer.method.name == "kernel-q8_0+bf16+int8-decode"
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(10))
    y = layer(x, num_decode=2)
    assert torch.equal(y[:2], gemm.matmul_q8(x[:2], w))
    assert torch.equal(y[2:], gemm.matmul(x[2:], w, bf16=True))
    layer.set_method(PackedMethod(w, bf16=True))
    assert torch.equal(layer(x, num_decode=2), gemm.matmul(x, w, bf16=True))

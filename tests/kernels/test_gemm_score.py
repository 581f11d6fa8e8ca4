"""gemm_score.h (kernels.gemm.score_rows): prompt logprobs straight from the LM head's tiles,
never writing the logits, against the path it replaces — gemm's logits, then ops.c's
logprob_rows (itself checked against float64 in test_logprob_rows.py): ranks and top-k ids
exact, logprobs within two float32 roundings of the log-sum-exp (the sum of exp is merged
from slices of 256 outputs, in double), and per row the same bits whatever the row count,
the thread count and the tiling. Every weight kind, float32 and bf16 activations where the
CPU has them, and the AMX tiles in their scalar emulation (any CPU)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from tests.support.kernels import random_blocks, typed
from tinyserve.kernels import build, gemm, ops

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
N, K = 1003, 320  # 4 slices, the last partial and ending in a partial group

needs_kernel = pytest.mark.skipif(
    not gemm.available() or ops.library() is None,
    reason="needs an x86 CPU with AVX2/FMA/F16C and a C compiler",
)


def _weight(kind: str) -> gemm.PackedWeight:
    if kind in ("f32", "bf16"):
        dense = gemm.from_dense if kind == "f32" else gemm.from_dense_bf16
        return dense(torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.05)
    qtype = Q4_1 if kind == "q4_1" else Q8_0
    return gemm.from_gguf(random_blocks(qtype, N, K, seed=5), int(qtype), (N, K))


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, K, generator=g) * 2
    x[4] = 0.0  # every logit equal (or nearly: Q4_1's minima): ties broken by id
    targets = torch.randint(0, N, (300,), generator=g)
    targets[:3] = torch.tensor([0, N - 1, 1000])  # the first id, the last (in the tail group)
    return x, targets


def _unfused(x, w, targets, k, bf16, matmul=None):
    logits = matmul(x) if matmul else gemm.matmul(x, w, bf16=bf16)
    return ops.logprob_rows(logits, targets, k)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within two float32 roundings of the log-sum-exp: ~2.4e-7 relative (a logprob below
    -32 is 3.8e-6 from its neighbour), 1e-6 absolute."""
    return bool(((a - b).abs() <= 1e-6 + 2.4e-7 * b.abs()).all())


def _assert_close(got, ref, k):
    lp, rank, top_ids, top_lp = got
    assert torch.equal(rank, ref[1])
    assert torch.equal(top_ids, ref[2])
    assert _close(lp, ref[0])
    if k:
        assert _close(top_lp, ref[3])


def _assert_invariant(score, x, targets, full):
    """Per row the same bits in fewer rows (one, within a panel, across panels) and with 1-3
    threads."""
    for lo, hi in ((0, 1), (4, 5), (0, 17), (130, 300), (0, 300)):
        for threads in (1, 2, 3):
            got = score(x[lo:hi], targets[lo:hi], threads)
            for a, b in zip(got, full, strict=True):
                assert torch.equal(a, b[lo:hi]), (lo, hi, threads)


needs_bf16 = pytest.mark.skipif(
    not gemm.bf16_available(), reason="needs a CPU with AVX512-BF16 (vdpbf16ps)"
)
KINDS = [("q4_1", False), ("q8_0", False), ("f32", False),
         pytest.param("q4_1", True, marks=needs_bf16), pytest.param("q8_0", True, marks=needs_bf16),
         pytest.param("bf16", True, marks=needs_bf16)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("kind, bf16", KINDS)
@pytest.mark.parametrize("k", [0, 1, 7, 32])
def test_score_rows_equal_logits_then_logprob_rows(kind, bf16, k):
    w, (x, targets) = _weight(kind), _rows()
    full = gemm.score_rows(x, w, targets, k, bf16, num_threads=2)
    _assert_close(full, _unfused(x, w, targets, k, bf16), k)
    if k == 7:  # the zero row's logits tie (Q8_0, float: all of them): the lowest ids first
        if kind != "q4_1":
            assert full[2][4].tolist() == list(range(7))

        def score(xs, ts, threads):
            return gemm.score_rows(xs, w, ts, k, bf16, num_threads=threads)

        _assert_invariant(score, x, targets, full)


@needs_kernel
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_score_rows_on_emulated_amx_tiles(qtype):
    """The AMX path (rows padded to tiles of 16, panels of activations taken as calls of
    their own) in amx_tile.h's emulation, for each group width this CPU builds."""
    levels = ["avx2"] + [lv for lv in ("avx512_bf16", "avx512") if lv in build.usable_levels()][:1]
    w = gemm.from_gguf(random_blocks(qtype, N, K, seed=7), int(qtype), (N, K))
    x, targets = _rows()
    for level in levels:
        lib = gemm.bind_score(ctypes.CDLL(str(build.built("gemm", level, emulate_amx=True))))
        kw = gemm.KernelWeight.of(w, lib.gemm_group_width())

        def logits(xs, lib=lib, kw=kw):
            return gemm._run(typed(lib, "gemm"), "matmul", xs, kw, 2, None, gemm.BF16_ACT)

        def score(xs, ts, threads, lib=lib, kw=kw):
            return gemm.score_rows(xs, kw, ts, 5, True, num_threads=threads, lib=lib)

        full = score(x, targets, 2)
        _assert_close(full, _unfused(x, w, targets, 5, True, matmul=logits), 5)
        _assert_invariant(score, x, targets, full)


@needs_kernel
def test_score_rows_checks_its_arguments():
    w, (x, targets) = _weight("q8_0"), _rows()
    x, targets = x[:4], targets[:4]
    with pytest.raises(ValueError, match="k 33"):
        gemm.score_rows(x, w, targets, 33)
    with pytest.raises(ValueError, match="targets"):
        gemm.score_rows(x, w, torch.tensor([0, 1, 2, N]), 1)
    with pytest.raises(ValueError, match="targets"):
        gemm.score_rows(x, w, targets[:3], 1)
    small = gemm.from_dense(torch.randn(10, K))  # k past the vocabulary: garbage slots, refused
    with pytest.raises(ValueError, match="k 11"):
        gemm.score_rows(x, small, targets.clamp(max=9), 11)
    with pytest.raises(ValueError, match="k 11"):
        ops.logprob_rows(torch.randn(4, 10), targets.clamp(max=9), 11)
    empty = gemm.score_rows(x[:0], w, targets[:0], 2)
    assert [tuple(t.shape) for t in empty] == [(0,), (0,), (0, 2), (0, 2)]

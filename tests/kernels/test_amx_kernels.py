"""gemm.c's bf16 path on AMX tiles (kernels/gemm_amx.h over amx_tile.h). On every CPU the
tiles run in amx_tile.h's scalar emulation (the same tiling, packing and K order): it equals
the float64 product of the bf16-rounded activations and the exact weights to float32
accumulation, every output is bitwise the same whatever the row count and thread count, and
a block is summed as TDPBF16PS sums it (two chains, over the pairs' first and second
elements). On a CPU with AMX the hardware build is chosen and equals the emulation bitwise."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from tests.support.kernels import random_blocks, typed
from tinyserve.kernels import build, gemm
from tinyserve.utils.cpu import AMX_FLAGS, amx_permitted, cpu_flags

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
ROWS = (1, 2, 3, 5, 15, 16, 17, 31, 33, 64, 129, 300)

needs_kernel = pytest.mark.skipif(
    not gemm.available(), reason="needs an x86 CPU with AVX2/FMA/F16C and a C compiler"
)
needs_amx = pytest.mark.skipif(
    not gemm.amx_active(), reason="needs a CPU with AMX-BF16 (and Linux's grant of the tile state)"
)


def _level_builds(emulate: bool) -> dict[str, ctypes.CDLL]:
    """gemm.c, AMX tiles emulated, for AVX2 (8-output groups) and, where this CPU runs it,
    AVX-512 (16); or (emulate False) the hardware AMX build."""
    levels = ["avx2"] + [lv for lv in ("avx512_bf16", "avx512") if lv in build.usable_levels()][:1]
    if not emulate:
        levels = ["amx"]
    return {lv: ctypes.CDLL(str(build.built("gemm", lv, emulate_amx=emulate))) for lv in levels}


@pytest.fixture(scope="module")
def emulated():
    return _level_builds(emulate=True)


def _matmul(lib: ctypes.CDLL, x: torch.Tensor, w: gemm.PackedWeight, threads: int) -> torch.Tensor:
    kw = gemm.KernelWeight.of(w, lib.gemm_group_width())
    return gemm._run(typed(lib, "gemm"), "matmul", x, kw, threads, None, gemm.BF16_ACT)


def _case(qtype, seed: int):
    n, k = 203, 320  # a tail group; 10 blocks (an odd block count after pairs of tiles)
    w = gemm.from_gguf(random_blocks(qtype, n, k, seed=seed), int(qtype), (n, k))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(seed + 1)) * 3
    x[7] = 0.0  # an all-zero row
    x[8, :5] = 1e-39  # float32 denormals: rounded to bf16 as zeros (vcvtneps2bf16 flushes)
    x[9] = 1e-39  # a whole row of them: its Q4_1 block sums must be zero too
    return w, x


@needs_kernel
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_emulated_tiles_equal_the_reference_and_are_batch_invariant(qtype, emulated):
    w, x = _case(qtype, seed=31)
    want = x.to(torch.bfloat16).double() @ w.dequantize().double().T
    first = None
    for level, lib in emulated.items():
        assert lib.amx_emulated() == 1 and lib.gemm_amx() == 1
        full = _matmul(lib, x, w, 2)
        assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max(), level
        assert torch.equal(full[7], torch.zeros(w.shape[0]))
        for rows in ROWS:  # one tile of few rows (codes packed per block), panels of 16
            for threads in (1, 2):
                got = _matmul(lib, x[:rows], w, threads)
                assert torch.equal(got, full[:rows]), (level, rows, threads)
        assert torch.equal(_matmul(lib, x[37:38], w, 1), full[37:38])
        # 8 lanes a group or 16: the same operations per output, the same bits.
        first = full if first is None else first
        assert torch.equal(full, first), level


def _cancelling_block() -> tuple[gemm.PackedWeight, torch.Tensor]:
    """One Q8_0 block (d = 1) whose pairs' first elements cancel: codes 1 at 0, 1, 16 and
    x = (2^30, -2^30, 0, ..., x_16 = 1, ...). Two chains (the tile): te = 2^30 - 2^30 = 0,
    to = 1, y = 1. vdpbf16ps's one chain (gemm_bf16.h) adds 1 + 2^30 -> 2^30 first: y = 0."""
    codes = np.zeros(32, np.int8)
    codes[[0, 1, 16]] = 1
    raw = np.concatenate([np.array([1.0], np.float16).view(np.uint8), codes.view(np.uint8)])
    w = gemm.from_gguf(np.tile(raw, (16, 1)), int(Q8_0), (16, 32))
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16] = 2.0**30, -(2.0**30), 1.0
    return w, x


@needs_kernel
def test_a_block_is_summed_as_two_chains_like_tdpbf16ps(emulated):
    w, x = _cancelling_block()
    for level, lib in emulated.items():
        assert torch.equal(_matmul(lib, x, w, 1), torch.ones(1, 16)), level
    if gemm.bf16_available() and not gemm.amx_active():  # the vdpbf16ps contract, for contrast
        assert torch.equal(gemm.matmul(x, w, bf16=True), torch.zeros(1, 16))


@needs_amx
def test_the_tile_hardware_sums_as_the_emulation():
    w, x = _cancelling_block()
    assert torch.equal(gemm.matmul(x, w, bf16=True), torch.ones(1, 16))


@needs_amx
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_amx_hardware_equals_the_emulation_bitwise(qtype, emulated):
    (lib,) = _level_builds(emulate=False).values()
    assert lib.gemm_amx() == 1 and lib.amx_emulated() == 0
    w, x = _case(qtype, seed=41)
    for level, emu in emulated.items():  # avx2: the scalar activations too, not only the tiles
        want = _matmul(emu, x, w, 2)
        for rows in ROWS:
            for threads in (1, 2):
                got = _matmul(lib, x[:rows], w, threads)
                assert torch.equal(got, want[:rows]), (level, rows, threads)
    # The engine's own entry point takes the same path.
    assert torch.equal(gemm.matmul(x, w, bf16=True), want)


def test_amx_is_chosen_where_the_cpu_has_it_and_linux_grants_it():
    has = AMX_FLAGS <= cpu_flags()
    assert ("amx" in build.usable_levels()) == (has and amx_permitted())
    if has and amx_permitted() and gemm.available():
        assert build.isa_level() == "amx" and gemm.amx_active()
        assert gemm.bf16_engine().startswith("AMX")
    elif gemm.bf16_available():
        assert not gemm.amx_active() and "vdpbf16ps" in gemm.bf16_engine()

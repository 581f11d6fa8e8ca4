"""attention.c's chunks on AMX tiles (kernels/attention_amx.h). On every CPU the tiles run in
amx_tile.h's scalar emulation, built for AVX2 and (where this CPU runs it) AVX-512 BF16, whose
packing and softmax take other instructions: both equal a float64 reference of the tiles'
contract (q, k, v and p rounded to bf16, float32 sums), give each row bitwise what it gives
alone (a decode row, a verification run, a prompt chunk, any rows around it), and give each
other's bits. On a CPU with AMX the build this machine loads runs the hardware tiles and
equals the emulation bitwise."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.support.attention import assert_rows_alone, attend, bf16_reference
from tinyserve.kernels import attention as attention_kernel
from tinyserve.kernels import build
from tinyserve.layers.attention import reference_paged_attention
from tinyserve.testing.paged_runner import random_paged_case

pytestmark = pytest.mark.skipif(
    attention_kernel.library() is None, reason="needs an x86 CPU with AVX2/FMA and a C compiler"
)


@pytest.fixture(scope="module")
def emulated() -> dict[str, ctypes.CDLL]:
    levels = ["avx2"] + [lv for lv in ("avx512_bf16",) if lv in build.usable_levels()]
    return {lv: attention_kernel.typed(ctypes.CDLL(str(build.built("attention", lv, emulate_amx=True))))
            for lv in levels}  # fmt: skip


# Rows of one key to several 64-key chunks, on both sides of chunk and 32-key boundaries, a
# run of 70 rows (two row groups), a prompt chunk starting mid-sequence (a prefix-cache hit).
QUERY_LENS = [1, 1, 7, 1, 70, 3, 2, 33]
SEQ_LENS = [1, 37, 140, 32, 200, 49, 65, 300]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 2, 32), (14, 2, 64)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_tiles_equal_their_float64_contract_and_each_other(emulated, heads, kv_heads, dim, kv_dtype):
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS, seed=dim)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    args = (q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
    outs = {lv: attend(lib, *args) for lv, lib in emulated.items()}
    first = next(iter(outs.values()))
    assert attention_kernel.uses_tiles(dim, next(iter(emulated.values())))
    contract = bf16_reference(*args)
    exact = reference_paged_attention(q, kc.float(), vc.float(), QUERY_LENS, SEQ_LENS, tables,
                                      dim**-0.5)  # fmt: skip
    # float32 sums and exp256 against float64 (a p may round to its other bf16 neighbour).
    assert (first.double() - contract).abs().max() < 2e-3
    # bf16 attention against float32: the precision the tiles give up.
    assert 1e-4 < (first - exact).abs().max() < 3e-2
    for out in outs.values():
        assert torch.equal(out, first)
    if kv_dtype == torch.float32:  # the tiles round k and v as they load them: a bf16 cache's bits
        bf = (q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), *args[3:])
        assert torch.equal(attend(next(iter(emulated.values())), *bf), first)


def test_each_row_is_bitwise_what_it_gives_alone(emulated):
    """A row's partials do not depend on the rows, queries or tiles it shares: every row of a
    70-row run (a prompt chunk after 130 cached keys) equals that row as a decode row alone,
    and a whole batch equals each sequence alone."""
    heads, kv_heads, dim = 9, 3, 64
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS, seed=3)
    for lib in emulated.values():
        args = (q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
        assert_rows_alone(lib, *args, attend(lib, *args))


@pytest.mark.parametrize("window", [1, 5, 31, 64, 65, 100])
def test_a_sliding_window_on_tiles_equals_its_contract_and_each_row_alone(emulated, window):
    """Keys left of a query's window (in its first chunk: masked to p = 0, before the
    chunk: not read) drop out of its partials: the tile contract over the last ``window``
    keys; each row bitwise what it gives alone; every build the same bits."""
    heads, kv_heads, dim = 8, 2, 64
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS, seed=4)
    args = (q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
    outs = [attend(lib, *args, window=window) for lib in emulated.values()]
    assert (outs[0].double() - bf16_reference(*args, window=window)).abs().max() < 2e-3
    for out in outs:
        assert torch.equal(out, outs[0])
    if attention_kernel.uses_tiles(dim):  # this CPU's build: the hardware tiles, same bits
        assert torch.equal(attend(None, *args, window=window), outs[0])
    lib, start = next(iter(emulated.values())), 0
    for ql, sl, table in zip(QUERY_LENS, SEQ_LENS, tables, strict=True):
        for i in range(0, ql, 5):
            row = attend(lib, q[start + i : start + i + 1], kc, vc, [1], [sl - ql + i + 1],
                         [table], dim**-0.5, window=window)  # fmt: skip
            assert torch.equal(row[0], outs[0][start + i])
        start += ql


def test_heads_of_no_whole_tile_and_the_float_entry_points_keep_the_float_chunk(emulated):
    """head_dim % 32 != 0, or the entry points without _tiles (a model with float32
    activations): the emulated AMX build computes the float32 chunk, bitwise the plain
    build's at its level."""
    heads, kv_heads, dim = 4, 2, 48
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, [1, 9], [40, 90], seed=7)
    lib = emulated["avx2"]
    assert not attention_kernel.uses_tiles(dim, lib)
    plain = attention_kernel.typed(ctypes.CDLL(str(build.built("attention", "avx2"))))
    args = (q, kc, vc, [1, 9], [40, 90], tables, dim**-0.5)
    assert torch.equal(attend(lib, *args), attend(plain, *args))
    q, kc, vc, tables = random_paged_case(9, 3, 64, 16, [1, 9], [40, 90], seed=7)
    args = (q, kc, vc, [1, 9], [40, 90], tables, 0.125)
    assert not torch.equal(attend(lib, *args), attend(lib, *args, tiles=False))
    assert torch.equal(attend(lib, *args, tiles=False), attend(plain, *args, tiles=False))


@pytest.mark.skipif("amx" not in build.usable_levels(),
                    reason="needs a CPU with AMX-BF16 (and Linux's grant of the tile state)")  # fmt: skip
def test_this_amx_cpu_runs_the_hardware_tiles_with_the_emulations_bits(emulated):
    lib = attention_kernel.library()
    assert build.isa_level() == "amx" and attention_kernel.uses_tiles(64, lib)
    for heads, kv_heads, dim in [(9, 3, 64), (8, 1, 128)]:
        q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS,
                                              seed=11)  # fmt: skip
        for kv_dtype in (torch.float32, torch.bfloat16):
            args = (q, kc.to(kv_dtype), vc.to(kv_dtype), QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
            hardware = attend(lib, *args)
            for emu in emulated.values():
                assert torch.equal(hardware, attend(emu, *args))

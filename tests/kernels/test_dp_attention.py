"""attention.c's chunks as AVX-512 BF16 dot products (kernels/attention_dp.h: the bf16-product
entry points of the avx512_bf16 build, which has no AMX tiles): within the float64 reference
of the bf16 contract (q, k, v and p rounded to bf16, float32 sums), each row bitwise what it
gives alone (a decode row, a verification run, a prompt chunk after cached keys, any rows
around it), the same bits from a float32 cache as from its bf16 rounding, sliding windows,
and the float32 chunk where a head is no whole 32. Built and run wherever the CPU has
AVX-512 BF16 (an AMX CPU too: the build without tiles)."""

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
    "avx512_bf16" not in build.usable_levels(), reason="needs a CPU with AVX-512 BF16"
)

# Rows of one key to several 64-key chunks, on both sides of the 16- and 32-key boundaries,
# runs of 70 and 100 rows (more queries than a block of 48), a prompt chunk after cached keys.
QUERY_LENS = [1, 1, 7, 1, 70, 3, 2, 33, 100]
SEQ_LENS = [1, 37, 140, 32, 200, 49, 65, 300, 190]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    dp = attention_kernel.typed(ctypes.CDLL(str(build.built("attention", "avx512_bf16"))))
    assert dp.attention_bf16_products() and not dp.attention_amx()
    return dp


# d in steps of 4 blocks of 16, then 2 (96, 160); 8 of them (256); one KV head; G of 7.
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(9, 3, 64), (8, 1, 128), (4, 2, 32), (14, 2, 64), (6, 2, 96), (8, 2, 256), (6, 2, 160)],
)
def test_dot_products_equal_the_float64_contract(lib, heads, kv_heads, dim):
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS, seed=dim)
    args = (q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
    assert attention_kernel.uses_bf16_products(dim, lib)
    out = attend(lib, *args)
    exact = reference_paged_attention(q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
    # float32 sums and exp against float64 (a p may round to its other bf16 neighbour) ...
    assert (out.double() - bf16_reference(*args)).abs().max() < 2e-3
    # ... and against float32 attention: the precision bf16 products give up.
    assert 1e-4 < (out - exact).abs().max() < 3e-2
    # K and V are rounded as they are loaded: a bf16 cache gives the same bits.
    bf = (q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), *args[3:])
    assert torch.equal(attend(lib, *bf), out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_bitwise_what_it_gives_alone(lib, kv_dtype):
    """A row's partials do not depend on the queries of its pass or block, the rows of its
    group or the step: every row of each run equals that row as a decode row alone, and the
    whole batch equals each sequence alone."""
    heads, kv_heads, dim = 9, 3, 64
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS, seed=3)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    args = (q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
    assert_rows_alone(lib, *args, attend(lib, *args))


@pytest.mark.parametrize("window", [1, 5, 31, 64, 65, 100])
def test_a_sliding_window_equals_its_contract_and_each_row_alone(lib, window):
    heads, kv_heads, dim = 8, 2, 64
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, QUERY_LENS, SEQ_LENS, seed=4)
    args = (q, kc, vc, QUERY_LENS, SEQ_LENS, tables, dim**-0.5)
    out = attend(lib, *args, window=window)
    # A window of a few keys weighs each p that rounds to its other bf16 neighbour more (the
    # emulated AMX tiles: the same 3.1e-3 at most over windows of 2-8 keys and three seeds).
    assert (out.double() - bf16_reference(*args, window=window)).abs().max() < 4e-3
    assert_rows_alone(lib, *args, out, every=5, window=window)


def test_heads_of_no_whole_32_and_the_float_entry_points_keep_the_float_chunk(lib):
    heads, kv_heads, dim = 4, 2, 48
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, 16, [1, 9], [40, 90], seed=7)
    assert not attention_kernel.uses_bf16_products(dim, lib)
    args = (q, kc, vc, [1, 9], [40, 90], tables, dim**-0.5)
    assert torch.equal(attend(lib, *args), attend(lib, *args, tiles=False))
    q, kc, vc, tables = random_paged_case(9, 3, 64, 16, [1, 9], [40, 90], seed=7)
    args = (q, kc, vc, [1, 9], [40, 90], tables, 0.125)
    plain = attention_kernel.typed(ctypes.CDLL(str(build.built("attention", "avx2"))))
    float32 = attend(lib, *args, tiles=False)
    assert not torch.equal(attend(lib, *args), float32)
    assert (attend(lib, *args) - float32).abs().max() < 3e-2
    assert torch.equal(float32, attend(plain, *args, tiles=False))

"""Sliding-window attention in every block-table path against the float64 reference with the
same window (a query at position p sees keys p - window + 1 .. p): the CPU kernel's float
chunk at every ISA level this CPU runs (windows inside a chunk, on its edges, across
chunks; a row bitwise what it gives alone), the torch path's windowed masks, the masked
decode form and the Triton decode kernel (on a CPU under its interpreter). The AMX tiles'
window: test_amx_attention.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tinyserve.kernels import attention as attention_kernel
from tinyserve.kernels import build, triton_attention
from tinyserve.layers.attention import AttentionMetadata, paged_attention, reference_paged_attention
from tinyserve.layers.decode_attention import masked_decode_attention
from tinyserve.testing.paged_runner import random_paged_case

# Rows of one key to five chunks, a 70-row prompt chunk after 230 cached keys (groups of 8
# rows whose windows start in different chunks), decode rows on both sides of key 64.
QUERY_LENS = [1, 1, 7, 1, 16, 3, 2, 70]
SEQ_LENS = [1, 37, 140, 8, 200, 13, 65, 300]
WINDOWS = [1, 3, 8, 63, 64, 65, 100, 1000]
needs_kernel = pytest.mark.skipif(attention_kernel.library() is None,
                                  reason="needs an x86 CPU with AVX2/FMA and a C compiler")  # fmt: skip


def _reference(q, kc, vc, tables, dim, window, query_lens=QUERY_LENS, seq_lens=SEQ_LENS):
    return reference_paged_attention(q, kc, vc, query_lens, seq_lens, tables, dim**-0.5,
                                     window=window)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 2, 16, 4),
                                                           (8, 1, 128, 8)])  # fmt: skip
def test_the_kernel_matches_the_reference_at_every_isa_level(heads, kv_heads, dim, block_size,
                                                             kv_dtype):  # fmt: skip
    """On a float32 and a bf16 cache (paged_attention_bf16: the rounded values exactly)."""
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, block_size, QUERY_LENS,
                                          SEQ_LENS, seed=dim)  # fmt: skip
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    libs = [attention_kernel.typed(ctypes.CDLL(str(build.built("attention", lv))))
            for lv in build.usable_levels()]  # fmt: skip
    meta = AttentionMetadata.build(QUERY_LENS, SEQ_LENS, tables, block_size, use_kernel=True)
    k = meta.kernel
    for window in WINDOWS:
        outs = [attention_kernel.paged_attention(q, kc, vc, k.query_start_loc, k.seq_lens,
                                                 k.seq_of_token, k.block_tables, dim**-0.5,
                                                 lib=lib, window=window) for lib in libs]  # fmt: skip
        want = _reference(q, kc.float(), vc.float(), tables, dim, window)
        assert (outs[0] - want).abs().max() < 1e-5
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), window
    full = paged_attention(q, kc, vc, meta, dim**-0.5)
    assert torch.equal(full, paged_attention(q, kc, vc, meta, dim**-0.5, window=10**6))


@needs_kernel
@pytest.mark.parametrize("window", [5, 64, 70])
def test_each_row_is_bitwise_what_it_gives_alone(window):
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, bs, QUERY_LENS, SEQ_LENS, seed=2)
    meta = AttentionMetadata.build(QUERY_LENS, SEQ_LENS, tables, bs, use_kernel=True)
    batch = paged_attention(q, kc, vc, meta, dim**-0.5, window=window)
    start = 0
    for ql, sl, table in zip(QUERY_LENS, SEQ_LENS, tables, strict=True):
        for i in range(0, ql, 3):
            alone = AttentionMetadata.build([1], [sl - ql + i + 1], [table], bs, use_kernel=True)
            row = paged_attention(q[start + i : start + i + 1], kc, vc, alone, dim**-0.5,
                                  window=window)  # fmt: skip
            assert torch.equal(row[0], batch[start + i])
        start += ql


@pytest.mark.parametrize("decode_backend", [None, "masked"])
def test_the_torch_path_masks_each_query_to_its_window(decode_backend):
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, bs, QUERY_LENS, SEQ_LENS, seed=3)
    for window in WINDOWS:
        meta = AttentionMetadata.build(QUERY_LENS, SEQ_LENS, tables, bs, sliding_window=window,
                                       decode_backend=decode_backend)  # fmt: skip
        got = paged_attention(q, kc, vc, meta, dim**-0.5, window=window)
        assert (got - _reference(q, kc, vc, tables, dim, window)).abs().max() < 1e-5
        full = paged_attention(q, kc, vc, meta, dim**-0.5)  # the full layers' masks beside
        assert (full - _reference(q, kc, vc, tables, dim, None)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="sliding_window=None, a layer asks for 5"):
        paged_attention(q, kc, vc, AttentionMetadata.build(QUERY_LENS, SEQ_LENS, tables, bs),
                        dim**-0.5, window=5)  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window must be > 0"):
        AttentionMetadata.build(QUERY_LENS, SEQ_LENS, tables, bs, sliding_window=0)


def _decode_case(device):
    heads, kv_heads, dim, bs = 6, 2, 32, 4
    seq_lens = [1, 5, 9, 64, 65, 130]
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, bs, [1] * 6, seq_lens, seed=6)
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    dev = torch.device(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return q.contiguous(), kc, vc, tables, seq_lens, sl, tab.to(dev), dim, dev


@pytest.mark.device
def test_decode_rows_by_block_table_keep_to_the_window(test_device):
    """The masked decode form (CUDA graphs without Triton) and the Triton kernel."""
    q, kc, vc, tables, seq_lens, sl, tab, dim, dev = _decode_case(test_device)
    for window in (1, 4, 31, 64, 200):
        ref = _reference(q, kc, vc, tables, dim, window, [1] * len(seq_lens), seq_lens)
        got = masked_decode_attention(q.to(dev), kc.to(dev), vc.to(dev), sl, tab, dim**-0.5,
                                      window)  # fmt: skip
        assert (got.cpu() - ref).abs().max() < 1e-5
        if triton_attention.available(dev):
            got = triton_attention.paged_decode_attention(q.to(dev), kc.to(dev), vc.to(dev), sl,
                                                          tab, dim**-0.5, block_n=16,
                                                          window=window)  # fmt: skip
            assert (got.cpu() - ref).abs().max() < 1e-5, window

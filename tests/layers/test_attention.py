"""Production paged attention vs the per-sequence dense reference, on ragged batches that mix
prefill chunks (with and without a cached prefix) and decode rows, through random
non-contiguous block tables. CPU, fast."""

from __future__ import annotations

import random

import pytest
import torch

from tinyserve.layers.attention import (
    AttentionMetadata,
    paged_attention,
    reference_paged_attention,
    write_kv_cache,
)

HEAD_DIM = 16


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _block_tables(
    seq_lens: list[int], block_size: int, rng: random.Random, spare: int = 3
) -> tuple[list[list[int]], int]:
    """Random, non-contiguous tables: each sequence takes blocks from one shuffled pool of ids
    (with spare blocks left over, so the cache has slots no sequence owns). Some tables are
    longer than needed, like a scheduler that allocated ahead."""
    need = [_cdiv(sl, block_size) + rng.randint(0, 1) for sl in seq_lens]
    num_blocks = sum(need) + spare
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    return tables, num_blocks


def _run_case(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (production output, reference output, reference in fp64 on fp32 inputs)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _block_tables(seq_lens, block_size, rng)
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    # Garbage (large) in every slot first: any read outside a sequence's context shows up.
    k_cache = (torch.randn(shape, generator=gen) * 50).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 50).to(dtype)

    # Earlier steps wrote the cached prefixes.
    prefix = [
        (sl - ql, sl - ql, t)
        for ql, sl, t in zip(query_lens, seq_lens, tables, strict=True)
        if sl > ql
    ]
    if prefix:
        pre_meta = AttentionMetadata.build(
            [p[0] for p in prefix], [p[1] for p in prefix], [p[2] for p in prefix], block_size
        )
        n = sum(p[0] for p in prefix)
        write_kv_cache(
            torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype),
            k_cache,
            v_cache,
            pre_meta.slot_mapping,
        )

    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    # The step's K/V landed where the block tables say.
    tok = 0
    for ql, sl, table in zip(query_lens, seq_lens, tables, strict=True):
        for pos in range(sl - ql, sl):
            blk, off = table[pos // block_size], pos % block_size
            assert torch.equal(k_cache[blk, off], k[tok])
            assert torch.equal(v_cache[blk, off], v[tok])
            tok += 1

    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    ref = reference_paged_attention(q, k_cache, v_cache, query_lens, seq_lens, tables, scale)
    ref32 = reference_paged_attention(
        q.float(), k_cache.float(), v_cache.float(), query_lens, seq_lens, tables, scale
    )
    return out, ref, ref32


def _mixed_batch(block_size: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) in a shuffled order, covering:
    prefill from 0, prefill with a cached prefix, decode rows of varied lengths, and lengths
    exactly at block boundaries (seq_len % bs == 0, and query starting at a boundary)."""
    bs = block_size
    rows = [
        (7, 7),  # plain prefill, no cache
        (5, 5 + 2 * bs + 3),  # chunk after a cached prefix, not aligned
        (bs + 1, 3 * bs),  # chunk ending exactly at a block boundary
        (3, bs + 3),  # chunk starting exactly at a block boundary
        (2 * bs, 4 * bs),  # starts and ends at boundaries
        (2, 2),  # minimal prefill
        (1, 1),  # decode of the first token
        (1, bs),  # decode ending at a boundary
        (1, bs + 1),  # decode starting a new block
        (1, 5 * bs + 2),
        (1, rng.randint(2, 6 * bs + 5)),
        (rng.randint(2, 9), rng.randint(10, 40)),
    ]
    rng.shuffle(rows)
    return [r[0] for r in rows], [r[1] for r in rows]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_reference_mixed_batch(block_size, num_heads, num_kv_heads, seed):
    rng = random.Random(1000 * block_size + seed)
    query_lens, seq_lens = _mixed_batch(block_size, rng)
    assert any(q == 1 for q in query_lens) and any(q > 1 for q in query_lens)
    out, ref, _ = _run_case(
        query_lens, seq_lens, block_size, num_heads, num_kv_heads, torch.float32, seed
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_decode_only_and_prefill_only(block_size):
    # One group only (the production path splits decode and prefill into two).
    for query_lens, seq_lens in (
        ([1, 1, 1, 1], [1, block_size, 2 * block_size + 1, 37]),
        ([4, 9, block_size], [4, 9 + 3 * block_size, 2 * block_size]),
    ):
        out, ref, _ = _run_case(query_lens, seq_lens, block_size, 8, 2, torch.float32, seed=7)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_paged_attention_random_batches():
    rng = random.Random(42)
    for trial in range(20):
        block_size = rng.choice([1, 2, 4, 8, 16])
        num_kv_heads = rng.choice([1, 2])
        num_heads = num_kv_heads * rng.choice([1, 4])
        n = rng.randint(1, 8)
        query_lens, seq_lens = [], []
        for _ in range(n):
            sl = rng.randint(1, 50)
            ql = 1 if rng.random() < 0.5 else rng.randint(1, sl)
            query_lens.append(ql)
            seq_lens.append(sl)
        out, ref, _ = _run_case(
            query_lens, seq_lens, block_size, num_heads, num_kv_heads, torch.float32, trial
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=f"trial {trial}")


def test_paged_attention_bf16_sanity():
    rng = random.Random(3)
    query_lens, seq_lens = _mixed_batch(4, rng)
    out, ref, ref32 = _run_case(query_lens, seq_lens, 4, 8, 2, torch.bfloat16, seed=3)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    # bf16 inputs, fp64 reference on the same (rounded) values: only output rounding and
    # bf16 accumulation separate them.
    torch.testing.assert_close(out.float(), ref32, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_metadata_slot_mapping_and_positions():
    tables = [[5, 2, 9], [0, 7]]
    meta = AttentionMetadata.build([3, 1], [6, 5], tables, block_size=4)
    # seq 0: positions 3,4,5 -> block 5 off 3, block 2 off 0, block 2 off 1
    # seq 1: position 4 -> block 7 off 0
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0]
    assert meta.query_start_loc == [0, 3, 4]
    assert meta.num_seqs == 2
    assert sorted(g.is_decode for g in meta.groups) == [False, True]


@pytest.mark.parametrize(
    "query_lens,seq_lens,tables,match",
    [
        ([1, 1], [1], [[0], [1]], "one entry per sequence"),
        ([1], [1, 2], [[0]], "one entry per sequence"),
        ([1], [1], [[0], [1]], "one entry per sequence"),
        ([0], [3], [[0]], "query_len=0"),
        ([4], [3], [[0]], "query_len=4"),
        ([1], [0], [[0]], "seq_len=0"),
        ([2], [9], [[0, 1]], "cannot hold 9 tokens"),
        ([1], [5], [[]], "cannot hold 5 tokens"),
    ],
)
def test_metadata_rejects_inconsistent_inputs(query_lens, seq_lens, tables, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(query_lens, seq_lens, tables, block_size=4)

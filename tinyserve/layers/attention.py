"""Paged attention over a block-table KV cache.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A step's tokens are flat (ragged, no padding between requests). Each layer:

1. writes the step's new K/V through ``slot_mapping`` (slot = block_id * block_size + offset);
2. reads each sequence's whole context (cached prefix + this step's tokens) through its
   block table and attends causally.

Two implementations:

* :func:`reference_paged_attention` — plain per-sequence dense attention, a Python loop.
  Obviously correct and slow; used only by tests to judge the fast path.
* :func:`paged_attention` — the production path, vectorised over the whole batch: the
  sequences of a step are split into at most two groups (single-token decode rows and
  multi-token prefill chunks), each group is padded into one rectangle *inside* attention and
  computed with one ``scaled_dot_product_attention`` call. The masks and gather indices are
  built once per step in :meth:`AttentionMetadata.build` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """A rectangle of sequences computed by one SDPA call."""

    token_index: torch.Tensor  # [num_seqs, max_query_len] rows of the flat batch (0 for padding)
    valid: torch.Tensor  # [num_seqs, max_query_len] bool, False for padding
    out_rows: torch.Tensor  # [num_valid] flat rows, in token_index[valid] order
    valid_index: torch.Tensor  # [num_valid] positions of the valid entries in valid.view(-1)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] (0 for padding; masked out)
    # [num_seqs, 1, max_query_len, max_blocks * block_size], additive: 0 visible, -inf not.
    # Additive in the model dtype so SDPA does not convert a boolean mask in every layer.
    attn_mask: torch.Tensor
    is_decode: bool


@dataclass
class AttentionMetadata:
    """Everything attention needs about a step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs] context length after this step (cached + new)
    block_tables: list[list[int]]  # per sequence
    block_size: int
    groups: list[AttentionGroup]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> AttentionMetadata:
        """``query_lens[i]`` new tokens of sequence i (flat, in order) at positions
        ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per sequence"
            )
        query_start_loc = [0]
        slots: list[int] = []
        for ql, sl, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if ql < 1 or sl < ql:
                raise ValueError(f"bad sequence: query_len={ql}, seq_len={sl}")
            if len(table) * block_size < sl:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {sl} tokens")
            query_start_loc.append(query_start_loc[-1] + ql)
            for pos in range(sl - ql, sl):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        decode = [i for i, ql in enumerate(query_lens) if ql == 1]
        prefill = [i for i, ql in enumerate(query_lens) if ql > 1]
        groups = [
            _build_group(
                ids, query_lens, seq_lens, block_tables, query_start_loc, block_size, device, dtype
            )
            for ids in (decode, prefill)
            if ids
        ]
        return cls(slot_mapping, query_start_loc, list(seq_lens), block_tables, block_size, groups)


def _build_group(
    seq_ids: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    query_start_loc: list[int],
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> AttentionGroup:
    n = len(seq_ids)
    max_q = max(query_lens[i] for i in seq_ids)
    max_blocks = max((seq_lens[i] + block_size - 1) // block_size for i in seq_ids)
    token_index = torch.zeros(n, max_q, dtype=torch.int64)
    tables = torch.zeros(n, max_blocks, dtype=torch.int64)
    q_lens = torch.tensor([query_lens[i] for i in seq_ids], dtype=torch.int64)
    s_lens = torch.tensor([seq_lens[i] for i in seq_ids], dtype=torch.int64)
    for row, i in enumerate(seq_ids):
        ql = query_lens[i]
        token_index[row, :ql] = torch.arange(query_start_loc[i], query_start_loc[i] + ql)
        nb = (seq_lens[i] + block_size - 1) // block_size
        tables[row, :nb] = torch.tensor(block_tables[i][:nb], dtype=torch.int64)
    q_pos = torch.arange(max_q)
    valid = q_pos[None, :] < q_lens[:, None]  # [n, max_q]
    # Absolute position of each query row; padding rows get the last real position so
    # their mask row is never empty (an all-False row would give NaN).
    abs_pos = (s_lens - q_lens)[:, None] + torch.minimum(q_pos[None, :], (q_lens - 1)[:, None])
    k_pos = torch.arange(max_blocks * block_size)
    visible = (k_pos[None, None, :] <= abs_pos[:, :, None]) & (
        k_pos[None, None, :] < s_lens[:, None, None]
    )
    out_rows = token_index[valid]
    return AttentionGroup(
        token_index=token_index.to(device),
        valid=valid.to(device),
        out_rows=out_rows.to(device),
        valid_index=valid.view(-1).nonzero().squeeze(1).to(device),
        block_tables=tables.to(device),
        attn_mask=torch.zeros(visible.shape, dtype=dtype)
        .masked_fill_(~visible, float("-inf"))
        .unsqueeze(1)
        .to(device),
        is_decode=max_q == 1,
    )


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Production path: one SDPA call per group, no loop over sequences.
    The step's K/V must already be in the cache (:func:`write_kv_cache`)."""
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    num_heads = q.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # index_select rather than advanced indexing: same result, but aten::index is ~100x
    # slower on CPU when its worker threads compete with other processes.
    for g in meta.groups:
        n, max_blocks = g.block_tables.shape
        max_q = g.token_index.shape[1]
        qg = q.index_select(0, g.token_index.view(-1)).view(n, max_q, num_heads, head_dim)
        flat_tables = g.block_tables.view(-1)
        kg = k_cache.index_select(0, flat_tables).view(n, -1, num_kv_heads, head_dim)
        vg = v_cache.index_select(0, flat_tables).view(n, -1, num_kv_heads, head_dim)
        og = F.scaled_dot_product_attention(
            qg.transpose(1, 2),  # [n, num_heads, max_q, head_dim]
            kg.transpose(1, 2),  # [n, num_kv_heads, max_blocks * block_size, head_dim]
            vg.transpose(1, 2),
            attn_mask=g.attn_mask,
            scale=scale,
            enable_gqa=True,
        )  # [n, num_heads, max_q, head_dim]
        og = og.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)
        out.index_copy_(0, g.out_rows, og.index_select(0, g.valid_index))
    return out


def reference_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
) -> torch.Tensor:
    """Per-sequence dense causal attention, computed in float64. Tests only."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for ql, sl, table in zip(query_lens, seq_lens, block_tables, strict=True):
        nb = (sl + block_size - 1) // block_size
        blocks = torch.tensor(table[:nb], dtype=torch.int64)
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:sl].double()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:sl].double()
        k = k.repeat_interleave(group, dim=1)  # [sl, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qs = q[start : start + ql].double()  # [ql, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_abs = torch.arange(sl - ql, sl)[:, None]
        allowed = torch.arange(sl)[None, :] <= q_abs  # [ql, sl]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(-1)
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += ql
    return out

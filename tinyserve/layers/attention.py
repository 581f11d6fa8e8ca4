"""Paged attention over a block-table KV cache.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A step's tokens are flat (ragged, no padding between requests). Each layer:

1. writes the step's new K/V through ``slot_mapping`` (slot = block_id * block_size + offset);
2. reads each sequence's whole context (cached prefix + this step's tokens) through its
   block table and attends causally — or, in a layer with a sliding window W, over each
   query's last W positions (its own included; transformers' ``sliding_window`` convention).
   The window is the layer's (``window=`` to :func:`paged_attention`); the kernels take it as
   an argument, the torch path's masks for the model's one window are built once per step
   beside the full-attention ones (``AttentionMetadata.window_groups``). A hybrid model's
   layer groups each read their own table (``AttentionMetadata.group_metas``).

Two implementations:

* :func:`reference_paged_attention` — plain per-sequence dense attention, a Python loop.
  Obviously correct and slow; used only by tests to judge the fast path.
* :func:`paged_attention` — the production path. On a CPU with the kernels (float32), the
  AVX2 kernel of tinyserve/kernels/attention.c reads K/V through the block table directly:
  no padded gather, no mask, and each row's result independent of the rest of the batch.
  Elsewhere (CUDA, MPS, bf16, no kernels) the torch path: the sequences of a step are split
  into at most two groups (single-token decode rows and multi-token prefill chunks), each
  group is padded into one rectangle *inside* attention and computed with one
  ``scaled_dot_product_attention`` call. The masks and gather indices (or the kernel's
  tensors) are built once per step in :meth:`AttentionMetadata.build`, shared by all layers.
  With ``decode_backend="triton"`` (CUDA, the loader's choice where Triton is present) the
  decode group skips the rectangle and the mask: the Triton kernel of
  tinyserve/kernels/triton_attention.py reads each row's K/V through its block table.
* :meth:`AttentionMetadata.static_decode` — a pure-decode step over fixed-shape buffers, for
  CUDA graphs (worker/decode_graphs.py): one decode group whose rows are the flat batch in
  order and whose lengths and block tables live in device tensors, so the same launches
  replay for any contexts (layers/decode_attention.py: the Triton kernel, or a masked form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyserve.kernels.attention import paged_attention as kernel_attention
from tinyserve.layers.block_tables import pad_tables
from tinyserve.layers.decode_attention import decode_attention


@dataclass
class AttentionGroup:
    """A rectangle of sequences computed by one SDPA call."""

    token_index: torch.Tensor  # [num_seqs, max_query_len] rows of the flat batch (0 for padding)
    out_rows: torch.Tensor  # [num_valid] flat rows of the real (unpadded) queries, row-major
    valid_index: torch.Tensor  # [num_valid] where those queries sit in token_index.view(-1)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] (0 for padding; masked out)
    # [num_seqs, 1, max_query_len, max_blocks * block_size], additive: 0 visible, -inf not.
    # Additive in the model dtype so SDPA does not convert a boolean mask in every layer.
    # None for a decode group read through the block table (``decode`` set).
    attn_mask: torch.Tensor | None
    is_decode: bool
    # Decode rows by the block table, no mask: int32 context lengths [num_seqs] (block_tables
    # then int32). "triton": the Triton kernel; "masked": masked_decode_attention.
    seq_lens: torch.Tensor | None = None
    decode_backend: str | None = None


@dataclass
class KernelInputs:
    """What the block-table kernel reads (CPU tensors)."""

    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor  # int64 [num_seqs]
    seq_of_token: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]


@dataclass
class AttentionMetadata:
    """Everything attention needs about a step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs] context length after this step (cached + new)
    block_tables: list[list[int]]  # per sequence
    block_size: int
    groups: list[AttentionGroup]  # the torch path's rectangles (empty on the kernel path)
    kernel: KernelInputs | None = None
    # The step's first rows that are generated tokens (decode), for the linear layers'
    # int8-activation path (layers/linear.py): the first num_decode_seqs sequences' tokens.
    num_decode_tokens: int = 0
    # The torch path's rectangles for the layers with a sliding window of ``window`` keys
    # (masks cut to each query's last ``window`` positions); None: none were built.
    window: int | None = None
    window_groups: list[AttentionGroup] | None = None
    # A hybrid model's other layer groups' metadata (their block tables and slots, group 1
    # first: utils/kv_groups.py); None: every layer reads this one.
    group_metas: list[AttentionMetadata] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def of_group(self, group: int) -> AttentionMetadata:
        """What a layer of this layer group reads (LlamaAttention.kv_group)."""
        return self if group == 0 or self.group_metas is None else self.group_metas[group - 1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        use_kernel: bool = False,
        num_decode_seqs: int = 0,
        decode_backend: str | None = None,
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """``query_lens[i]`` new tokens of sequence i (flat, in order) at positions
        ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. ``use_kernel``: build the
        block-table kernel's inputs instead of the torch path's masks. The first
        ``num_decode_seqs`` sequences are decoding (their new tokens were generated).
        ``decode_backend="triton"``: the torch path's single-token rows go to the Triton
        block-table kernel instead of a masked rectangle. ``sliding_window``: the model's
        window, whose masks the torch path builds too (the kernels need nothing more)."""
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {sliding_window}")
        query_start_loc = _query_start_loc(
            query_lens, seq_lens, block_tables, block_size, num_decode_seqs
        )
        # Everything below is tensor ops over the whole step: no per-token Python loop.
        steps = _StepTensors.build(query_lens, seq_lens, block_tables, block_size, query_start_loc)
        num_decode_tokens = query_start_loc[num_decode_seqs]
        if use_kernel:
            kernel = KernelInputs(
                torch.tensor(query_start_loc, dtype=torch.int64),
                steps.s_lens,
                steps.seq_of_token,
                steps.tables.to(torch.int32),
            )
            return cls(steps.slot_mapping, query_start_loc, list(seq_lens), block_tables,
                       block_size, [], kernel, num_decode_tokens)  # fmt: skip
        def groups(window: int | None) -> list[AttentionGroup]:
            return [
                _build_group(steps.q_lens[idx], steps.s_lens[idx], steps.starts[idx],
                             steps.tables[idx], block_size, device, dtype,
                             max(query_lens[i] for i in rows), max(seq_lens[i] for i in rows),
                             decode_backend, window)  # fmt: skip
                for rows, idx in _decode_then_prefill_rows(query_lens)
            ]

        return cls(
            steps.slot_mapping.to(device),
            query_start_loc,
            list(seq_lens),
            block_tables,
            block_size,
            groups(None),
            num_decode_tokens=num_decode_tokens,
            window=sliding_window,
            window_groups=None if sliding_window is None else groups(sliding_window),
        )

    @classmethod
    def static_decode(
        cls,
        slot_mapping: torch.Tensor,  # [b] int64, on the device
        seq_lens: torch.Tensor,  # [b] int32
        block_tables: torch.Tensor,  # [b, max_blocks] int32
        block_size: int,
        decode_backend: str,
    ) -> AttentionMetadata:
        """A decode step of ``b`` rows over fixed buffers (CUDA graphs): row i is sequence i's
        one new token; its lengths and blocks are read from the tensors when the step runs,
        so this metadata is built once per batch size and reused for every step."""
        b = slot_mapping.shape[0]
        group = AttentionGroup(None, None, None, block_tables, None, True, seq_lens,
                               decode_backend)  # fmt: skip
        return cls(slot_mapping, list(range(b + 1)), [1] * b, [], block_size, [group],
                   num_decode_tokens=b)  # fmt: skip


def _query_start_loc(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decode_seqs: int,
) -> list[int]:
    """The first flat row of each sequence (and the total), once the inputs are checked."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    if not 0 <= num_decode_seqs <= len(query_lens):
        raise ValueError(f"num_decode_seqs {num_decode_seqs} of {len(query_lens)} sequences")
    query_start_loc = [0]
    for ql, sl, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if ql < 1 or sl < ql:
            raise ValueError(f"bad sequence: query_len={ql}, seq_len={sl}")
        if len(table) * block_size < sl:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {sl} tokens")
        query_start_loc.append(query_start_loc[-1] + ql)
    return query_start_loc


@dataclass
class _StepTensors:
    """The step's per-sequence lengths and block tables as tensors, and each token's slot."""

    tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0 (masked out)
    q_lens: torch.Tensor  # [num_seqs]
    s_lens: torch.Tensor  # [num_seqs]
    starts: torch.Tensor  # [num_seqs] first flat row of each sequence
    seq_of_token: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]

    @classmethod
    def build(cls, query_lens, seq_lens, block_tables, block_size, query_start_loc):
        max_blocks = max(-(-sl // block_size) for sl in seq_lens)
        tables = pad_tables(block_tables, max_blocks)  # padded with block 0 (masked out)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        row_in_seq = torch.arange(query_start_loc[-1]) - starts[seq_of_token]
        positions = row_in_seq + (s_lens - q_lens)[seq_of_token]
        slot_mapping = (
            tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        )
        return cls(tables, q_lens, s_lens, starts, seq_of_token, slot_mapping)


def _decode_then_prefill_rows(query_lens: list[int]) -> list[tuple[list[int], torch.Tensor]]:
    """The torch path's groups: the single-token rows, then the others (each if any)."""
    groups = []
    for is_decode in (True, False):
        rows = [i for i, ql in enumerate(query_lens) if (ql == 1) == is_decode]
        if rows:
            groups.append((rows, torch.tensor(rows, dtype=torch.int64)))
    return groups


def _build_group(
    q_lens: torch.Tensor,  # [n]
    s_lens: torch.Tensor,  # [n]
    starts: torch.Tensor,  # [n] first flat row of each sequence
    tables: torch.Tensor,  # [n, max_blocks] of the whole step
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    max_q: int,  # the group's longest query and context, from the step's lists (no tensor
    max_s: int,  # read: on a GPU each would wait for the device)
    decode_backend: str | None = None,
    window: int | None = None,  # mask each query to its last ``window`` keys
) -> AttentionGroup:
    max_blocks = -(-max_s // block_size)
    if max_q == 1 and decode_backend is not None:  # by the block table: no rectangle, no mask
        rows = starts.to(device)
        return AttentionGroup(rows, rows, rows,
                              tables[:, :max_blocks].to(torch.int32).contiguous().to(device),
                              None, True, s_lens.to(torch.int32).to(device),
                              decode_backend)  # fmt: skip
    q_pos = torch.arange(max_q)
    valid = q_pos[None, :] < q_lens[:, None]  # [n, max_q], False for padding
    token_index = torch.where(valid, starts[:, None] + q_pos[None, :], 0)
    # The real queries, row-major, by arithmetic: sequence i's j-th query. No nonzero() or
    # boolean indexing: shapes that depend on data, which would make a device wait if this
    # were built there (it is built on the host and staged, worker/staging.py), and which
    # tests/worker/test_step_syncs.py counts on the hot path.
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    j = torch.arange(len(seq)) - (torch.cumsum(q_lens, 0) - q_lens)[seq]
    # Absolute position of each query row; padding rows get the last real position so
    # their mask row is never empty (an all-False row would give NaN).
    abs_pos = (s_lens - q_lens)[:, None] + torch.minimum(q_pos[None, :], (q_lens - 1)[:, None])
    k_pos = torch.arange(max_blocks * block_size)
    visible = (k_pos[None, None, :] <= abs_pos[:, :, None]) & (
        k_pos[None, None, :] < s_lens[:, None, None]
    )
    if window is not None:  # never empties a row: a query's own key is always visible
        visible &= k_pos[None, None, :] > abs_pos[:, :, None] - window
    return AttentionGroup(
        token_index=token_index.to(device),
        out_rows=(starts[seq] + j).to(device),
        valid_index=(seq * max_q + j).to(device),
        block_tables=tables[:, :max_blocks].contiguous().to(device),
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
    tiles: bool = False,  # the kernel's bf16 products (kernels/attention.py paged_attention)
    window: int | None = None,  # the layer's sliding window (None: full attention)
) -> torch.Tensor:
    """Production path: the block-table kernel, or one SDPA call per group; no loop over
    sequences either way. The step's K/V must already be in the cache (write_kv_cache)."""
    if meta.kernel is not None:
        m = meta.kernel
        return kernel_attention(q, k_cache, v_cache, m.query_start_loc, m.seq_lens,
                                m.seq_of_token, m.block_tables, scale, tiles=tiles,
                                window=window)  # fmt: skip
    if meta.groups and meta.groups[0].token_index is None:  # static_decode: the whole batch
        return decode_attention(q, k_cache, v_cache, meta.groups[0], scale, window)
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    num_heads = q.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # index_select rather than advanced indexing: same result, but aten::index is ~100x
    # slower on CPU when its worker threads compete with other processes.
    for g in _groups_for(meta, window):
        if g.decode_backend is not None:
            og = decode_attention(q.index_select(0, g.token_index), k_cache, v_cache, g, scale,
                                  window)  # fmt: skip
            out.index_copy_(0, g.out_rows, og)
            continue
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


def _groups_for(meta: AttentionMetadata, window: int | None) -> list[AttentionGroup]:
    """The torch path's rectangles for a layer with this window (None: full attention)."""
    if window is None:
        return meta.groups
    if meta.window != window or meta.window_groups is None:
        raise ValueError(f"attention metadata built for sliding_window={meta.window}, "
                         f"a layer asks for {window}")  # fmt: skip
    return meta.window_groups


def reference_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Per-sequence dense causal attention, computed in float64; with a ``window``, query at
    position p sees keys p - window + 1 .. p only. Tests only."""
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
        if window is not None:
            allowed &= torch.arange(sl)[None, :] > q_abs - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(-1)
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += ql
    return out

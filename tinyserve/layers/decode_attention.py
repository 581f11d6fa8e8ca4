"""Decode rows read through their block tables (no rectangle per step): the Triton kernel of
kernels/triton_attention.py, or, where Triton is absent, a masked torch form with fixed
shapes. Both take int32 context lengths and block tables that live on the device, so
a step's launches do not depend on its lengths (what CUDA graphs need,
worker/decode_graphs.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g,  # an AttentionGroup with decode_backend set
    scale: float,
    window: int | None = None,  # the layer's sliding window: each row's last keys only
) -> torch.Tensor:
    """A decode group read through its block table: the Triton kernel, or the masked torch
    form where Triton is absent."""
    if g.decode_backend == "triton":
        from tinyserve.kernels.triton_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, g.seq_lens, g.block_tables, scale,
                                      window=window)  # fmt: skip
    return masked_decode_attention(q, k_cache, v_cache, g.seq_lens, g.block_tables, scale,
                                   window)  # fmt: skip


def masked_decode_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [n] int32
    block_tables: torch.Tensor,  # [n, max_blocks] int32
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its first ``seq_lens[i]`` positions (with a ``window``,
    the last ``window`` of them), with fixed shapes:
    every table's blocks are gathered and the mask is built on the device from the lengths
    (no host read), so the call can be captured in a CUDA graph. Costs the table's full
    width for every row: the fallback for a device without Triton."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    flat = block_tables.reshape(-1).to(torch.int64)
    k = k_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim)
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    visible = k_pos < seq_lens[:, None]
    if window is not None:
        visible &= k_pos >= seq_lens[:, None] - window
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill(~visible, float("-inf"))[:, None, None, :]  # [n, 1, 1, width]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return o[:, :, 0, :]

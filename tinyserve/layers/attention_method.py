"""How a decoder's attention runs, picked once at load as the linear layers' methods are
(layers/linear.py): the loader hands the model one ``AttentionMethod`` and every layer, the
model runner (which metadata a step builds), the CUDA graphs, the KV-cache allocator and the
fused step read that object — no backend strings or per-layer flags to keep in step.

  * ``AttentionMethod``       the torch reference: RoPE and the cache write in torch, one SDPA
                              rectangle per group of rows (layers/attention.py);
  * ``TritonDecodeAttention`` the same, with decode rows through the Triton block-table kernel
                              (CUDA; kernels/triton_attention.py);
  * ``KernelAttention``       the CPU kernels: RoPE + cache write in one call (kernels/ops.c),
                              then the block-table attention (kernels/attention.c), on AMX
                              tiles in bf16 with ``tiles``.

``attend`` takes the layer's fused ``qkv`` rows ([tokens, (H + 2 KV) * D], q and k already
normalised where a family does that) and returns the attention output [tokens, H, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.kernels import ops
from tinyserve.layers.attention import AttentionMetadata, paged_attention, write_kv_cache
from tinyserve.layers.block_tables import group_metadata
from tinyserve.layers.rotary import apply_rotary


@dataclass(frozen=True)
class AttentionMethod:
    name: str = "torch"
    block_table_inputs: bool = False  # a step's metadata: the kernel's inputs, not rectangles
    decode_backend: str | None = None  # the torch path's decode rows: "triton" or rectangles
    tiles: bool = False  # bf16 products: AMX tiles or VDPBF16PS (KernelAttention only)

    def metadata(
        self, query_lens, seq_lens, block_tables, block_size, device, dtype, num_decode_seqs,
        sliding_window: int | None = None, group_block_tables=None,
    ) -> AttentionMetadata:  # fmt: skip
        """The step's metadata in the form this method reads (``sliding_window``: the
        model's, ModelConfig.sliding_window: the torch path's masks for it too), and with a
        hybrid model's ``group_block_tables`` its other layer groups' (``group_metas``)."""

        def build(tables, window):
            return AttentionMetadata.build(
                query_lens, seq_lens, tables, block_size, device, dtype,
                use_kernel=self.block_table_inputs, num_decode_seqs=num_decode_seqs,
                decode_backend=self.decode_backend, sliding_window=window,
            )  # fmt: skip

        meta = build(block_tables, sliding_window)
        if group_block_tables is not None and meta.kernel is not None:  # derived: cheaper
            meta.group_metas = group_metadata(meta, group_block_tables)
        elif group_block_tables is not None:  # (full and windowed groups alike: both masks)
            meta.group_metas = [build(tables, sliding_window) for tables in group_block_tables]
        return meta

    def attend(self, attn, qkv: torch.Tensor, cos_sin, kv_cache, meta) -> torch.Tensor:
        """q and k rotated together (one set of elementwise ops), K and V into the cache,
        then attention over each sequence's blocks."""
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qk, v = qkv.split([(h + kv) * d, kv * d], dim=-1)
        qk = apply_rotary(qk.view(-1, h + kv, d), *cos_sin)
        k_cache, v_cache = kv_cache
        write_kv_cache(qk[:, h:], v.view(-1, kv, d), k_cache, v_cache, meta.slot_mapping)
        return paged_attention(qk[:, :h], k_cache, v_cache, meta, attn.scale,
                               window=attn.window)  # fmt: skip

    def head_norm(self, attn, qkv: torch.Tensor, q_norm, k_norm) -> None:
        """Qwen3's RMSNorm over each head of q (``q_norm``) and of k (``k_norm``), in place."""
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q = qkv[:, : h * d].view(-1, h, d)
        k = qkv[:, h * d : (h + kv) * d].view(-1, kv, d)
        q.copy_(q_norm.plain(q))
        k.copy_(k_norm.plain(k))


TORCH_ATTENTION = AttentionMethod()


@dataclass(frozen=True)
class TritonDecodeAttention(AttentionMethod):
    name: str = "triton"
    decode_backend: str | None = "triton"


@dataclass(frozen=True)
class KernelAttention(AttentionMethod):
    name: str = "kernel"
    block_table_inputs: bool = True

    def attend(self, attn, qkv: torch.Tensor, cos_sin, kv_cache, meta) -> torch.Tensor:
        """RoPE and the cache write in place in ``qkv`` and the cache, then the kernel."""
        h, kv = attn.num_heads, attn.num_kv_heads
        k_cache, v_cache = kv_cache
        ops.rope_and_cache(qkv, cos_sin[0], cos_sin[1], k_cache, v_cache, meta.slot_mapping,
                           h, kv)  # fmt: skip
        q = qkv.view(-1, h + 2 * kv, attn.head_dim)
        return paged_attention(q[:, :h], k_cache, v_cache, meta, attn.scale, self.tiles,
                               attn.window)  # fmt: skip

    def head_norm(self, attn, qkv: torch.Tensor, q_norm, k_norm) -> None:
        """The same in one pass (kernels/ops.c head_norm; the fused step calls it too)."""
        ops.head_norm(qkv, q_norm.weight, k_norm.weight, attn.num_heads, attn.num_kv_heads,
                      q_norm.eps)  # fmt: skip

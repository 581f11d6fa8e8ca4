"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): Llama's layer with three differences, each
served as data, so every path (torch, the CPU kernels, the one-call fused step of
kernels/step.c, the CUDA path) runs the family unchanged:

- Fused checkpoint tensors: ``qkv_proj`` (q, k, v rows) and ``gate_up_proj`` (gate, up rows)
  are split at load into the shards our own fused linears are filled from, so tensor
  parallel slices them as any checkpoint's; a GGUF's ``attn_qkv`` and ``ffn_up`` (which holds
  gate and up) the same way, and their Q4_1 / Q8_0 blocks serve as they are stored.
- Partial rotary (``partial_rotary_factor``; Phi-4-mini: 96 of 128 dims): RoPE turns the first
  ``rotary_dim`` dims of each head (rotate-half among them) and passes the rest. Each head's
  q and k rows are reordered at load to [rotated first half, passed first half, rotated
  second half, passed second half]: a full-width rotate-half then pairs the same dims, and
  the RoPE table's columns past ``rotary_dim // 2`` are the identity (cos 1, sin 0: exact).
  q.k sums the same products in another order; K is cached in the new order.
- LongRoPE (``rope_scaling`` type ``longrope``, short and long factors per frequency and an
  attention factor on cos and sin; layers/rotary.py ``longrope``): the long factors when the
  served length (--max-model-len, else max_position_embeddings) exceeds
  ``original_max_position_embeddings``, one table for every position.

A ``sliding_window`` (Phi-3-mini-4k: 2047) windows every layer's attention, as Mistral's
does (LlamaAttention.window; layers/attention.py); the context is not capped at it.
"""

from __future__ import annotations

import torch

from tinyserve.layers.rotary import RotaryEmbedding, longrope, rope_inv_freq
from tinyserve.models.llama import LlamaForCausalLM, LlamaModel


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """One head's rows in our order: which checkpoint row each of ours holds."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    d = torch.arange(head_dim)
    return torch.cat((d[:half], d[rotary_dim : rotary_dim + rest], d[half:rotary_dim],
                      d[rotary_dim + rest :]))  # fmt: skip


class Phi3Model(LlamaModel):
    def build_rotary(self, config, max_position: int, dtype, inv_freq) -> RotaryEmbedding:
        inv_freq, attention = rope_inv_freq(config.rotary_dim, config.rope_theta, None), 1.0
        if config.rope_type == "longrope":
            inv_freq, attention = longrope(config.rotary_dim, config.rope_theta,
                                           config.rope_scaling, config.max_position_embeddings,
                                           max_position)  # fmt: skip
        return RotaryEmbedding(config.head_dim, max_position, config.rope_theta, None, dtype,
                               inv_freq=inv_freq, attention_factor=attention)  # fmt: skip


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model

    def qkv_row_order(self) -> torch.Tensor | None:
        c = self.config
        if c.rotary_dim == c.head_dim:
            return None
        heads = torch.arange(c.num_attention_heads + c.num_key_value_heads)[:, None]
        qk = (heads * c.head_dim + rotary_order(c.head_dim, c.rotary_dim)).flatten()
        return torch.cat((qk, torch.arange(qk.numel(), qk.numel() + c.kv_size)))

    def checkpoint_tensors(self, tensors, gguf: bool = False):
        """``qkv_proj`` -> q/k/v_proj (q/k rows in our order), ``gate_up_proj`` -> gate/up_proj."""
        c, order = self.config, self.qkv_row_order()
        split = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), (c.q_size, c.kv_size, c.kv_size)),
                 "gate_up_proj": (("gate_proj", "up_proj"), (c.intermediate_size,) * 2)}  # fmt: skip
        for name, tensor, file in tensors:
            parts = name.split(".")
            fused = next((p for p in parts if p in split), None)
            if fused is None:
                yield name, tensor, file
                continue
            names, sizes = split[fused]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{file}: tensor {name} has {tensor.shape[0]} rows; the "
                                 f"config expects {sum(sizes)} ({' + '.join(map(str, sizes))})")  # fmt: skip
            if fused == "qkv_proj" and order is not None:
                tensor = tensor[order]
            i = parts.index(fused)
            for part, piece in zip(names, tensor.split(sizes), strict=True):
                yield ".".join(parts[:i] + [part] + parts[i + 1 :]), piece.contiguous(), file

"""Qwen3 (0.6B-32B dense): Llama's layer with an RMSNorm over each head of q and of k before
RoPE (``q_norm``, ``k_norm``: one weight of ``head_dim`` each, shared by the heads), no q/k/v
bias, and an explicit ``head_dim`` (Qwen3-0.6B: 16 heads x 128 over a hidden size of 1024).

The norms run on the fused qkv rows, in place, before RoPE and the cache write: the attention
method's ``head_norm`` (torch, or kernels/ops.c ``head_norm``, which the one-call fused step
calls too, so the two paths agree to the bit).
"""

from __future__ import annotations

import torch

from tinyserve.config import ModelConfig
from tinyserve.distributed.parallel_state import TPGroup
from tinyserve.layers.norm import RMSNorm
from tinyserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup, layer_idx: int = 0
    ) -> None:
        super().__init__(config, dtype, tp, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each head of q and of k RMS-normalised over its ``head_dim``, in place, by the
        attention method (the kernels' head_norm, or torch)."""
        self.method.head_norm(self, qkv, self.q_norm, self.k_norm)
        return qkv


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

"""SmolLM3 (3B): Llama's layer where some layers use no position encoding at all (NoPE):
``no_rope_layers[i]`` is 1 where layer i applies RoPE and 0 where it does not (every fourth
layer in the released model).

A NoPE layer gets identity tables (cos 1, sin 0): rotating by them gives each value back
exactly (x * 1 - y * 0 == x), so every attention method, kernels included, serves the layer
unchanged; the fused step (kernels/step.c) reads each layer's ``use_rope`` and gives NoPE
layers the same identity tables.
"""

from __future__ import annotations

import torch

from tinyserve.config import ModelConfig
from tinyserve.distributed.parallel_state import TPGroup
from tinyserve.models.llama import LlamaAttention, LlamaForCausalLM


class SmolLM3Attention(LlamaAttention):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup, layer_idx: int = 0
    ) -> None:
        super().__init__(config, dtype, tp, layer_idx)
        flags = config.no_rope_layers
        self.use_rope = flags is None or bool(flags[layer_idx])

    def rotary(self, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        if self.use_rope:
            return cos_sin
        cos, sin = cos_sin
        return torch.ones_like(cos), torch.zeros_like(sin)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = SmolLM3Attention

"""IBM Granite 3.x (dense): Llama's layer with four scalars from the config —
``embedding_multiplier`` on the input rows, ``residual_multiplier`` on each attention and MLP
output before it joins the residual stream, ``attention_multiplier`` as the softmax scale
(instead of head_dim ** -0.5) and the logits divided by ``logits_scaling``.

The scale goes to whichever attention method runs (the kernels take it as an argument); the
embedding and logits scalars act outside the layers; the fused step (kernels/step.c)
multiplies each branch by ``residual_multiplier`` as torch does, one rounding per value.
"""

from __future__ import annotations

import torch

from tinyserve.config import ModelConfig
from tinyserve.distributed.parallel_state import TPGroup
from tinyserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteAttention(LlamaAttention):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup, layer_idx: int = 0
    ) -> None:
        super().__init__(config, dtype, tp, layer_idx)
        if config.attention_multiplier is not None:
            self.scale = config.attention_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = config.residual_multiplier

    def branch(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.residual_multiplier


class GraniteModel(LlamaModel):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, *args, **kwargs) -> None:
        super().__init__(config, dtype, *args, **kwargs)
        self.embedding_multiplier = config.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel
    layer_cls = GraniteDecoderLayer
    attention_cls = GraniteAttention

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        return super().compute_logits(hidden, num_decode) / self.config.logits_scaling

    def score_head(self):
        return None  # the logits are the head's output scaled (compute_logits)

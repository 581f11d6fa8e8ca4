"""Gemma 3 text (``Gemma3ForCausalLM``: 1B, and the text tower of the larger ones): Llama's
layer with

- input rows scaled by sqrt(hidden) (rounded to the model's dtype first, as transformers);
- RMSNorm weights used as (1 + w): the offset is added once at load, in float32 as
  transformers adds it at run time (a GGUF has it added already, by llama.cpp's converter),
  so every norm, the kernels' included, is the plain RMSNorm; the weights stay float32
  whatever the model's dtype, and in bf16 a row is scaled in float32 before it is rounded
  (transformers' order: bf16(1 + w) and a bf16 product were up to 2^-8 off);
- Qwen3's per-head RMSNorm on q and k, and the softmax scale query_pre_attn_scalar ** -0.5;
- a norm after attention and after the MLP too (four per layer), each branch normed before it
  joins the residual stream;
- GeGLU: tanh-approximated GELU on the gate (torch, or on the kernels step.c's
  gelu_tanh_and_mul, which the Python loop calls too; elementwise, so batch-invariant);
- local layers (five of every six) with their own RoPE base (rope_local_theta, unscaled) and
  a sliding window, interleaved with global layers (rope_theta and its scaling): two RoPE
  tables per step, each layer taking its own through ``LlamaAttention.rotary``; the local
  layers attend over their window (``LlamaAttention.window`` from ModelConfig.layer_window),
  the global ones over the whole context, which is served to max_position_embeddings.

The one-call fused step (kernels/step.c) reads all of it as data: each layer's four norms
(``step_norms``), its table (``step_table``) and the MLP's ``activation``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.config import ModelConfig
from tinyserve.kernels import step
from tinyserve.layers.norm import RMSNorm
from tinyserve.layers.rotary import RotaryEmbedding
from tinyserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from tinyserve.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    def __init__(self, config: ModelConfig, dtype, tp, layer_idx: int = 0) -> None:
        super().__init__(config, dtype, tp, layer_idx)
        if config.attention_multiplier is not None:
            self.scale = config.attention_multiplier
        self.local = bool(config.local_layers and config.local_layers[layer_idx])

    def rotary(self, cos_sin):
        """The step's (global, local) tables: this layer's."""
        return cos_sin[1] if self.local else cos_sin[0]

    @property
    def step_table(self) -> int:
        return 2 if self.local else 1


class Gemma3MLP(LlamaMLP):
    activation = "gelu_tanh"

    def forward(self, x: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, num_decode)
        if self.use_kernel:  # the kernel the fused step calls (kernels/step.c)
            return self.down_proj(step.gelu_tanh_and_mul(gate_up), num_decode)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, num_decode)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, dtype, tp, *args, **kwargs) -> None:
        super().__init__(config, dtype, tp, *args, **kwargs)
        self.mlp = Gemma3MLP(config, dtype, tp)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def step_norms(self):
        return (self.input_layernorm, self.pre_feedforward_layernorm,
                self.post_attention_layernorm, self.post_feedforward_layernorm)  # fmt: skip

    def forward(self, x, residual, cos_sin, kv_cache, meta):
        """-> (this layer's output, the residual stream before it is added); Gemma's
        ``post_attention_layernorm`` norms the attention output itself."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos_sin, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, meta.num_decode_tokens)), residual


class _TwoTables(nn.Module):
    """The global and the local layers' RoPE tables, gathered together once per step."""

    def __init__(self, global_: RotaryEmbedding, local: RotaryEmbedding) -> None:
        super().__init__()
        self.global_, self.local = global_, local

    def cos_sin(self, positions: torch.Tensor):
        return self.global_.cos_sin(positions), self.local.cos_sin(positions)


class Gemma3Model(LlamaModel):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, *args, **kwargs) -> None:
        super().__init__(config, dtype, *args, **kwargs)
        scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def build_rotary(self, config, max_position: int, dtype, inv_freq) -> nn.Module:
        local = RotaryEmbedding(config.head_dim, max_position, config.rope_local_theta, None,
                                dtype)  # fmt: skip
        return _TwoTables(super().build_rotary(config, max_position, dtype, inv_freq), local)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model
    layer_cls = Gemma3DecoderLayer
    attention_cls = Gemma3Attention

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, *args, **kwargs):
        super().__init__(config, dtype, *args, **kwargs)
        for m in self.modules():  # 1 + w in float32 (RMSNorm.plain scales in float32)
            if isinstance(m, RMSNorm) and m.weight.dtype != torch.float32:
                m.weight = nn.Parameter(m.weight.detach().float(), requires_grad=False)

    def checkpoint_tensors(self, tensors, gguf: bool = False):
        """Every norm weight w as 1 + w (float32), unless the GGUF converter added it."""
        for name, tensor, file in tensors:
            if name.endswith("norm.weight") and not gguf:
                tensor = tensor.float() + 1.0
            yield name, tensor, file

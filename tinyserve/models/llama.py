"""The Llama decoder, written here (not transformers' modules), and the base of every family.

Llama, Qwen2 and Mistral differ only by config: q/k/v bias (Qwen2), tied or separate LM
head, RoPE scaling. q/k/v and gate/up are fused into one matrix each (one GEMM instead of
three/two); the loader's name table maps checkpoint tensors into the fused shards. Other
families (qwen3.py, granite.py, smollm3.py, phi3.py, gemma3.py) subclass these classes and
override a hook: ``LlamaAttention.normalize_qk`` / ``rotary`` / ``step_table``,
``LlamaDecoderLayer.branch`` / ``step_norms`` (or its forward), ``LlamaModel.embed`` /
``build_rotary``, ``LlamaForCausalLM.compute_logits`` / ``checkpoint_tensors`` /
``qkv_row_order``; its ``*_cls`` class attributes say which class each level builds.
models/registry.py maps architecture names to the classes.

How attention runs is one ``AttentionMethod`` object (layers/attention_method.py) the loader
hands to ``set_attention_method``, as each linear layer gets its ``LinearMethod``; the fused
step (kernels/step.py), where the loader builds one, runs every layer in one C call.

Tensor parallel (Megatron): with a ``TPGroup`` of size N, each rank holds 1/N of the heads
(q/k/v and gate/up split by output rows: column-parallel) and of o_proj / down_proj's input
columns (row-parallel); each of those two ends with one all-reduce, so a layer costs exactly
two. Embedding, norms and the LM head are replicated; the hidden states are the same on
every rank.

The model sees tensors only: flat ``input_ids``/``positions`` for the step's tokens, the
per-layer paged KV cache and an :class:`AttentionMetadata`. It never sees requests.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.config import ModelConfig
from tinyserve.distributed.parallel_state import TPGroup, check_tp_divisible
from tinyserve.kernels import ops
from tinyserve.layers.activation import silu_and_mul
from tinyserve.layers.attention import AttentionMetadata
from tinyserve.layers.attention_method import TORCH_ATTENTION, AttentionMethod
from tinyserve.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    PackedMethod,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tinyserve.layers.norm import RMSNorm
from tinyserve.layers.rotary import RotaryEmbedding
from tinyserve.utils.kv_groups import kv_groups

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size, kv_heads, head_dim],) * 2


class LlamaAttention(nn.Module):
    use_rope = True  # False: a NoPE layer (smollm3.py); what the fused step reads per layer

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup, layer_idx: int = 0
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # The last ``window`` keys only (None: all of them): Mistral's every layer, Gemma 3's
        # local ones (ModelConfig.layer_window); what the attention methods and step.c read.
        self.window = config.layer_window(layer_idx)
        # A hybrid model's layer group: whose block table and slots it reads (utils/kv_groups.py;
        # 0 where every layer reads one table).
        groups = kv_groups(config)
        self.kv_group = 0 if groups is None else groups.layer_group[layer_idx]
        hidden = config.hidden_size
        self.qkv_proj = QKVParallelLinear(
            hidden,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
            dtype,
            tp,
        )
        self.o_proj = RowParallelLinear(config.q_size, hidden, config.o_proj_bias, dtype, tp)
        self.method: AttentionMethod = TORCH_ATTENTION  # the loader's, via set_attention_method

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Hook: q and k before RoPE (Qwen3 normalises each head). Llama: as they are."""
        return qkv

    def rotary(self, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """Hook: this layer's RoPE tables (SmolLM3's NoPE layers: the identity)."""
        return cos_sin

    @property
    def step_table(self) -> int:
        """Which table the fused step rotates this layer by, as ``rotary`` picks: 0 the
        identity, 1 the step's, 2 its second (Gemma 3's local layers)."""
        return int(self.use_rope)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        nd = meta.num_decode_tokens
        qkv = self.normalize_qk(self.qkv_proj(x, nd))  # [num_tokens, q_size + 2 * kv_size]
        meta = meta.of_group(self.kv_group)  # a hybrid model's layer group: its own table
        o = self.method.attend(self, qkv, self.rotary(cos_sin), kv_cache, meta)
        return self.o_proj(o.reshape(-1, self.q_size), nd)


class LlamaMLP(nn.Module):
    activation = "silu"  # of the gate; the fused step reads it (gemma3.py: "gelu_tanh")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, config.intermediate_size, False, dtype, tp
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, False, dtype, tp
        )
        self.use_kernel = False  # fused SiLU-and-mul (kernels/ops.c); set once by the loader

    def forward(self, x: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, num_decode)
        act = ops.silu_and_mul(gate_up) if self.use_kernel else silu_and_mul(gate_up)
        return self.down_proj(act, num_decode)


class LlamaDecoderLayer(nn.Module):
    residual_multiplier = 1.0  # what branch() scales by (granite.py); the fused step reads it

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        tp: TPGroup,
        layer_idx: int = 0,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attention_cls(config, dtype, tp, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, tp)

    def branch(self, h: torch.Tensor) -> torch.Tensor:
        """Hook: an attention or MLP output before it joins the residual stream (Granite
        scales it). Llama: as it is."""
        return h

    def step_norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """The norms as the fused step applies them: before attention, before the MLP, on
        the attention output and on the MLP output (None: none there; Gemma 3 has all)."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def forward(self, x, residual, cos_sin, kv_cache, meta):
        """-> (this layer's output, the residual stream before it is added)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.branch(self.self_attn(h, cos_sin, kv_cache, meta))
        h, residual = self.post_attention_layernorm(h, residual)
        return self.branch(self.mlp(h, meta.num_decode_tokens)), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int | None = None,
        rope_inv_freq: torch.Tensor | None = None,
        tp: TPGroup | None = None,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            layer_cls(config, dtype, tp, i, attention_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = self.build_rotary(
            config, max_position or config.max_position_embeddings, dtype, rope_inv_freq
        )
        # kernels/step.py: every layer in one C call, the same kernels as the loop below
        # (bitwise); the loader's, via LlamaForCausalLM.set_step_plan.
        self.step_plan = None

    def build_rotary(self, config, max_position: int, dtype, inv_freq) -> RotaryEmbedding:
        """Hook: the RoPE tables for positions [0, max_position) (Phi-3: partial, LongRoPE)."""
        return RotaryEmbedding(config.head_dim, max_position, config.rope_theta,
                               config.rope_scaling, dtype, inv_freq=inv_freq)  # fmt: skip

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook: the step's input rows [num_tokens, hidden] (Granite scales them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed(input_ids)  # [num_tokens, hidden]
        cos_sin = self.rotary_emb.cos_sin(positions)
        if self.step_plan is not None and meta.kernel is not None:  # (torch-path metadata: loop)
            x, residual = self.step_plan.forward(x, cos_sin, kv_caches, meta)
            return self.norm(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Serves ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM``
    checkpoints; the base of the other families."""

    # The classes each level builds: a family overrides the ones its hooks live in.
    model_cls: type[LlamaModel] = LlamaModel
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    attention_cls: type[LlamaAttention] = LlamaAttention
    # Whether kernels/step.py's one-call step computes this family: step.c knows Llama's
    # layer and the differences of qwen3.py, granite.py, smollm3.py and gemma3.py (head
    # norms, branch scale, NoPE layers, output norms, GeGLU, a second RoPE table; phi3.py's
    # are data); a family with another difference sets False until it learns it.
    fused_step_ok = True

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        max_position: int | None = None,
        rope_inv_freq: torch.Tensor | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        check_tp_divisible(config, self.tp.size)
        self.config = config
        self.dtype = dtype
        self.model = self.model_cls(config, dtype, max_position, rope_inv_freq, self.tp,
                                    self.layer_cls, self.attention_cls)  # fmt: skip
        self.attention_method: AttentionMethod = TORCH_ATTENTION
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)

    def set_attention_method(self, method: AttentionMethod) -> None:
        """How every layer's attention runs (the loader picks it once)."""
        self.attention_method = method
        for layer in self.model.layers:
            layer.self_attn.method = method

    def set_step_plan(self, plan) -> None:
        """Every layer in one C call (kernels/step.py ``build_plan``), or None: the loop."""
        self.model.step_plan = plan

    @property
    def attention_backend(self) -> str:
        """The attention method's name: "kernel", "triton" or "torch" (logs, benchmarks)."""
        return self.attention_method.name

    @property
    def lm_head_module(self) -> VocabParallelEmbedding:
        """The LM head: the embedding when tied."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [num_tokens, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, num_decode: int = 0) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 (only the rows that sample are passed in; the
        first ``num_decode`` of them are decode rows)."""
        return self.lm_head_module.logits(hidden, num_decode).float()

    def score_head(self) -> PackedMethod | None:
        """The LM head's CPU-kernel method where the logits are exactly its output (no bias,
        nothing after ``compute_logits``' matmul): prompt scoring then takes the logprobs
        straight from its tiles (kernels/gemm_score.h); None: from ``compute_logits``."""
        head = self.lm_head_module
        method = head.method
        return method if isinstance(method, PackedMethod) and head.bias is None else None

    def checkpoint_tensors(self, tensors, gguf: bool = False):
        """Hook: the checkpoint's (name, tensor, file) triples (GGUF ones already under HF
        names) as the loader maps them (models/weights.py; Phi-3 splits its fused qkv_proj
        and gate_up_proj, Gemma 3 adds its norms' offset). Llama: as they are."""
        return tensors

    def qkv_row_order(self) -> torch.Tensor | None:
        """Hook: which checkpoint row each row of the fused q/k/v weight holds (Phi-3's
        partial rotary reorders q/k rows); None: the checkpoint's order."""
        return None

    def linear_layers(self) -> dict[str, LinearBase | VocabParallelEmbedding]:
        """Every matmul of the model by parameter prefix (the LM head once, even if tied)."""
        layers = {n: m for n, m in self.named_modules() if isinstance(m, LinearBase)}
        head = "model.embed_tokens" if self.config.tie_word_embeddings else "lm_head"
        layers[head] = self.lm_head_module
        return layers


# Llama's layer exactly (models/registry.py resolves these names).
Qwen2ForCausalLM = LlamaForCausalLM
MistralForCausalLM = LlamaForCausalLM

"""A .gguf file as a checkpoint: its config (``ModelConfig.from_gguf_metadata``) plus the
``rope_freqs`` tensor, its tensors dequantised and renamed to HF names (``GGUF_TO_HF``) with
llama.cpp's q/k row permutation undone, and its Q4_1/Q8_0 blocks packed for the CPU kernels.
The header itself is read by gguf_file.py."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tinyserve.config import GGUF_PERMUTED_QK, MODEL_TYPES, ModelConfig

if TYPE_CHECKING:
    from tinyserve.models.llama import LlamaForCausalLM

# One logger for the whole loading path, so its messages keep the name they have always had.
logger = logging.getLogger("tinyserve.models.loader")

# GGUF tensor name -> HF checkpoint name ("{i}" is the layer index).
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",  # Qwen3
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
# Per GGUF architecture, the names that differ. Phi-3: q/k/v in attn_qkv, gate and up in
# ffn_up, by the name of that fused tensor (the model's ``checkpoint_tensors`` splits them as
# it splits the safetensors' own). Gemma 3: its norms around attention and the MLP.
GGUF_ARCH_NAMES = {
    "phi3": {"blk.{i}.attn_qkv": "model.layers.{i}.self_attn.qkv_proj",
             "blk.{i}.ffn_up": "model.layers.{i}.mlp.gate_up_proj"},
    "gemma3": {"blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
               "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
               "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm"},
}  # fmt: skip
# Tables, not weights: RoPE factors (llama3's rope_freqs; Phi-3's LongRoPE factors).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFCheckpoint:
    """Reads config and tensors from a .gguf file (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        from tinyserve.models.gguf_file import GGUFFile

        self.path = path
        try:
            self.file = GGUFFile(path)
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a valid GGUF file ({e})") from e
        self.arch = self.file.fields.get("general.architecture")
        if self.arch not in MODEL_TYPES:
            raise ValueError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"(tinyserve serves {', '.join(MODEL_TYPES)})"
            )
        self.tensors = self.file.tensors

    def config_and_rope(self) -> tuple[ModelConfig, torch.Tensor | None]:
        shapes = {name: t.shape for name, t in self.tensors.items()}
        config = ModelConfig.from_gguf_metadata(self.file.fields, shapes, str(self.path))
        inv_freq = None
        if "rope_freqs.weight" in self.tensors:  # llama3-style scaling baked in as factors
            from tinyserve.layers.rotary import rope_inv_freq

            factors = self._dequantize(self.tensors["rope_freqs.weight"])
            inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, None) / factors.float()
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's LongRoPE
            config = dataclasses.replace(config, rope_scaling=self._longrope())
        return config, inv_freq

    def _longrope(self) -> dict:
        """LongRoPE as a config.json states it, from llama.cpp's factor tensors and keys."""
        a, f = self.arch, self.file.fields
        factors = {k: self._dequantize(self.tensors[f"rope_factors_{k[:-7]}.weight"]).tolist()
                   for k in ("long_factor", "short_factor")}  # fmt: skip
        scaling = {"rope_type": "longrope", **factors,
                   "original_max_position_embeddings": f.get(f"{a}.rope.scaling.original_context_length")}  # fmt: skip
        if f.get(f"{a}.rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(f[f"{a}.rope.scaling.attn_factor"])
        return scaling

    def _dequantize(self, t) -> torch.Tensor:
        try:
            return torch.from_numpy(self.file.dequantize(t))
        except NotImplementedError as e:
            raise ValueError(
                f"{self.path}: tensor {t.name} has a GGUF type ({t.qtype}) "
                "that cannot be dequantised"
            ) from e

    def iter_tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
        for name, t in self.tensors.items():
            if name in ROPE_TENSORS:
                continue
            hf_name = gguf_to_hf_name(name, self.arch)
            if hf_name is None:
                logger.warning("%s: ignoring unknown GGUF tensor %s", self.path.name, name)
                continue
            w = self._dequantize(t)
            if self.arch in GGUF_PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
                # llama.cpp's converter interleaves q/k rows for its rope layout; undo it.
                heads = (
                    config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
                )
                w = unpermute_qk(w, heads)
            yield hf_name, w, self.path.name

    def packed_blocks(self, net: LlamaForCausalLM) -> dict[str, object]:
        """The checkpoint's Q4_1 / Q8_0 blocks for each linear whose parts share one kind, by
        our module prefix (q/k/v and gate/up stacked like the fused float parameters, q/k rows
        in the dequantised order: llama.cpp's permutation undone)."""
        from tinyserve.kernels import gemm

        config = net.config

        def blocks(name: str, heads: int | None = None):
            t = self.tensors.get(name)
            if t is None or len(t.shape) != 2:
                return None
            qw = gemm.from_gguf(self.file.raw(t), t.qtype, t.shape)
            if qw is not None and heads is not None and self.arch in GGUF_PERMUTED_QK:
                order = unpermute_qk(torch.arange(t.shape[0])[:, None], heads)[:, 0]
                qw = qw.take_rows(order)
            return qw

        def fused(parts):
            if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
                return None
            return gemm.cat_rows(parts)

        found, order = {}, net.qkv_row_order()
        one_tensor = "blk.0.attn_qkv.weight" in self.tensors
        for i in range(config.num_hidden_layers):
            b, prefix = f"blk.{i}.", f"model.layers.{i}."
            if one_tensor:  # q/k/v in one tensor, gate and up in ffn_up (Phi-3)
                qkv, gate_up = blocks(b + "attn_qkv.weight"), blocks(b + "ffn_up.weight")
            else:
                qkv = fused([blocks(b + "attn_q.weight", config.num_attention_heads),
                             blocks(b + "attn_k.weight", config.num_key_value_heads),
                             blocks(b + "attn_v.weight")])  # fmt: skip
                gate_up = fused([blocks(b + "ffn_gate.weight"), blocks(b + "ffn_up.weight")])
            if qkv is not None and order is not None:
                qkv = qkv.take_rows(order)
            found[prefix + "self_attn.qkv_proj"] = qkv
            found[prefix + "self_attn.o_proj"] = blocks(b + "attn_output.weight")
            found[prefix + "mlp.gate_up_proj"] = gate_up
            found[prefix + "mlp.down_proj"] = blocks(b + "ffn_down.weight")
        if config.tie_word_embeddings:
            found["model.embed_tokens"] = blocks("token_embd.weight")
        else:
            found["lm_head"] = blocks("output.weight")
        return {k: v for k, v in found.items() if v is not None}


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    base, _, suffix = name.rpartition(".")
    m = re.match(r"^blk\.(\d+)\.(.+)$", base)
    if m:
        key, i = f"blk.{{i}}.{m.group(2)}", m.group(1)
    else:
        key, i = base, None
    hf = GGUF_ARCH_NAMES.get(arch, {}).get(key) or GGUF_TO_HF.get(key)
    if hf is None:
        return None
    return f"{hf.format(i=i)}.{suffix}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )

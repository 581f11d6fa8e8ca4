"""Write a transformers model as a GGUF the way llama.cpp's convert_hf_to_gguf.py lays it out
(its tensor names and metadata keys; q/k rows permuted for the families its converter
derives from LlamaModel), with a chosen GGML type per projection: the test checkpoints of the
GGUF loader, and the family GGUFs of the benchmarks (no tokenizer in the file)."""

from __future__ import annotations

import math

import numpy as np
import torch

# transformers model_type -> (GGUF general.architecture, q/k rows permuted by the converter)
GGUF_ARCH = {
    "llama": ("llama", True),
    "mistral": ("llama", True),  # llama.cpp converts Mistral checkpoints as llama
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "granite": ("granite", True),
    "smollm3": ("smollm3", True),
    "phi3": ("phi3", False),  # its fused qkv_proj / gate_up_proj kept: attn_qkv, ffn_up
    "gemma3_text": ("gemma3", False),  # norms written as 1 + w
}
# Per GGUF architecture, the names that differ from HF_TO_GGUF's.
ARCH_NAMES = {"gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
                         "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                         "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}}  # fmt: skip

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate and up in one tensor
}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q/k for the llama architecture."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    parts = hf_name.split(".")
    names = {**HF_TO_GGUF, **ARCH_NAMES.get(arch, {})}
    return f"blk.{parts[2]}.{names['.'.join(parts[3:])]}"


def _metadata(w, cfg) -> None:
    import gguf

    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: global
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    head_dim = getattr(cfg, "head_dim", None)
    gemma = cfg.model_type == "gemma3_text"
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if head_dim and (gemma or head_dim != cfg.hidden_size // cfg.num_attention_heads):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if cfg.model_type == "granite":  # the converter's names for the four scalars
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if cfg.model_type == "phi3":
        _phi3_metadata(w, cfg)


def _phi3_metadata(w, cfg) -> None:
    """As llama.cpp's Phi3MiniModel: rotary dims, the original context, the window (0: none)
    and, for LongRoPE, the attention factor it computes and the factors as two tensors."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                               // cfg.num_attention_heads)  # fmt: skip
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        )
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(rope[f"{kind}_factor"], dtype=np.float32))  # fmt: skip


def write_gguf(
    hf, path, qtypes: dict[str, str], arch: str | None = None, rope_freqs=None, extra=None
):
    """Write ``hf`` as a GGUF; ``qtypes`` maps a projection suffix (e.g. "attn_q") to a GGML
    type name, others are F32; ``arch`` overrides the architecture (tests of refusals);
    ``extra(writer)`` adds metadata (a tokenizer). Returns {hf name: the exact fp32 weight
    a reader should get}."""
    import gguf

    cfg = hf.config
    arch_name, permuted = GGUF_ARCH.get(cfg.model_type, (cfg.model_type, False))
    w = gguf.GGUFWriter(str(path), arch or arch_name)
    _metadata(w, cfg)
    if extra is not None:
        extra(w)
    expected = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = gguf_name(name, arch_name)
        data = t.detach().float().numpy().copy()
        shift = arch_name == "gemma3" and name.endswith("norm.weight")  # the converter's 1 + w
        heads = None
        if permuted and gname.endswith(("attn_q.weight", "attn_k.weight")):
            q = gname.endswith("attn_q.weight")
            heads = cfg.num_attention_heads if q else cfg.num_key_value_heads
            data = permute_qk(data, heads)
        kind = next((v for k, v in qtypes.items() if f".{k}." in f".{gname}"), "F32")
        if data.ndim == 1:
            kind = "F32"  # norms and biases stay float, as the converter keeps them
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(gname, data + np.float32(1.0) if shift else data)
            stored = data
        elif kind == "F16":
            w.add_tensor(gname, data.astype(np.float16))
            stored = data.astype(np.float16).astype(np.float32)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype).reshape(data.shape)
        if heads is not None:
            stored = unpermute_qk(stored, heads)
        expected[name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected

"""The config fields only some families have (``ModelConfig``'s fields after
``eos_token_ids``), read from a config.json or from GGUF metadata. Torch-free (config.py
imports it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# SmolLM3 in GGUF: every 4th layer without RoPE (llama.cpp's n_no_rope_layer_step; no key).
SMOLLM3_NO_ROPE_STEP = 4
# Granite's multipliers under llama.cpp's converter's names for them.
GRANITE_GGUF_KEYS = {"embedding_multiplier": "embedding_scale",
                     "residual_multiplier": "residual_scale",
                     "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}  # fmt: skip
# LongRoPE's keys that change the tables (Phi-3; rope_type and the two factor lists besides).
LONGROPE_KEYS = ("original_max_position_embeddings", "factor", "attention_factor")


def hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from a config.json: transformers 5 moved both into
    ``rope_parameters``; ``type`` is the older name of ``rope_type``. LongRoPE keeps only what
    changes its tables, its original length from the top level where 4.x configs keep it."""
    params = dict(cfg.get("rope_parameters") or {})
    params = params.get("full_attention", params)  # per layer type (Gemma 3): the global one
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and "rope_type" not in scaling and "type" in scaling:
        scaling = {**scaling, "rope_type": scaling["type"]}
    if scaling is not None and scaling.get("rope_type") in ("su", "longrope"):  # su: its old name
        scaling = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings"),
                   **scaling}  # fmt: skip
        scaling = {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
                   "long_factor": list(scaling["long_factor"]),
                   **{k: scaling[k] for k in LONGROPE_KEYS if scaling.get(k) is not None}}  # fmt: skip
    if scaling is not None and scaling.get("rope_type") == "default":
        scaling = None
    return float(theta), scaling


# Defaults of transformers' config classes where a family's differs from Llama's (a key a
# config.json leaves out: transformers 4.x's save_pretrained omits one equal to its default).
TIED_BY_DEFAULT = frozenset({"Gemma3ForCausalLM", "SmolLM3ForCausalLM"})
WINDOW_BY_DEFAULT = {"MistralForCausalLM": 4096, "Gemma3ForCausalLM": 4096}
QWEN_WINDOWED = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM"})  # max_window_layers: 28
# The MLP's activation each family's model file computes, under the names transformers gives it.
ACTIVATIONS = {"Gemma3ForCausalLM": ("gelu_pytorch_tanh", "gelu_new")}
SILU = ("silu", "swish")


def hf_attention_bias(cfg: dict[str, Any], arch: str) -> dict[str, bool]:
    """Which attention projections carry a bias, as transformers builds each family: Qwen2
    q/k/v always (its attention_bias is not read), Mistral and Phi-3 none, the others q/k/v
    and o_proj where attention_bias says (o_proj's was dropped with a warning: wrong logits)."""
    if arch == "Qwen2ForCausalLM":
        return {"attention_bias": True, "o_proj_bias": False}
    on = arch not in ("MistralForCausalLM", "Phi3ForCausalLM") and bool(cfg.get("attention_bias"))
    return {"attention_bias": on, "o_proj_bias": on}


def check_hf_config(cfg: dict[str, Any], arch: str) -> None:
    """What the served forward pass cannot compute: a ValueError naming it (each was loaded
    and served with wrong logits, at most a warning)."""
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported (no served family has them)")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(f"quantization_config: {method!r} checkpoints are not supported (serve "
                         "the unquantized checkpoint, with --quantization int8 if wanted, or a GGUF)")  # fmt: skip
    key = "hidden_activation" if arch == "Gemma3ForCausalLM" else "hidden_act"
    act, allowed = cfg.get(key), ACTIVATIONS.get(arch, SILU)
    if act is not None and act not in allowed:
        raise ValueError(f"{key}: {act!r} is not supported for {arch} (it computes {allowed[0]})")


def hf_family_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The fields after ``eos_token_ids`` from a config.json: each where its family sets it.
    A ``sliding_window`` counts only where the config turns it on (Qwen2 and Qwen3 carry one
    with ``use_sliding_window: false``; ``layer_types`` without a sliding layer)."""
    check_hf_config(cfg, arch)
    out: dict[str, Any] = hf_attention_bias(cfg, arch)
    window, types = cfg.get("sliding_window", WINDOW_BY_DEFAULT.get(arch)), cfg.get("layer_types")
    if types is None and cfg.get("use_sliding_window") and arch in QWEN_WINDOWED:
        # Qwen's rule before transformers wrote layer_types: windowed from that layer on.
        start = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= start else "full_attention"
                 for i in range(int(cfg["num_hidden_layers"]))]  # fmt: skip
    windowed = "sliding_attention" in (types or ["sliding_attention"])
    if window is not None and cfg.get("use_sliding_window", True) and windowed:
        out["sliding_window"] = int(window)
        if types and arch != "Gemma3ForCausalLM":  # (Gemma 3's: local_layers)
            out["window_layers"] = tuple(int(t == "sliding_attention") for t in types)
    if cfg.get("no_rope_layers") is not None:
        out["no_rope_layers"] = tuple(int(x) for x in cfg["no_rope_layers"])
    elif arch == "SmolLM3ForCausalLM":  # every no_rope_layer_interval-th layer without RoPE
        step = int(cfg.get("no_rope_layer_interval", SMOLLM3_NO_ROPE_STEP))
        out["no_rope_layers"] = tuple(int((i + 1) % step != 0)
                                      for i in range(int(cfg["num_hidden_layers"])))  # fmt: skip
    if arch == "Phi3ForCausalLM":
        rope = cfg.get("rope_parameters") or {}
        out["partial_rotary_factor"] = float(
            cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        )
    if arch == "Gemma3ForCausalLM":
        out.update(_gemma3_fields(cfg))
    if arch == "GraniteForCausalLM":
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            out[name] = float(cfg.get(name, 1.0))
        if cfg.get("attention_multiplier") is not None:
            out["attention_multiplier"] = float(cfg["attention_multiplier"])
    return out


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Local layers (``layer_types``, or every ``sliding_window_pattern``-th layer global as
    before transformers 4.53), their RoPE base, query_pre_attn_scalar as the softmax scale."""
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise ValueError(f"{cap}: logit soft-capping is not supported (Gemma 3 has none)")
    n = int(cfg["num_hidden_layers"])
    step = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % step == 0 else "sliding_attention" for i in range(n)
    ]
    local_rope = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {"local_layers": tuple(int(t == "sliding_attention") for t in types),
            "rope_local_theta": float(cfg.get("rope_local_base_freq",
                                              local_rope.get("rope_theta", 10000.0))),
            "attention_multiplier": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5}  # fmt: skip


def gguf_eos_ids(fields: Mapping[str, Any]) -> tuple[int, ...]:
    """The ids a GGUF says end an answer: its eos, and its end-of-turn / end-of-message token
    where the converter wrote one (Llama 3's <|eot_id|>, Gemma's <end_of_turn>: a chat
    answer ends there, as llama.cpp stops; only eos was read, so the answer ran on)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = (fields.get(f"tokenizer.ggml.{k}") for k in keys)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def gguf_family_fields(fields: Mapping[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The same from a GGUF's metadata (``arch``: its general.architecture)."""
    out: dict[str, Any] = {}
    if arch == "granite":
        out = {k: float(fields[f"{arch}.{g}"]) for k, g in GRANITE_GGUF_KEYS.items()
               if f"{arch}.{g}" in fields}  # fmt: skip
    if arch == "phi3":  # rope_factors_long / _short: tensors (models/gguf_checkpoint.py)
        rot = fields.get(f"{arch}.rope.dimension_count")
        head_dim = fields.get(f"{arch}.attention.key_length") or (
            int(fields[f"{arch}.embedding_length"]) // int(fields[f"{arch}.attention.head_count"])
        )
        out["partial_rotary_factor"] = int(rot) / int(head_dim) if rot else 1.0
        if fields.get(f"{arch}.attention.sliding_window"):  # 0: none (the converter's Phi-4)
            out["sliding_window"] = int(fields[f"{arch}.attention.sliding_window"])
    if arch == "gemma3":  # as llama.cpp: every 6th layer global; local base 10000 unless given
        out["local_layers"] = tuple(int(i % 6 < 5) for i in range(num_layers))
        out["rope_local_theta"] = float(fields.get(f"{arch}.rope.freq_base_swa", 10000.0))
        head_dim = int(fields.get(f"{arch}.attention.key_length") or 256)
        heads = int(fields[f"{arch}.attention.head_count"])
        scalar = int(fields[f"{arch}.embedding_length"]) // heads if num_layers == 62 else head_dim
        out["attention_multiplier"] = float(scalar) ** -0.5  # (62 layers: Gemma 3 27B's)
        if fields.get(f"{arch}.attention.sliding_window"):
            out["sliding_window"] = int(fields[f"{arch}.attention.sliding_window"])
    if arch == "smollm3":
        step = SMOLLM3_NO_ROPE_STEP
        out["no_rope_layers"] = tuple(int((i + 1) % step != 0) for i in range(num_layers))
    return out

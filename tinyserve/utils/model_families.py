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


def hf_family_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The fields after ``eos_token_ids`` from a config.json: each where its family sets it.
    A ``sliding_window`` counts only where the config turns it on (Qwen2 and Qwen3 carry one
    with ``use_sliding_window: false``; ``layer_types`` without a sliding layer)."""
    out: dict[str, Any] = {}
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported (no served family has them)")
    window = cfg.get("sliding_window")
    windowed = "sliding_attention" in (cfg.get("layer_types") or ["sliding_attention"])
    if window is not None and cfg.get("use_sliding_window", True) and windowed:
        out["sliding_window"] = int(window)
    if cfg.get("no_rope_layers") is not None:
        out["no_rope_layers"] = tuple(int(x) for x in cfg["no_rope_layers"])
    if arch == "GraniteForCausalLM":
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            out[name] = float(cfg.get(name, 1.0))
        if cfg.get("attention_multiplier") is not None:
            out["attention_multiplier"] = float(cfg["attention_multiplier"])
    return out


def gguf_family_fields(fields: Mapping[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The same from a GGUF's metadata (``arch``: its general.architecture)."""
    out: dict[str, Any] = {}
    if arch == "granite":
        out = {k: float(fields[f"{arch}.{g}"]) for k, g in GRANITE_GGUF_KEYS.items()
               if f"{arch}.{g}" in fields}  # fmt: skip
    if arch == "smollm3":
        step = SMOLLM3_NO_ROPE_STEP
        out["no_rope_layers"] = tuple(int((i + 1) % step != 0) for i in range(num_layers))
    return out

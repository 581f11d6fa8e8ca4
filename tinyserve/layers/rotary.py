"""Rotary position embeddings (the rotate-half layout used by HF Llama/Qwen2 checkpoints),
with the default schedule and the ``llama3``, ``linear`` and ``longrope`` (Phi-3) scaling
variants, over all of each head's dims or its first ``rotary_dim`` (Phi-3's partial rotary:
models/phi3.py orders q/k so that a full-width table with identity columns serves it)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, after any scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(s["factor"])
    low_freq_factor = float(s.get("low_freq_factor", 1.0))
    high_freq_factor = float(s.get("high_freq_factor", 4.0))
    old_context_len = float(s.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope(
    rotary_dim: int, base: float, s: dict[str, Any], max_position_embeddings: int, served_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): (inverse frequencies [rotary_dim // 2], attention factor), as
    transformers' ``_compute_longrope_parameters``. The long factors where the served length
    exceeds the pretraining one (one table for every position, as llama.cpp picks by its
    context and transformers by the sequence's length), else the short ones; the factor
    scales cos and sin, sqrt(1 + ln(f) / ln(original)) with f = max / original."""
    original = s.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    factors = s["long_factor"] if served_len > original else s["short_factor"]
    if len(s["long_factor"]) != rotary_dim // 2 or len(s["short_factor"]) != rotary_dim // 2:
        raise ValueError(f"longrope: long_factor and short_factor need {rotary_dim // 2} values")
    factor = s.get("factor") or max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**shape)
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Holds a cos/sin table for positions [0, max_position); applied to flat q/k. With
    ``inv_freq`` shorter than head_dim // 2 (partial rotary), the remaining columns are the
    identity (cos 1, sin 0: those dims pass through exactly); ``attention_factor`` (LongRoPE)
    scales the rotated columns' cos and sin."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        inv_freq: torch.Tensor | None = None,
        attention_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        if inv_freq is None:
            inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_position, rotary_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        rest = head_dim // 2 - freqs.shape[1]  # identity columns: dims RoPE leaves alone
        cos = torch.cat((cos, torch.ones(max_position, rest)), dim=1)
        sin = torch.cat((sin, torch.zeros(max_position, rest)), dim=1)
        self.register_buffer("cos_cache", cos.to(dtype), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered once per step and shared by every layer: two [num_tokens, 1, head_dim//2]."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] rotated by rotate-half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

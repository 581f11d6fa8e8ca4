"""Tiny random transformers checkpoints (seeded, fp32), written by transformers itself.

One builder, :func:`write_checkpoint`, over one config factory, :func:`tiny_config`; the
named presets below are the checkpoints the suite and the benchmarks use.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 256
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Larger initializer_range than the default 0.02 so attention is peaked and RoPE (and its
# scaling) matter.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1)  # fmt: skip
# Per architecture: the transformers config class and what differs from COMMON.
_ARCH = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False, "rope_theta": 1e6}),
    # head_dim 32 over hidden 64 with 4 heads: explicit, as Qwen3's (128 over 1024 at 0.6B).
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32, "rope_theta": 1e6}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    # Granite 3.x's own multipliers are 12 / 0.22 / 0.0078125 / 8 at 2B; these are as far from 1.
    "granite": ("GraniteConfig", {"tie_word_embeddings": True, "embedding_multiplier": 6.0,
                                  "residual_multiplier": 0.3, "attention_multiplier": 0.05,
                                  "logits_scaling": 4.0, "pad_token_id": None, "bos_token_id": None,
                                  "eos_token_id": None}),
    # Layer 1 of 3 without RoPE (the released model: every fourth).
    "smollm3": ("SmolLM3Config", {"tie_word_embeddings": True, "no_rope_layers": [1, 0, 1],
                                  "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    # Phi-4-mini's partial rotary (3/4 of each head: 12 of 16 dims here); no window.
    "phi3": ("Phi3Config", {"tie_word_embeddings": False, "partial_rotary_factor": 0.75,
                            "sliding_window": None, "pad_token_id": None, "bos_token_id": None,
                            "eos_token_id": None}),
    # Gemma 3 4B's RoPE (global 1e6 scaled linearly by 8, local 1e4), a 64-position window,
    # layer 1 of 3 global, query_pre_attn_scalar apart from head_dim 32.
    "gemma3": ("Gemma3TextConfig", {"tie_word_embeddings": True, "head_dim": 32,
                                    "query_pre_attn_scalar": 24, "sliding_window": 64,
                                    "layer_types": ["sliding_attention", "full_attention",
                                                    "sliding_attention"],
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                    "pad_token_id": None, "bos_token_id": None,
                                    "eos_token_id": None}),
}  # fmt: skip


def phi3_longrope(rotary_dim: int, original: int = 64) -> dict:
    """Phi-3's LongRoPE config fields for ``rotary_dim`` rotated dims: per-frequency short and
    long factors (as far apart as the released ones: ~1 against up to ~40) and the original
    context (max_position_embeddings 512 / 64: attention factor sqrt(1.5))."""
    n = rotary_dim // 2
    return {"original_max_position_embeddings": original,
            "rope_scaling": {"rope_type": "longrope",
                             "short_factor": [1.0 + 0.1 * i for i in range(n)],
                             "long_factor": [1.0 + 8.0 * i for i in range(n)]}}  # fmt: skip


def tiny_config(arch: str, **over):
    """A tiny ``arch`` ("llama": tied head; "qwen2": q/k/v bias, untied head) config."""
    import transformers

    cls_name, defaults = _ARCH[arch]
    return getattr(transformers, cls_name)(**{**COMMON, **defaults, **over})


def llama_config(**over):
    return tiny_config("llama", **over)


def qwen2_config(**over):
    return tiny_config("qwen2", **over)


def build_hf(config, seed: int = 1234, randomize: bool = True, attn_implementation="eager"):
    """The transformers model of ``config`` with seeded random weights. ``randomize``:
    biases and norm weights random too (transformers initialises them to 0 and 1), so that
    a dropped bias or a misplaced norm weight changes the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
    if randomize:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
                elif "norm" in name:
                    p.uniform_(0.5, 1.5)
    return hf.eval()


def save_hf(hf, path, **kwargs):
    hf.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def write_checkpoint(
    dest: Path,
    config,
    seed: int,
    *,
    randomize: bool = False,
    tokenizer_dir: Path | None = None,
    attn_implementation: str | None = None,
) -> Path:
    """Build :func:`build_hf` and write it (safetensors + config.json, plus the files of
    ``tokenizer_dir``) to ``dest``, atomically. Idempotent: an existing checkpoint stays."""
    dest = Path(dest)
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists():
        return dest
    hf = build_hf(config, seed, randomize=randomize, attn_implementation=attn_implementation)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(hf, tmp)
    for f in Path(tokenizer_dir).iterdir() if tokenizer_dir else ():
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


# -- presets ----------------------------------------------------------------------------------


def engine_qwen2(dest: Path) -> Path:
    """The engine tests' tiny Qwen2: q/k/v bias, GQA, untied head, no BOS/EOS."""
    config = qwen2_config(
        num_hidden_layers=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        # Larger than the default 0.02: peaked logits, so greedy never sits on a near-tie.
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
    )
    return write_checkpoint(dest, config, seed=20240501, attn_implementation="eager")


def build_fuzz_model(dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary, tokenizer and chat template
    (safetensors + config.json + tokenizer files). Idempotent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = llama_config(
        vocab_size=len(tok),
        num_hidden_layers=2,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return write_checkpoint(dest, config, seed, tokenizer_dir=Path(tokenizer_dir))


def smollm2_like_config(**over):
    """SmolLM2-135M-Instruct's exact shape: 30 layers, 9 heads of 64, 3 KV heads, tied
    embeddings, its RoPE base and vocabulary."""
    return llama_config(**{**dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                  num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, max_position_embeddings=8192,
                                  rope_theta=100000.0, rms_norm_eps=1e-5,
                                  initializer_range=0.02), **over})  # fmt: skip


def smollm2_like(dest: Path, tokenizer_dir: Path, seed: int = 0, **over) -> Path:
    """A :func:`smollm2_like_config` checkpoint with random weights and SmolLM2's tokenizer
    and chat template: what scripts/gpu_check.sh serves where the 98 MB GGUF cannot travel
    (``over``: config fields to change, e.g. fewer layers for its CPU dry run). Idempotent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = smollm2_like_config(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **over
    )
    return write_checkpoint(dest, config, seed, tokenizer_dir=Path(tokenizer_dir))


def smollm2_shaped(dest: Path) -> Path:
    """SmolLM2's shape with 8 heads of 72 and 4 KV heads (random weights, no tokenizer)."""
    config = smollm2_like_config(num_attention_heads=8, num_key_value_heads=4,
                                 max_position_embeddings=2048, rope_theta=10000.0,
                                 rms_norm_eps=1e-6)  # fmt: skip
    return write_checkpoint(dest, config, seed=0)


# -- inputs and references --------------------------------------------------------------------


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]

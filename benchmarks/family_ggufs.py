#!/usr/bin/env python
"""The families of issue 41 as ~1B-shaped Q4_1 GGUFs with random weights (speed does not
depend on their values), for benchmarking tinyserve against llama.cpp on the same file.

Each is a transformers model in its family's own shape (seeded), written the way llama.cpp's
converter lays the family out (tinyserve/testing/gguf_writer.py): Q4_1 projections, a Q8_0
embedding — the default SmolLM2 GGUF's mix — with the default model's tokenizer metadata
copied in (both servers need one), so the vocabulary is SmolLM2's 49,152 tokens, not the
family's own (Qwen3 151,936; SmolLM3 128,256; Granite 49,155): the LM head is the one part
smaller than the real model's.

  python benchmarks/family_ggufs.py [--out-dir ~/.cache/tinyserve/families] [--families qwen3,granite,smollm3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# family -> (transformers config class, fields): the seed's shape, at most ~1.2B parameters.
SHAPES = {
    # Qwen3-0.6B exactly (but the vocabulary): head_dim 128 over a hidden size of 1024.
    "qwen3": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                  rope_theta=1e6, tie_word_embeddings=True)),
    # granite-3.3-2b's width, heads and multipliers, 16 of its 40 layers (~1.1B).
    "granite": ("GraniteConfig", dict(hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=16, num_attention_heads=32,
                                      num_key_value_heads=8, rope_theta=1e7,
                                      tie_word_embeddings=True, embedding_multiplier=12.0,
                                      residual_multiplier=0.22, attention_multiplier=0.0078125,
                                      logits_scaling=8.0)),
    # SmolLM3-3B's width and heads, 16 of its 36 layers (~1.1B); every 4th layer NoPE.
    "smollm3": ("SmolLM3Config", dict(hidden_size=2048, intermediate_size=11008,
                                      num_hidden_layers=16, num_attention_heads=16,
                                      num_key_value_heads=4, rope_theta=5e6,
                                      tie_word_embeddings=True)),
    # gemma-3-1b exactly (but the vocabulary): 5 local (window 512) layers to 1 global.
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912,
                                        num_hidden_layers=26, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=256, rope_theta=1e6,
                                        rope_local_base_freq=10000.0, sliding_window=512,
                                        query_pre_attn_scalar=256, tie_word_embeddings=True)),
    # Phi-4-mini's width, heads and partial rotary (0.75 of 128), 10 of its 32 layers (~1.1B);
    # its checkpoint's fused qkv_proj / gate_up_proj, as llama.cpp's attn_qkv / ffn_up.
    "phi3": ("Phi3Config", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=10,
                                num_attention_heads=24, num_key_value_heads=8,
                                partial_rotary_factor=0.75, rope_theta=10000.0,
                                tie_word_embeddings=True)),
}  # fmt: skip
Q4_1_MIX = {p: "Q4_1" for p in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
                                 "ffn_gate", "ffn_up", "ffn_down")} | {"token_embd": "Q8_0"}  # fmt: skip


def build(family: str, out_dir: Path, add_tokenizer) -> Path:
    import transformers

    from tinyserve.testing.gguf_writer import write_gguf

    path = out_dir / f"{family}-1b-random.Q4_1.gguf"
    if path.exists():
        return path
    cls_name, shape = SHAPES[family]
    config = getattr(transformers, cls_name)(vocab_size=49152, max_position_embeddings=8192,
                                             bos_token_id=1, eos_token_id=2, pad_token_id=None,
                                             **shape)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_gguf(hf, tmp, Q4_1_MIX, extra=add_tokenizer)
    tmp.rename(path)
    print(f"{family}: {sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B parameters -> {path}")
    return path


def main() -> None:
    from tinyserve.models.default_model import default_gguf_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=Path.home() / ".cache/tinyserve/families")
    p.add_argument("--families", default=",".join(SHAPES))
    args = p.parse_args()
    from tinyserve.models.gguf_tokenizer import tokenizer_fields

    add = tokenizer_fields(default_gguf_path())
    for family in args.families.split(","):
        print(build(family, args.out_dir, add))


if __name__ == "__main__":
    main()

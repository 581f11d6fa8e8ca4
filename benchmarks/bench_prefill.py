#!/usr/bin/env python
"""One long prompt's prefill offline (TTFT without a server), against the CPU's bf16 peak.

The engine (default flags) prefills one --prompt-len-token prompt of random tokens
(max_tokens 1, prefix caching off, so every repetition computes it all) --reps times; the
model's FLOPs for it are counted from its shapes: 2 per multiply-add of every linear layer
at every prompt row (the LM head at the last row only) and of attention (q.k and p.v over
each row's causal prefix). Reported: seconds min / median / max, prompt tokens/s and
GFLOP/s, and with --peak (benchmarks/bench_amx_peak.py's JSON) the share of that peak.

python benchmarks/bench_prefill.py [--prompt-len 2048] [--reps 3] [--max-num-batched-tokens 512]
    [--peak benchmarks/results/amx_peak_xeon.json] [--out benchmarks/results/prefill.json]
"""

from __future__ import annotations

import argparse
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


def model_flops(config, n: int) -> dict[str, float]:
    """FLOPs of prefilling n tokens: linear layers at n rows (LM head at 1), attention."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_row = layers * (h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h)  # qkv o gu down
    linear = 2.0 * n * per_row + 2.0 * h * config.vocab_size
    keys = n * (n + 1) / 2  # row i attends to i + 1 keys
    attention = 2.0 * 2 * layers * config.num_attention_heads * config.head_dim * keys
    return {"linear": linear, "attention": attention, "total": linear + attention}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--peak", default=None, help="bench_amx_peak.py's JSON")
    ap.add_argument("--out", default="benchmarks/results/prefill.json")
    args = ap.parse_args()

    from tinyserve.entrypoints.llm import LLM
    from tinyserve.sampling_params import SamplingParams

    llm = LLM(model=args.model, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(args.prompt_len, 64) + 16, enable_prefix_caching=False)  # fmt: skip
    config = llm.engine.model_config
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([[rng.randrange(100, 1000) for _ in range(64)]], params, use_tqdm=False)  # warm
    seconds = []
    for _ in range(args.reps):
        prompt = [rng.randrange(100, config.vocab_size - 100) for _ in range(args.prompt_len)]
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
    flops = model_flops(config, args.prompt_len)
    med = statistics.median(seconds)
    result = {
        "machine": machine_info(),
        "prompt_len": args.prompt_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seconds": {"min": min(seconds), "median": med, "max": max(seconds), "all": seconds},
        "prompt_tok_s": args.prompt_len / med,
        "gflop": {k: v / 1e9 for k, v in flops.items()},
        "gflops_achieved": flops["total"] / med / 1e9,
    }
    if args.peak:
        peak = json.loads(Path(args.peak).read_text())["gflops"]
        best = max(peak, key=lambda k: int(k.split("_")[0]))  # every usable core
        result["peak"] = {"threads": best, **peak[best]}
        result["share_of_peak"] = {k: result["gflops_achieved"] / v for k, v in peak[best].items()}
    print(f"{args.prompt_len}-token prefill: {min(seconds):.3f} / {med:.3f} / {max(seconds):.3f} s"
          f" (min/median/max of {args.reps}), {result['prompt_tok_s']:.0f} tok/s, "
          f"{result['gflops_achieved']:.0f} GFLOP/s of {flops['total'] / 1e9:.0f} GFLOP "
          f"({flops['attention'] / flops['total']:.0%} attention)")  # fmt: skip
    for k, v in result.get("share_of_peak", {}).items():
        print(f"  {v:.1%} of {k} ({result['peak'][k]:.0f} GFLOP/s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()

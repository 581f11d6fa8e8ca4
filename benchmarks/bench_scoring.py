#!/usr/bin/env python
"""Scoring prompts (issue 39) against prefilling them, offline, interleaved.

The engine (default flags, prefix caching off so that every repetition computes everything)
runs --prompts random-token prompts of --prompt-len tokens two ways, alternating, --reps
times each:

prefill  max_tokens 1, no logprobs: the prompts' prefill (and one sampled token each)
scoring  max_tokens 0, prompt_logprobs 1: what ``echo`` + ``logprobs: 1`` + ``max_tokens:
         0`` asks of the engine (every prompt row through the LM head, log-softmax, the
         target's logprob and rank, the top 1)

Reported: seconds min / median / max of each and the ratio of the medians (issue 39's
target: scoring <= 1.2x prefill), with the FLOPs the LM head adds.

python benchmarks/bench_scoring.py [--prompts 64] [--prompt-len 512] [--reps 3]
    [--out benchmarks/results/scoring.json]
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
from bench_prefill import model_flops  # noqa: E402
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/scoring.json")
    args = ap.parse_args()

    from tinyserve.entrypoints.llm import LLM
    from tinyserve.sampling_params import SamplingParams

    llm = LLM(model=args.model, max_model_len=args.prompt_len + 16, enable_prefix_caching=False)
    config = llm.engine.model_config
    rng = random.Random(0)
    modes = {
        "prefill": SamplingParams(max_tokens=1, temperature=0),
        "scoring": SamplingParams(max_tokens=0, prompt_logprobs=1),
    }
    warm = [[rng.randrange(100, 1000) for _ in range(64)]]
    for params in modes.values():
        llm.generate(warm, params, use_tqdm=False)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for mode, params in modes.items():
            prompts = [[rng.randrange(100, config.vocab_size - 100) for _ in range(args.prompt_len)]
                       for _ in range(args.prompts)]  # fmt: skip
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds[mode].append(time.perf_counter() - t)
            if mode == "scoring":
                assert all(len(o.prompt_logprobs) == args.prompt_len for o in outs)
    med = {m: statistics.median(s) for m, s in seconds.items()}
    flops = model_flops(config, args.prompt_len)["total"] * args.prompts
    head = 2.0 * config.hidden_size * config.vocab_size * (args.prompt_len - 1) * args.prompts
    result = {
        "machine": machine_info(),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "seconds": {m: {"min": min(s), "median": med[m], "max": max(s), "all": s}
                    for m, s in seconds.items()},  # fmt: skip
        "ratio_of_medians": med["scoring"] / med["prefill"],
        "gflop": {"prefill": flops / 1e9, "scoring_head_extra": head / 1e9},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for m, s in seconds.items():
        print(f"{m:8s} {min(s):.2f} / {med[m]:.2f} / {max(s):.2f} s")
    print(f"scoring / prefill {result['ratio_of_medians']:.3f} (the LM head at every row: "
          f"+{head / flops:.0%} FLOPs)")  # fmt: skip


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Long contexts offline: a prompt's new tokens after a cached prefix, and decode steps deep
in a context, this tree against another revision, interleaved.

What an agent loop's turn costs (benchmarks/bench_agent_loop.py): the conversation so far is
a prefix-cache hit, the new tool results (~540 tokens) are prefilled against it, and every
answer token attends to the whole context — there attention, not the weights, is most of
the work (SmolLM2 on a Zen 4: 543 new tokens after 1456 cached took 2x what they take
alone). Per tree (this one and ``--baseline-rev``, each in its own process, default flags,
speculation off): ``--new`` random tokens after ``--contexts`` cached ones (max_tokens 1:
the prefill; the prefix sent first, so that it is cached) and ``--decode-tokens`` greedy
tokens decoded at each context of ``--decode-contexts``, in ms a token, and ``--streams``
sequences decoding together at the first of them, in ms a step. ``--reps``
repetitions, the trees alternating in each; min / median / max per cell, fresh random tokens
every repetition (no cross-repetition cache hits).

python benchmarks/bench_long_context.py [--baseline-rev 86aa8b9] [--reps 3]
    [--contexts 0,1456,3000] [--new 543] [--decode-contexts 1000,3000] [--streams 16]
    [--out benchmarks/results/long_context.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from trees import this_tree_and  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")


def child(args: argparse.Namespace) -> None:
    """One repetition of every cell on the tinyserve this process imports: JSON on stdout."""
    from tinyserve.entrypoints.llm import LLM
    from tinyserve.sampling_params import SamplingParams

    llm = LLM(args.model, speculative_config="off")
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([tokens(64)], one, use_tqdm=False)  # kernels built, first steps taken
    out: dict[str, float] = {}
    for ctx in args.contexts:
        prefix, new = tokens(ctx), tokens(args.new)
        if ctx:
            llm.generate([prefix], one, use_tqdm=False)
        t = time.perf_counter()
        llm.generate([prefix + new], one, use_tqdm=False)
        out[f"prefill {args.new} after {ctx}"] = (time.perf_counter() - t) * 1000
    n = args.decode_tokens
    decode = SamplingParams(max_tokens=n + 1, temperature=0.0, ignore_eos=True)
    for ctx in args.decode_contexts:
        prompt = tokens(ctx)
        llm.generate([prompt], one, use_tqdm=False)
        t = time.perf_counter()
        llm.generate([prompt], decode, use_tqdm=False)  # a cached prompt: 1 row, then n steps
        out[f"decode at {ctx}"] = (time.perf_counter() - t) * 1000 / n
    if args.streams > 1:  # that many sequences decoding together, each at the first context
        ctx = args.decode_contexts[0]
        prompts = [tokens(ctx) for _ in range(args.streams)]
        llm.generate(prompts, one, use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompts, decode, use_tqdm=False)
        out[f"decode {args.streams} streams at {ctx}"] = (time.perf_counter() - t) * 1000 / n
    print(json.dumps(out))


def run_tree(tree: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--seed", str(seed),
           "--model", args.model, "--contexts", ",".join(map(str, args.contexts)),
           "--new", str(args.new), "--decode-contexts", ",".join(map(str, args.decode_contexts)),
           "--decode-tokens", str(args.decode_tokens), "--streams", str(args.streams)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-rev", default="86aa8b9")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--contexts", type=ints, default=[0, 1456, 3000])
    p.add_argument("--new", type=int, default=543)
    p.add_argument("--decode-contexts", type=ints, default=[1000, 3000])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument(
        "--streams", type=int, default=16, help="also decode this many sequences at once"
    )
    p.add_argument("--model", default=str(Path.home() / ".cache/tinyserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/long_context.json")
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    with this_tree_and(args.baseline_rev, "bench_long_") as (_, trees):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for rep in range(args.reps):
            names = list(trees) if rep % 2 == 0 else list(trees)[::-1]
            for name in names:
                r = run_tree(trees[name], args, seed=1000 * rep + 1)
                runs[name].append(r)
                print(
                    f"rep {rep} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()),
                    flush=True,
                )
    cells = {}
    for name, rs in runs.items():
        cells[name] = {k: [round(f(r[k] for r in rs), 2) for f in (min, statistics.median, max)]
                       for k in rs[0]}  # fmt: skip
    names = list(trees)
    ratio = {k: round(cells[names[1]][k][1] / cells[names[0]][k][1], 3) for k in cells[names[0]]}
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
              "args": {k: v for k, v in vars(args).items() if k != "child"},
              "units": "ms (prefill), ms a token (decode), ms a step (streams)",
              "cells": cells, "baseline_over_this": ratio, "runs": runs}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"cells": cells, "baseline_over_this": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Speculative decoding on vs off, served, side by side in one run (issue 14's targets).

Two ``tinyserve serve`` processes on the default model, one with ``--speculative-config``
``--spec`` and one with it ``off`` (the default is suffix decoding since d1720d7), run the
same workloads (bench_serving.py: ``grounded`` — a ~350-token passage of code to repeat,
edit or quote — and ``mixed``) at 1, 8 and 32 concurrent, one
server at a time, the order alternating each repetition (off/on, on/off, ...). Greedy, as
bench_serving sends. Each cell and repetition sends other requests (bench_serving's
``--seed`` is 1000 x the cell's index + the repetition), the same to both servers: before
2026-12-07 every repetition repeated the first one's requests, and the `on` server's suffix
cache drafted them from its earlier answers (a workload's first n requests also recur in a
later cell of the same seed). ``mixed`` draws from 120 prompts: some recur anyway. Per
cell: output tok/s (median over repetitions), the ratio on/off of the medians and the
median of each repetition's on/off (``paired_ratio``: the two runs are
back to back, so a host whose speed drifts between repetitions moves both), and from
/metrics the acceptance rate and output tokens per verified draft step.

python benchmarks/bench_spec.py [--reps 2] [--out benchmarks/results/spec_decode.json]
    [--spec '{"method": "ngram", ...}'] [--cells grounded:1,mixed:8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
from machine import machine_info  # noqa: E402

from tinyserve.testing.server import start_server, wait_idle  # noqa: E402

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
CELLS = [("grounded", 1, 6), ("grounded", 8, 16), ("grounded", 32, 32),
         ("mixed", 1, 6), ("mixed", 8, 16), ("mixed", 32, 32)]  # fmt: skip


def spec_counters(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tinyserve:spec_decode_num_") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            if "per_pos" not in name:
                out[name.split("{")[0].removeprefix("tinyserve:spec_decode_")] = float(value)
    return out


def one_run(base_url: str, workload: str, concurrency: int, n: int, seed: int) -> dict:
    ns = bench_serving.build_parser().parse_args(
        [
            "--base-url",
            base_url,
            "--workload",
            workload,
            "--concurrency",
            str(concurrency),
            "--num-requests",
            str(n),
            "--seed",
            str(seed),
            "--no-progress",
        ]  # fmt: skip
    )
    return asyncio.run(bench_serving.run_benchmark(ns))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/spec_decode.json")
    p.add_argument("--extra-args", default="", help="more `serve` flags for both servers")
    p.add_argument("--spec", default=SPEC, help="the `on` server's --speculative-config")
    p.add_argument("--cells", default=None,
                   help="a subset, e.g. 'grounded:1,mixed:8' (default: all six)")  # fmt: skip
    args = p.parse_args()
    cells = CELLS
    if args.cells:
        wanted = {tuple(c.split(":")) for c in args.cells.split(",")}
        cells = [c for c in CELLS if (c[0], str(c[1])) in wanted]
    common = ["--max-num-seqs", "32", *args.extra_args.split()]
    logs = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    servers = {
        # Off by name, all of it: suffix decoding is the default since d1720d7, grammar
        # fast-forward always was.
        "off": start_server(
            [*common, "--speculative-config", "off", "--no-grammar-fast-forward"], logs / "off.log"
        ),
        "on": start_server([*common, "--speculative-config", args.spec], logs / "on.log"),
    }
    results = []
    try:
        for i, (workload, conc, n) in enumerate(cells):
            cell = {"workload": workload, "concurrency": conc, "num_requests": n, "runs": []}
            for rep in range(args.reps):
                for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    url = servers[mode].base_url
                    wait_idle(url)
                    before = spec_counters(url)
                    s = one_run(url, workload, conc, n, seed=1000 * i + rep)
                    after = spec_counters(url)
                    delta = {k: after[k] - before.get(k, 0.0) for k in after}
                    cell["runs"].append({"mode": mode, "rep": rep, "output_tok_s": s["output_tok_s"],
                                         "tpot_median_s": s["tpot_s"]["median"],
                                         "ttft_median_s": s["ttft_s"]["median"],
                                         "completed": s["completed"], "spec": delta})  # fmt: skip
                    print(f"{workload} c={conc} {mode} rep {rep}: {s['output_tok_s']:.1f} tok/s "
                          f"{delta}", flush=True)  # fmt: skip
            results.append(summarize(cell))
    finally:
        for s in servers.values():
            s.stop()
    report = {"machine": machine_info(), "speculative_config": args.spec, "cells": results}
    Path(args.out).write_text(json.dumps(report, indent=2))
    for c in results:
        print(f"{c['workload']:>8} c={c['concurrency']:>2}: off {c['off_tok_s']:.1f}  on "
              f"{c['on_tok_s']:.1f}  ratio {c['ratio']:.2f} (paired {c['paired_ratio']:.2f})"
              f"  TPOT off/on {c['tpot_ratio']:.2f}"
              f"  acceptance {c['acceptance']}"
              f"  tokens/draft step {c['tokens_per_draft_step']}")  # fmt: skip
    return 0


def summarize(cell: dict) -> dict:
    runs = cell["runs"]
    med = {m: statistics.median(r["output_tok_s"] for r in runs if r["mode"] == m)
           for m in ("off", "on")}  # fmt: skip
    spec = [r["spec"] for r in runs if r["mode"] == "on"]
    drafts = sum(d.get("num_drafts_total", 0) for d in spec)
    proposed = sum(d.get("num_draft_tokens_total", 0) for d in spec)
    accepted = sum(d.get("num_accepted_tokens_total", 0) for d in spec)
    tpot = {m: statistics.median(r["tpot_median_s"] for r in runs if r["mode"] == m)
            for m in ("off", "on")}  # fmt: skip
    # Each repetition's on / off, the two runs back to back: steadier than the ratio of the
    # medians on a host whose speed drifts between repetitions.
    by_rep = {(r["rep"], r["mode"]): r["output_tok_s"] for r in runs}
    reps = sorted({r["rep"] for r in runs})
    paired = statistics.median(by_rep[(k, "on")] / by_rep[(k, "off")] for k in reps)
    cell.update(off_tok_s=med["off"], on_tok_s=med["on"], ratio=med["on"] / med["off"],
                paired_ratio=paired,
                tpot_ratio=tpot["off"] / tpot["on"] if tpot["on"] else None,
                acceptance=round(accepted / proposed, 3) if proposed else None,
                tokens_per_draft_step=round(1 + accepted / drafts, 2) if drafts else None,
                drafts=drafts)  # fmt: skip
    return cell


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""What a served model costs in memory and start-up: this tree against a git revision, side
by side, alternating, each start a fresh ``tinyserve serve`` process (warm: a first start of
each tree compiles its kernels and is not counted).

Per start: seconds to /health 200; the server's resident memory once healthy (VmRSS, its
anonymous part RssAnon, and VmHWM, the peak, which counts the checkpoint's mapped pages);
then one greedy chat completion of --tokens tokens (ignore_eos) for decode tokens/s, and
RssAnon after it. Extra ``serve`` flags after ``--``, e.g. a dense checkpoint:

python benchmarks/bench_load_memory.py [--baseline-rev eb4e5b4] [--reps 3]
    [--out benchmarks/results/load_memory.json] [-- --model DIR --quantization bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from trees import this_tree_and  # noqa: E402

from tinyserve.testing.server import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def status_mb(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and VmHWM of a process, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def tree_env(tree: Path) -> dict[str, str]:
    """The environment whose ``python -P`` imports tinyserve from ``tree`` (-P: no current
    folder first on sys.path, which would import this checkout's whatever PYTHONPATH says)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TINYSERVE_NO_PROGRESS": "1"}
    where = subprocess.run([sys.executable, "-P", "-c", "import tinyserve; print(tinyserve.__file__)"],
                           env=env, text=True, capture_output=True, check=True).stdout  # fmt: skip
    assert Path(where.strip()).is_relative_to(tree), (where, tree)
    return env


def one_start(tree: Path, serve_args: list[str], tokens: int, log: Path) -> dict[str, float]:
    t0 = time.monotonic()
    server = start_server(["--log-level", "warning", *serve_args], log, env=tree_env(tree),
                          command=[sys.executable, "-P", "-m", "tinyserve.entrypoints.cli"])  # fmt: skip
    healthy = time.monotonic() - t0
    try:
        mem = status_mb(server.pid)
        body = {"model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
                "messages": [{"role": "user", "content": f"Count to a hundred. ({t0})"}],
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
        t1 = time.monotonic()
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        took = time.monotonic() - t1
        after = status_mb(server.pid)
    finally:
        server.stop()
    done = r.json()["usage"]["completion_tokens"]
    return {"healthy_s": healthy, "rss_mb": mem["VmRSS"], "anon_mb": mem["RssAnon"],
            "hwm_mb": mem["VmHWM"], "decode_tok_s": done / took,
            "anon_after_mb": after["RssAnon"]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-rev", default="eb4e5b4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/load_memory.json")
    p.add_argument("serve_args", nargs="*", help="after --: extra `tinyserve serve` flags")
    args = p.parse_args()
    with this_tree_and(args.baseline_rev, "bench_mem_") as (work, trees):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for tree in trees.values():  # warm-up: each tree's kernels compiled once
            one_start(tree, args.serve_args, 8, work / "warm.log")
        for rep in range(args.reps):
            for name in list(trees) if rep % 2 == 0 else list(trees)[::-1]:
                r = one_start(trees[name], args.serve_args, args.tokens, work / "serve.log")
                runs[name].append(r)
                print(f"rep {rep} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()),
                      flush=True)  # fmt: skip
    cells = {name: {k: [round(f(r[k] for r in rs), 2) for f in (min, statistics.median, max)]
                    for k in rs[0]} for name, rs in runs.items()}  # fmt: skip
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine_info(), "args": vars(args), "runs": runs,
              "min_median_max": cells}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, c in cells.items():
        print(name, json.dumps(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())

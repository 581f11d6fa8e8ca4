#!/usr/bin/env python
"""Side-by-side serving benchmark: tinyserve vs peers (vLLM-CPU, llama.cpp) on the same weights.

Every server must already be running (vLLM: scripts/setup_vllm_peer.sh, scripts/run_vllm_peer.sh;
llama.cpp: scripts/build_llamacpp_peer.sh, scripts/run_llamacpp_peer.sh). Runs are
interleaved: for each repetition, each (workload, concurrency) cell runs on every server in
turn, the servers' order rotating from one repetition to the next (and reversed every other
one, so no server always follows the same peer), with --pause-s idle before each turn, so a
noisy neighbour hits all of them alike. Each cell draws one prompt salt (see bench_serving.py) and sends it
to every server, so they all get identical prompts that no earlier run has cached. Medians
over the repetitions, one entry per (server, workload, concurrency), go to one JSON
(default benchmarks/results/peers.json) together with the machine it ran on.

  python benchmarks/run_peers.py --server tinyserve=http://127.0.0.1:8321 \\
      --server vllm-cpu=http://127.0.0.1:8000 --server llama.cpp=http://127.0.0.1:8090 \\
      --plan mixed:1,8,32 shared_prefix:32 long_prompt:8 --repeats 3

Without --plan, every workload of --workload (comma-separated) runs at every --concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (  # noqa: E402
    WORKLOADS,
    BenchRequest,
    _one,
    build_parser,
    new_salt,
    run_benchmark,
)
from machine import machine_info  # noqa: E402

_MEDIAN_KEYS = ("output_tok_s", "total_tok_s", "request_throughput", "duration_s")
_DIST_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def _median_summary(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k in ("salt", "seed", "date", "errors"):
        out.pop(k, None)
    for k in _MEDIAN_KEYS:
        out[k] = statistics.median(r[k] for r in runs)
    for k in _DIST_KEYS:
        out[k] = {
            stat: statistics.median(r[k][stat] for r in runs if r[k][stat] is not None)
            if any(r[k][stat] is not None for r in runs)
            else None
            for stat in ("mean", "median", "p99")
        }
    for k in ("prompt_tokens", "output_tokens", "cached_prompt_tokens"):
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["failed"] = sum(r["failed"] for r in runs)
    out["completed"] = sum(r["completed"] for r in runs)
    out["errors"] = sorted({e for r in runs for e in r["errors"]})[:5]
    out["token_count_source"] = sorted({r["token_count_source"] for r in runs})
    out["repeats"] = len(runs)
    out["all_output_tok_s"] = [r["output_tok_s"] for r in runs]
    out["salts"] = [r["salt"] for r in runs]
    out["dates"] = [r["date"] for r in runs]
    return out


def parse_plan(plan: list[str] | None, workloads: str, concurrency: str) -> list[tuple[str, int]]:
    """[(workload, concurrency), ...] from --plan 'w:c1,c2 ...' or --workload x --concurrency."""
    cells: list[tuple[str, int]] = []
    if plan:
        items = []
        for spec in plan:
            w, sep, cs = spec.partition(":")
            if not sep or not cs:
                raise SystemExit(f"--plan entry {spec!r}: expected WORKLOAD:C1[,C2...]")
            items.append((w.strip(), cs))
    else:
        items = [(w.strip(), concurrency) for w in workloads.split(",") if w.strip()]
    for w, cs in items:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}: use {', '.join(WORKLOADS)}")
        for c in cs.split(","):
            cell = (w, int(c))
            if cell not in cells:
                cells.append(cell)
    return cells


def _server_info(url: str) -> dict:
    """What each server says about itself (model id, build); best effort, never fatal."""
    info: dict = {"base_url": url}
    with httpx.Client(base_url=url, timeout=10.0) as c:
        for path in ("/v1/models", "/version", "/props"):
            try:
                r = c.get(path)
                if r.status_code != 200:
                    continue
                d = r.json()
            except (httpx.HTTPError, ValueError):
                continue
            if path == "/v1/models" and d.get("data"):
                m = d["data"][0]
                info["model"] = m.get("id")
                info["owned_by"] = m.get("owned_by")
            elif path == "/version" and isinstance(d, dict):
                info["version"] = d.get("version", d)
            elif path == "/props" and isinstance(d, dict):
                for k in ("build_info", "total_slots", "model_path"):
                    if k in d:
                        info[k] = d[k]
                n_ctx = (d.get("default_generation_settings") or {}).get("n_ctx")
                if n_ctx:
                    info["n_ctx_per_slot"] = n_ctx
    if "build_info" in info:  # llama.cpp: which build scripts/run_llamacpp_peer.sh started
        port = httpx.URL(url).port
        peer = Path.home() / ".cache" / "tinyserve" / f"llamacpp_peer_{port}.json"
        if peer.exists():
            info["llamacpp_build"] = json.loads(peer.read_text())
    return info


async def _warmup(url: str, n: int, endpoint: str) -> None:
    """A few short requests so that one-off start-up costs land outside the measured runs."""
    bargs = build_parser().parse_args(["--base-url", url, "--endpoint", endpoint])
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for i in range(n):
            msg = f"Warm-up {new_salt()}: say hello."
            req = BenchRequest([{"role": "user", "content": msg}], msg, 8)
            res = await _one(client, bargs, model, req)
            if not res.ok:
                print(f"warm-up {i} against {url} failed: {res.error}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--server", action="append", required=True, help="label=base_url")
    ap.add_argument(
        "--plan",
        nargs="+",
        default=None,
        help="cells as WORKLOAD:C1[,C2...] ..., e.g. mixed:1,8,32 shared_prefix:32 long_prompt:8 "
        "(overrides --workload/--concurrency)",
    )
    ap.add_argument("--workload", default="mixed", help="comma-separated: " + ",".join(WORKLOADS))
    ap.add_argument("--concurrency", default="1,8,32", help="for every --workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="short requests per server first")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument(
        "--pause-s",
        type=float,
        default=5.0,
        help="idle seconds before each server's "
        "turn: a peer still polling its queue after its own turn must not tax the next",
    )
    ap.add_argument("--machine", default="", help="a free-form note stored with the machine info")
    ap.add_argument("--out", default="benchmarks/results/peers.json")
    args = ap.parse_args()
    servers = [tuple(s.split("=", 1)) for s in args.server]
    if any(len(s) != 2 for s in servers):
        raise SystemExit("--server takes label=base_url")
    cells = parse_plan(args.plan, args.workload, args.concurrency)
    print("cells: " + " ".join(f"{w}:{c}" for w, c in cells), flush=True)
    info = {label: _server_info(url) for label, url in servers}
    for _label, url in servers:
        if args.warmup:
            asyncio.run(_warmup(url, args.warmup, args.endpoint))
    raw: dict[tuple[str, str, int], list[dict]] = {}
    for rep in range(args.repeats):
        k = rep % len(servers)
        order = servers[k:] + servers[:k]  # rotate who goes first in each cell
        if rep % 2:  # and reverse, so that no server always follows the same one
            order = order[::-1]
        for i, (w, c) in enumerate(cells):
            salt = new_salt()  # one per cell: every server gets the same, fresh prompts
            for label, url in order:
                time.sleep(args.pause_s)
                n = max(args.min_requests, c * args.requests_per_client)
                bargs = build_parser().parse_args(
                    [
                        "--base-url", url,
                        "--workload", w,
                        "--endpoint", args.endpoint,
                        "--num-requests", str(n),
                        "--concurrency", str(c),
                        # A seed per cell and repetition: with one per repetition a
                        # workload's first n requests recurred in its next cell (mixed:1's
                        # six were mixed:32's first six), which a suffix cache drafts from.
                        "--seed", str(1000 * i + rep),
                        "--salt", salt,
                        "--label", label,
                        "--no-progress",
                    ]
                )  # fmt: skip
                s = asyncio.run(run_benchmark(bargs))
                s.pop("machine", None)  # recorded once, at the top
                raw.setdefault((label, w, c), []).append(s)
                print(
                    f"rep {rep} {w:>13} c={c:>2} {label:>10}: {s['output_tok_s']:.1f} out tok/s, "
                    f"median TTFT {1000 * (s['ttft_s']['median'] or 0):.0f} ms, "
                    f"median TPOT {1000 * (s['tpot_s']['median'] or 0):.1f} ms, failed {s['failed']}"
                    + (f" ({s['errors'][0]})" if s["errors"] else ""),
                    flush=True,
                )
    runs = [_median_summary(v) for v in raw.values()]
    machine = machine_info()
    if args.machine:
        machine["note"] = args.machine
    workloads = list(dict.fromkeys(w for w, _ in cells))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine,
        "workload": ",".join(workloads),
        "workloads": workloads,
        "plan": [f"{w}:{c}" for w, c in cells],
        "repeats": args.repeats,
        "requests_per_client": args.requests_per_client,
        "min_requests": args.min_requests,
        "servers": info,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}; machine: {machine['summary']}")
    print(
        "workload | label | concurrency | output tok/s (median) | median TTFT ms | median TPOT ms | failed"
    )
    for r in sorted(
        runs, key=lambda r: (workloads.index(r["workload"]), r["concurrency"], r["label"])
    ):
        print(
            f"{r['workload']} | {r['label']} | {r['concurrency']} | {r['output_tok_s']:.1f} | "
            f"{1000 * (r['ttft_s']['median'] or 0):.0f} | {1000 * (r['tpot_s']['median'] or 0):.1f} | "
            f"{r['failed']}"
        )
    failed = sum(r["failed"] for r in runs)
    if failed:
        print(f"WARNING: {failed} failed requests in all (see 'errors' in {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

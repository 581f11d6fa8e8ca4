#!/usr/bin/env python
"""Side-by-side serving benchmark: tinyserve vs peers (vLLM-CPU) on the same weights.

Both servers must already be running (see scripts/setup_vllm_peer.sh and
scripts/run_vllm_peer.sh). Runs are interleaved — for each repetition and each concurrency,
every server in turn — so a noisy neighbour hits both alike. Medians over the repetitions
go to benchmarks/results/peers.json.

  python benchmarks/run_peers.py --server tinyserve=http://127.0.0.1:8321 \
      --server vllm-cpu=http://127.0.0.1:8000 --concurrency 1,8,32 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import build_parser, run_benchmark  # noqa: E402

_MEDIAN_KEYS = ("output_tok_s", "total_tok_s", "request_throughput", "duration_s")
_DIST_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def _median_summary(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k in _MEDIAN_KEYS:
        out[k] = statistics.median(r[k] for r in runs)
    for k in _DIST_KEYS:
        out[k] = {
            stat: statistics.median(r[k][stat] for r in runs if r[k][stat] is not None)
            if any(r[k][stat] is not None for r in runs)
            else None
            for stat in ("mean", "median", "p99")
        }
    out["failed"] = sum(r["failed"] for r in runs)
    out["repeats"] = len(runs)
    out["all_output_tok_s"] = [r["output_tok_s"] for r in runs]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--server", action="append", required=True, help="label=base_url")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--machine", default="")
    ap.add_argument("--out", default="benchmarks/results/peers.json")
    args = ap.parse_args()
    servers = [s.split("=", 1) for s in args.server]
    concs = [int(c) for c in args.concurrency.split(",")]
    raw: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):
        for c in concs:
            for label, url in servers:
                n = max(args.min_requests, c * args.requests_per_client)
                bargs = build_parser().parse_args(
                    [
                        "--base-url",
                        url,
                        "--workload",
                        args.workload,
                        "--num-requests",
                        str(n),
                        "--concurrency",
                        str(c),
                        "--seed",
                        str(rep),
                        "--label",
                        label,
                        "--no-progress",
                    ]
                )
                s = asyncio.run(run_benchmark(bargs))
                raw.setdefault((label, c), []).append(s)
                print(
                    f"rep {rep} c={c:>2} {label:>10}: {s['output_tok_s']:.1f} out tok/s, "
                    f"median TTFT {1000 * (s['ttft_s']['median'] or 0):.0f} ms, "
                    f"median TPOT {1000 * (s['tpot_s']['median'] or 0):.1f} ms, failed {s['failed']}",
                    flush=True,
                )
    runs = [_median_summary(v) for v in raw.values()]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workload": args.workload,
        "machine": args.machine,
        "repeats": args.repeats,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\nlabel | concurrency | output tok/s (median) | median TTFT ms | median TPOT ms")
    for r in sorted(runs, key=lambda r: (r["concurrency"], r["label"])):
        print(
            f"{r['label']} | {r['concurrency']} | {r['output_tok_s']:.1f} | "
            f"{1000 * (r['ttft_s']['median'] or 0):.0f} | {1000 * (r['tpot_s']['median'] or 0):.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

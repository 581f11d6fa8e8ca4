#!/usr/bin/env python
"""Soak and overload tests against a real tinyserve server, with figures.

The drivers live in tinyserve/testing/soak.py (what is sent and checked) and
soak_report.py (the figures); tests/reliability/ runs smaller versions of the same functions.

``python benchmarks/soak.py`` starts its own ``tinyserve serve`` (the default model) for each
part, prints the figures and writes ``benchmarks/results/soak.json``. ``--base-url`` points
the soak at a running server instead (RSS is then measured only with ``--server-pid``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.server import start_server  # noqa: E402
from tinyserve.testing.soak import (  # noqa: E402
    SoakConfig,
    overload_failures,
    run_overload,
    run_soak,
    soak_failures,
)

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="soak a running server instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --base-url: measure this process's RSS")
    p.add_argument("--model", help="model for the servers this script starts (default model)")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-frac", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overload-clients", type=int, default=64)
    p.add_argument("--skip-overload", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = p.parse_args(argv)

    cfg = SoakConfig(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        disconnect_frac=args.disconnect_frac,
        seed=args.seed,
    )
    model = ["--model", args.model] if args.model else []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    logs = Path(args.out).parent
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info()}  # fmt: skip

    if args.base_url:
        soak = run_soak(args.base_url, cfg, args.server_pid, progress=True)
    else:
        seqs = str(max(64, cfg.concurrency * 2))
        server = start_server(
            [*model, "--max-num-seqs", seqs, "--kv-cache-memory", "512MiB"],
            logs / "soak_server.log",
        )
        try:
            soak = run_soak(server.base_url, cfg, server.pid, progress=True)
        finally:
            soak["server_exit_code"] = server.stop()
    soak["failures"] = soak_failures(soak)
    result["soak"] = soak

    if not args.skip_overload and not args.base_url:
        server = start_server(
            [*model, "--max-num-seqs", "8", "--max-queued-requests", "8"],
            logs / "overload_server.log",
        )
        try:
            over = run_overload(server.base_url, args.overload_clients)
        finally:
            over["server_exit_code"] = server.stop()
        over["failures"] = overload_failures(over, max_admitted=16)
        result["overload"] = over

    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    failed = [f for part in ("soak", "overload") for f in result.get(part, {}).get("failures", [])]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Fuzz the HTTP API: schemathesis against the server's own OpenAPI document, plus a
hand-written list of hostile requests. Nothing may answer 5xx, every 4xx must carry the
OpenAI error shape, and the server must stay healthy and idle afterwards.

The server under test runs the real engine (scheduler, paged KV cache, sampler, detokenizer,
stop strings) over a tiny random Llama that uses SmolLM2's tokenizer and chat template, so
that the thousands of requests the fuzzer makes valid finish in milliseconds each. Only the
weights differ from the default model's server.

The drivers live in tinyserve/testing/fuzz.py (fuzz_cases.py: the hostile requests;
fuzz_report.py: the figures); tests/reliability/test_fuzz.py runs the same functions smaller.

``python benchmarks/fuzz.py`` builds that model (once, in the cache folder), starts
``tinyserve serve`` on it, runs both parts, prints the figures and writes
``benchmarks/results/fuzz.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.fuzz import (  # noqa: E402
    fuzz_failures,
    fuzz_model_dir,
    run_hostile,
    run_schemathesis,
    server_args,
)
from tinyserve.testing.fuzz_report import fuzz_result  # noqa: E402
from tinyserve.testing.server import start_server, wait_idle  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=300, help="per operation and mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "fuzz.json"))
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    server = start_server(server_args(fuzz_model_dir()), Path(args.out).parent / "fuzz_server.log")
    try:
        hostile = run_hostile(server.base_url)
        hostile["failures"] = fuzz_failures(hostile)
        st = run_schemathesis(server.base_url, args.max_examples, args.seed)
        st["failures"] = fuzz_failures(st)
        idle = wait_idle(server.base_url)
    finally:
        code = server.stop()
    result = fuzz_result(hostile, st, idle, code, server.log(), machine_info())
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if hostile["failures"] or st["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

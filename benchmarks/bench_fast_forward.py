#!/usr/bin/env python
"""Grammar fast-forward (issue 40 deliver 2) on and off, side by side in one process.

The engine on the default model (default flags, no --speculative-config), greedy, JSON
answers to the 12 function-call schemas of benchmarks/schema_sample.py (closed objects, as
the server sends them) plus a record schema with enums and nested keys (15 requests, or
2 x the concurrency, cycling); ``max_tokens`` 128; 1 and 32 requests in flight. Each repetition runs both settings, in alternating order, on a
fresh engine each: output tok/s (answers' tokens over the wall time), the steps taken, the
drafted and accepted forced tokens, and whether every answer's tokens were the same with it
off (they must be). "Off" is the same engine with the proposer's forced-token source
emptied.

python benchmarks/bench_fast_forward.py [--reps 3] [--out benchmarks/results/fast_forward.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from schema_sample import FUNCTION_CALLS  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.llm_engine import LLMEngine  # noqa: E402
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from tinyserve.structured.strict import closed_objects  # noqa: E402

RECORD = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country_code": {"enum": ["FR", "DE", "JP", "US", "BR", "IN"]},
    "climate": {"enum": ["temperate_oceanic", "humid_subtropical", "semi_arid_steppe"]},
    "population": {"type": "integer", "minimum": 0},
    "landmarks": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "category": {"enum": ["museum", "monument", "park_or_garden"]}},
        "required": ["name", "category"]}}},
    "required": ["city", "country_code", "climate", "population", "landmarks"]}  # fmt: skip


def cases() -> list[tuple[str, dict]]:
    out = [(f"Call {name} for a typical request.", closed_objects(s))
           for name, s in FUNCTION_CALLS.items()]  # fmt: skip
    out += [(f"Describe {c} as JSON.", closed_objects(RECORD)) for c in ("Paris", "Osaka", "Lima")]
    return out


def run(engine: LLMEngine, concurrency: int, max_tokens: int, fast_forward: bool) -> dict:
    proposer = engine.core.proposer
    if not fast_forward:
        proposer._forced = lambda request, budget: []
    tok = engine.tokenizer
    base = cases()
    work = [base[i % len(base)] for i in range(max(len(base), 2 * concurrency))]
    pending, live, tokens, done = list(range(len(work))), set(), {}, 0
    steps0, drafted0 = engine.core.num_steps, proposer.stats.num_draft_tokens
    accepted0 = proposer.stats.num_accepted_tokens
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.pop(0)
            text = tok.apply_chat_template([{"role": "user", "content": work[i][0]}],
                                           add_generation_prompt=True, tokenize=False)  # fmt: skip
            prompt = tok.encode(text, add_special_tokens=False)
            so = StructuredOutputsParams(json=work[i][1])
            engine.add_request(str(i), list(prompt), SamplingParams(
                temperature=0.0, max_tokens=max_tokens, structured_outputs=so))  # fmt: skip
            live.add(str(i))
            tokens[str(i)] = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                live.discard(out.request_id)
                done += 1
    seconds = time.perf_counter() - t0
    n = sum(map(len, tokens.values()))
    return {"tok_s": n / seconds, "tokens": n, "seconds": seconds,
            "steps": engine.core.num_steps - steps0,
            "drafted": proposer.stats.num_draft_tokens - drafted0,
            "accepted": proposer.stats.num_accepted_tokens - accepted0,
            "outputs": {k: v for k, v in sorted(tokens.items())}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--out", default="benchmarks/results/fast_forward.json")
    args = ap.parse_args()
    cells = {}
    for c in map(int, args.concurrency.split(",")):
        for rep in range(args.reps):
            order = (True, False) if rep % 2 == 0 else (False, True)
            outs = {}
            for ff in order:
                # Speculation off: the forced tokens the only drafts.
                engine = LLMEngine(EngineArgs(kv_cache_memory="512MiB", speculative_config=None))
                r = run(engine, c, args.max_tokens, ff)
                outs[ff] = r.pop("outputs")
                cells.setdefault(f"{c}:{'on' if ff else 'off'}", []).append(r)
                print(c, "on" if ff else "off", json.dumps(r), flush=True)
                del engine
            cells.setdefault(f"{c}:same", []).append(outs[True] == outs[False])
    summary = {}
    for key, runs in cells.items():
        if key.endswith(":same"):
            summary[key] = all(runs)
            continue
        rates = sorted(r["tok_s"] for r in runs)
        summary[key] = {"tok_s_min_med_max": [round(rates[0], 1),
                        round(statistics.median(rates), 1), round(rates[-1], 1)],
                        "steps": runs[0]["steps"], "drafted": runs[0]["drafted"],
                        "accepted": runs[0]["accepted"], "tokens": runs[0]["tokens"]}  # fmt: skip
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "summary": summary,
                                          "runs": cells}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Constrained decoding's cost on the engine (SmolLM2, no HTTP): the same chat prompts with a
JSON schema and unconstrained, at 1 and 32 requests in flight, side by side in one run.

throughput   output tok/s with the schema / without (ignore_eos, same max_tokens; the
             constrained requests stop when their JSON is complete, so tok/s, not time)
ttft         add_request -> first token of the first request of a schema never seen (its
             grammar compiles on the pool) vs the same schema again (a cache hit), for a
             typical schema and one of 50 properties
mask         time filling the step's bitmask rows (StructuredOutputManager.fill_bitmask) per
             step at 32 constrained rows, and its share of the step

python benchmarks/bench_structured.py [--reps 3] [--max-tokens 64] [--out benchmarks/results/structured.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.llm_engine import LLMEngine  # noqa: E402
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

TOPICS = ["a city", "a book", "a planet", "a recipe", "a river", "a painter", "a car", "a tree"]
SCHEMA = {  # a typical API schema: a list of records, long enough to fill max_tokens
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "kind": {"enum": ["small", "medium", "large"]},
                    "score": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["name", "kind", "score"],
            },
        }
    },
    "required": ["items"],
}


def big_schema(salt: str) -> dict:
    """50 properties (strings, numbers, enums, a nested $ref), new each call via the salt."""
    props = {f"p{i}_{salt}": [{"type": "string"}, {"type": "integer"}, {"enum": ["x", "y"]},
             {"$ref": "#/$defs/pt"}][i % 4] for i in range(50)}  # fmt: skip
    return {"type": "object", "properties": props, "required": list(props)[:5],
            "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}}}}  # fmt: skip


def prompts(engine: LLMEngine, n: int, salt: str) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(n):
        msg = f"[{salt}-{i}] List eight facts about {TOPICS[i % len(TOPICS)]} as JSON."
        out.append(tok.apply_chat_template([{"role": "user", "content": msg}],
                                           add_generation_prompt=True, tokenize=True))  # fmt: skip
    return [p if isinstance(p, list) else p["input_ids"] for p in out]


def run(engine: LLMEngine, ps: list[list[int]], so, max_tokens: int) -> dict:
    """All requests added at once, stepped to the end: output tok/s, per-step mask time."""
    mask_times: list[float] = []
    manager = engine.structured
    fill = manager.fill_bitmask

    def timed_fill(sched):
        t = time.perf_counter()
        fill(sched)
        if sched.grammar_rows:
            mask_times.append(time.perf_counter() - t)

    manager.fill_bitmask = timed_fill
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=so)  # fmt: skip
    t0 = time.perf_counter()
    for p in ps:
        engine.add_request(uuid.uuid4().hex, p, params)
    tokens = steps = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    manager.fill_bitmask = fill
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": steps,
            "mask_ms_median": 1000 * statistics.median(mask_times) if mask_times else None}  # fmt: skip


def ttft(engine: LLMEngine, p: list[int], so) -> float:
    t0 = time.perf_counter()
    engine.add_request(uuid.uuid4().hex, p, SamplingParams(temperature=0, max_tokens=1,
                                                           structured_outputs=so))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/structured.json")
    args = ap.parse_args()
    # Speculation off: the grammar's cost, not the drafts' gain.
    engine = LLMEngine(
        EngineArgs(kv_cache_memory="512MiB", max_num_seqs=64, speculative_config=None)
    )
    so = StructuredOutputsParams(json=SCHEMA)
    engine.warm_up()  # as the server does at start: the grammar backend builds meanwhile
    run(engine, prompts(engine, 4, "warm-up"), so, 8)  # compile + first steps, not timed
    rows = []
    for conc in (1, 32):
        for rep in range(args.reps):  # interleaved: constrained, unconstrained, constrained, ...
            for name, spec in (("json_schema", so), ("unconstrained", None)):
                r = run(engine, prompts(engine, conc, f"{rep}{name}"), spec, args.max_tokens)
                rows.append({"concurrency": conc, "rep": rep, "mode": name, **r})
                print(f"c={conc:2d} rep {rep} {name:13s}: {r['tok_s']:6.1f} tok/s "
                      f"({r['tokens']} tokens), mask {r['mask_ms_median']}")  # fmt: skip
    summary = {}
    for conc in (1, 32):
        med = {m: statistics.median(r["tok_s"] for r in rows
                                    if r["concurrency"] == conc and r["mode"] == m)
               for m in ("json_schema", "unconstrained")}  # fmt: skip
        summary[f"c{conc}"] = {**med, "ratio": med["json_schema"] / med["unconstrained"]}
    masks = [r["mask_ms_median"] for r in rows if r["concurrency"] == 32 and r["mask_ms_median"]]
    summary["mask_ms_per_step_at_32"] = statistics.median(masks)
    p = prompts(engine, 1, "ttft")[0]
    ttfts = {}
    for label, make in (
        ("typical", lambda s: {**SCHEMA, "title": s}),
        ("50_properties", big_schema),
    ):
        new, cached = [], []
        for rep in range(args.reps):
            spec = StructuredOutputsParams(json=make(f"s{rep}{uuid.uuid4().hex[:6]}"))
            new.append(ttft(engine, p, spec))
            cached.append(ttft(engine, p, spec))
        ttfts[label] = {"new_ms": 1000 * statistics.median(new),
                        "cached_ms": 1000 * statistics.median(cached)}  # fmt: skip
        ttfts[label]["added_ms"] = ttfts[label]["new_ms"] - ttfts[label]["cached_ms"]
    summary["ttft"] = ttfts
    print(json.dumps(summary, indent=1))
    result = {"machine": machine_info(), "args": vars(args), "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

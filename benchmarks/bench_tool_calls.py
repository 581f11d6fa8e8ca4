#!/usr/bin/env python
"""Forced tool calls on the default model (issue 39 item 6): how many finish within the token
budget, and how long they are.

100 varied prompts (10 questions x 10 cities) ask about the weather; each request forces a
call (``tool_choice: "required"``) of a plain two-property tool as clients write it (no
``additionalProperties``), ``max_tokens`` 200, temperature 0.7 with a seed per prompt, 8 at a
time against an in-process server on the default model and default flags. Reported: calls
that finished (``finish_reason`` not ``length``), answers whose calls came back in
``tool_calls``, completion tokens (mean, max). Run it from another tree with
``PYTHONPATH=<tree>`` for a before / after.

python benchmarks/bench_tool_calls.py [--out benchmarks/results/tool_calls.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}  # fmt: skip
CITIES = ["Paris", "Tokyo", "New York", "Berlin", "Lagos", "Sydney", "Lima", "Cairo", "Oslo",
          "Delhi"]  # fmt: skip
ASKS = ["What's the weather in {}?", "Is it raining in {} right now?",
        "How hot is it in {} today?", "Tell me the temperature in {} in fahrenheit.",
        "Should I bring an umbrella in {}?", "Weather report for {}, please.",
        "What is the forecast like in {}?", "Is it cold in {}?",
        "Give me the current conditions in {} in celsius.", "How windy is {}?"]  # fmt: skip


def run(base_url: str, max_tokens: int) -> list[dict]:
    prompts = [a.format(c) for a in ASKS for c in CITIES]

    def one(i: int) -> dict:
        body = {"model": "SmolLM2-135M-Instruct", "tools": [TOOL], "tool_choice": "required",
                "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": max_tokens,
                "temperature": 0.7, "seed": i}  # fmt: skip
        r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=600).json()
        c = r["choices"][0]
        return {"prompt": prompts[i], "finish_reason": c["finish_reason"],
                "tool_calls": c["message"].get("tool_calls"),
                "content": c["message"].get("content"),
                "completion_tokens": r["usage"]["completion_tokens"]}  # fmt: skip

    with ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, range(len(prompts))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/tool_calls.json")
    args = ap.parse_args()

    from tinyserve.config import ServerConfig
    from tinyserve.engine.arg_utils import EngineArgs
    from tinyserve.engine.async_engine import AsyncEngine
    from tinyserve.engine.llm_engine import LLMEngine
    from tinyserve.testing.server import serve

    engine = LLMEngine(EngineArgs(kv_cache_memory="256MiB"))
    with serve(AsyncEngine(engine), ServerConfig()) as s:
        results = run(s.base_url, args.max_tokens)
    tokens = [r["completion_tokens"] for r in results]
    summary = {
        "requests": len(results),
        "finished": sum(r["finish_reason"] != "length" for r in results),
        "in_tool_calls": sum(bool(r["tool_calls"]) for r in results),
        "completion_tokens": {"mean": statistics.mean(tokens), "max": max(tokens)},
    }
    out = {"machine": machine_info(), "max_tokens": args.max_tokens, "summary": summary,
           "results": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

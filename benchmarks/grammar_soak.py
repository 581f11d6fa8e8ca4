#!/usr/bin/env python
"""Hostile structured-output soak (issue 37): an hour of what took the server down.

A real ``tinyserve serve`` (the default model) gets, from ``--clients`` concurrent clients
for ``--minutes``, a seeded random mix of: deep and recursive schemas, ``$ref`` and Lark
rule chains up to the size limit and past it, huge alternations and choice lists, GBNF
nested past its converter's depth, ReDoS and deeply grouped regexes, hostile tool
parameters, hundreds of distinct random schemas (the compile cache churns), streams that
hang up mid-answer, and a plain JSON request as a control. Every 10 s the server's RSS,
thread count and child processes (the grammar sandbox) are sampled.

Held when: the server never dies, no 5xx, no transport error other than the hang-ups we
make, every control answered with valid JSON, RSS at the end within 10% of the first
sample after warm-up (a tenth of the run). Writes ``benchmarks/results/grammar_soak.json``.
Run once per change to the grammar layer (structured/, utils/grammar_size.py,
utils/regex_size.py): ``python benchmarks/grammar_soak.py --minutes 60``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.schemas import random_schema, ref_chain, rule_chain  # noqa: E402
from tinyserve.testing.server import start_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CHAT = "/v1/chat/completions"


def deep_object(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["v", "kids"]}}, "$ref": "#/$defs/node"}  # fmt: skip
REDOS = ["^(?:a{1000}){1000}$", "(a|aa)+{500}", "(?:(?:x{100}){100}){10}", "(.*){1,1000}[b]{900}"]


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}  # fmt: skip


def hostile(rng: random.Random, i: int) -> tuple[str, dict]:
    """One request: (its kind, the body's constraint fields)."""
    kind = rng.choice(["random_schema", "random_schema", "deep", "ref_chain", "tree", "lark_chain",
                       "alternation", "choice", "gbnf", "regex_redos", "regex_groups",
                       "regex_wide", "tools", "too_big"])  # fmt: skip
    if kind == "random_schema":  # distinct every time: the cache (256 specs) churns
        schema = random_schema(rng, depth=rng.randint(1, 5))
        return kind, schema_format({**schema, "title": f"s{i}-{rng.random()}"})
    if kind == "deep":
        return kind, schema_format(deep_object(rng.choice([10, 30, 49, 60])))
    if kind == "ref_chain":
        return kind, schema_format(ref_chain(rng.choice([50, 500, 1000, 2000, 3000])))
    if kind == "tree":
        return kind, schema_format(TREE)
    if kind == "lark_chain":
        return kind, {"structured_outputs": {"grammar": rule_chain(rng.choice([300, 3000, 8000, 12000, 20000]))}}  # fmt: skip
    if kind == "alternation":
        words = [f"w{rng.randrange(10**9)}" for _ in range(rng.choice([100, 2000, 8000]))]
        return kind, {"structured_outputs": {"grammar": "start: " + " | ".join(json.dumps(w) for w in words)}}  # fmt: skip
    if kind == "choice":
        return kind, {"structured_outputs": {"choice": [f"c{rng.randrange(10**9)}" for _ in range(2000)]}}  # fmt: skip
    if kind == "gbnf":
        d = rng.choice([50, 400, 2000])
        return kind, {"structured_outputs": {"grammar": "root ::= " + "(" * d + '"a"' + ")" * d}}
    if kind == "regex_redos":
        return kind, {"structured_outputs": {"regex": rng.choice(REDOS)}}
    if kind == "regex_groups":
        d = rng.choice([100, 300, 3000])
        return kind, {"structured_outputs": {"regex": "(" * d + "a" + ")" * d}}
    if kind == "regex_wide":
        return kind, {"structured_outputs": {"regex": f"[a-z]{{1,{rng.choice([100, 5000, 19000])}}}"}}
    if kind == "tools":
        params = rng.choice([deep_object(40), ref_chain(500), TREE, {"type": "object", "properties": {"q": {"type": "string", "pattern": REDOS[0]}}}])  # fmt: skip
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        return kind, {"tools": [tool], "tool_choice": "required"}
    return kind, {"structured_outputs": {"grammar": 'start: "a"' + ' | "b"' * 60_000}}


CONTROL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}  # fmt: skip


def _control_ok(r: httpx.Response) -> bool:
    """A control answer is valid JSON with a boolean "ok" when it stopped by itself; one cut
    by max_tokens (``length``) is counted apart, not as bad."""
    if r.status_code != 200:
        return False
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return True
    try:
        return isinstance(json.loads(choice["message"]["content"]).get("ok"), bool)
    except ValueError:
        return False


async def one(c: httpx.AsyncClient, rng: random.Random, i: int, stats: dict) -> None:
    control = i % 10 == 0
    kind, extra = ("control", schema_format(CONTROL)) if control else hostile(rng, i)
    body = {"messages": [{"role": "user", "content": f"Reply. #{i}"}],
            "max_tokens": 64 if control else rng.choice([1, 8, 48]),
            "temperature": rng.choice([0, 1.0]), **extra}  # fmt: skip
    stream = not control and rng.random() < 0.4
    hang_up = stream and rng.random() < 0.5
    try:
        if stream:
            async with c.stream("POST", CHAT, json={**body, "stream": True}) as r:
                stats["status"][f"{kind} {r.status_code}"] += 1
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if hang_up and n >= 3:
                        stats["hang_ups"] += 1
                        break
        else:
            r = await c.post(CHAT, json=body)
            stats["status"][f"{kind} {r.status_code}"] += 1
            if control:
                stats["controls_bad"] += 0 if _control_ok(r) else 1
        if r.status_code >= 500:
            stats["errors_5xx"].append(f"{kind}: {r.status_code}")
    except (httpx.HTTPError, ValueError, KeyError) as e:
        stats["transport_errors"].append(f"{kind}: {type(e).__name__}: {e}"[:300])


async def drive(base_url: str, pid: int, args) -> dict:
    rng = random.Random(args.seed)
    stats: dict = {"status": Counter(), "hang_ups": 0, "controls_bad": 0, "errors_5xx": [],
                   "transport_errors": [], "samples": []}  # fmt: skip
    proc = psutil.Process(pid)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    counter = iter(range(10**9))

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as c:
            while time.monotonic() < end and proc.is_running():
                await one(c, rng, next(counter), stats)

    async def sampler() -> None:
        while time.monotonic() < end:
            try:
                kids = proc.children()
                stats["samples"].append({"t_s": round(time.monotonic() - t0, 1),
                    "rss_mib": round(proc.memory_info().rss / 2**20, 1), "threads": proc.num_threads(),
                    "children": len(kids), "children_rss_mib": round(sum(k.memory_info().rss for k in kids) / 2**20, 1),
                    "requests": sum(stats["status"].values())})  # fmt: skip
            except psutil.Error:
                stats["samples"].append({"t_s": round(time.monotonic() - t0, 1), "dead": True})
                return
            await asyncio.sleep(10)

    await asyncio.gather(sampler(), *(client_loop() for _ in range(args.clients)))
    stats["alive"] = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        stats["health_after"] = (await c.get("/health")).status_code if stats["alive"] else None
    return stats


def verdict(stats: dict, minutes: float) -> dict:
    live = [s for s in stats["samples"] if "rss_mib" in s]
    warm = next((s for s in live if s["t_s"] >= minutes * 6), live[0])  # a tenth of the run
    growth = live[-1]["rss_mib"] / warm["rss_mib"] - 1
    checks = {
        "server alive, /health 200 after": stats["alive"] and stats["health_after"] == 200,
        "no 5xx": not stats["errors_5xx"],
        "no transport errors": not stats["transport_errors"],
        "every control valid JSON": stats["controls_bad"] == 0,
        "RSS end within 10% of after warm-up": growth <= 0.10,
    }
    return {"rss_warm_mib": warm["rss_mib"], "rss_end_mib": live[-1]["rss_mib"],
            "rss_growth": round(growth, 4), "threads_min_max": [min(s["threads"] for s in live), max(s["threads"] for s in live)],
            "checks": checks, "held": all(checks.values())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "grammar_soak.json"))
    args = p.parse_args(argv)
    log = Path(args.out).with_suffix(".server.log")
    server = start_server(["--max-num-seqs", "16"], log)
    try:
        stats = asyncio.run(drive(server.base_url, server.proc.pid, args))
    finally:
        server.stop()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
              "minutes": args.minutes, "clients": args.clients, "seed": args.seed,
              **verdict(stats, args.minutes), "status": dict(sorted(stats["status"].items())),
              "hang_ups": stats["hang_ups"], "errors_5xx": stats["errors_5xx"][:50],
              "transport_errors": stats["transport_errors"][:50], "samples": stats["samples"]}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "machine")}, indent=1))
    return 0 if result["held"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""An agent loop, served (issue 40 deliver 5): suffix decoding on vs off, side by side.

Two ``tinyserve serve`` processes on the default model (default flags, ``--max-num-seqs
32``), one with ``--speculative-config`` ``--spec`` (``{"method": "suffix"}``; ``auto``
is the server's default since d1720d7) and one with it ``off``. Each agent session is a
multi-turn chat with tools (read_file, run_tests, edit_file): the client sends the
conversation, appends the model's reply (its tool calls, or its text), then a scripted tool
result — the session's source file, a test failure naming its functions — and asks again,
for ``--turns`` turns. Sessions work on files built from one template with different names
and numbers, so their answers repeat each other's and the tool results (file contents, call
skeletons), as an agent's do. Greedy, ``max_tokens`` 96 a turn. ``--concurrency`` sessions
run at once (1 and 32); every repetition runs new sessions (other names and numbers: no
answer is a replay of an earlier repetition's) on each server in turn, the order rotating
each repetition (off/on, on/off, ...; with ``--ngram`` a third server with the ngram
method), so all see the same host load.

Per cell and server: output tokens per second over the cell's wall time (min / median / max
over the repetitions), against off the ratio of the medians and each repetition's ratio,
the drafted / accepted tokens, and whether every answer was identical (call ids, random,
are numbered per turn instead, so every server sees the same prompts).

python benchmarks/bench_agent_loop.py [--reps 3] [--sessions 4] [--turns 4]
    [--concurrency 1,32] [--ngram] [--out benchmarks/results/agent_loop.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import spec_counters  # noqa: E402
from machine import machine_info  # noqa: E402

from tinyserve.testing.server import start_server, wait_idle  # noqa: E402

SUFFIX = '{"method": "suffix"}'
NGRAM = '{"method": "ngram"}'
MAX_TOKENS = 96


def _tool(name: str, description: str, **params: str) -> dict:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props)}}}  # fmt: skip


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="The file's path"),
    _tool("run_tests", "Run the tests of one file.", path="The test file's path"),
    _tool(
        "edit_file",
        "Replace text in a file.",
        path="The file's path",
        old="The exact text to replace",
        new="The new text",
    ),  # fmt: skip
]
SYSTEM = ("You are a coding agent. Use the tools to inspect and fix the repository. "
          "Call one tool at a time.")  # fmt: skip

SOURCE = '''def {f}_total(items):
    """Sum the prices of the items, each a dict with "price" and "qty"."""
    total = 0
    for item in items:
        total += item["price"] * item["qty"]
    return total


def {f}_discount(total, rate={rate}):
    """Apply a discount of rate percent to total."""
    return total - total * rate / 10


def {f}_report(items):
    total = {f}_total(items)
    return f"{{len(items)}} items, total {{total}}, after discount {{{f}_discount(total)}}"
'''
FAILURE = """FAILED test_{f}.py::test_{f}_discount - assert {got} == {want}
 +  where {got} = {f}_discount({total})
{f}.py:11: in {f}_discount
    return total - total * rate / 10
1 failed, 2 passed in 0.03s"""


def session(rng: random.Random) -> dict:
    """One session's names and numbers, and its scripted tool results in order."""
    f = rng.choice(["cart", "order", "basket", "invoice", "ledger", "till"]) + str(
        rng.randrange(100)
    )
    rate, total = rng.choice([5, 10, 15, 20]), rng.choice([100, 200, 400])
    path = f"shop/{f}.py"
    src = SOURCE.format(f=f, rate=rate)
    fail = FAILURE.format(
        f=f, total=total, got=total - total * rate / 10, want=total - total * rate / 100
    )
    results = [src, fail, src.replace("rate / 10\n", "rate / 100\n"), "3 passed in 0.02s"]
    task = (f"The test test_{f}_discount in tests/test_{f}.py fails. The code is in {path}. "
            "Find the bug and fix it.")  # fmt: skip
    return {"task": task, "results": results}


def run_session(base_url: str, s: dict, turns: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": s["task"]}]
    tokens, answers, seconds = 0, [], 0.0
    with httpx.Client(base_url=base_url, timeout=600) as c:
        for turn in range(turns):
            body = {"messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS,
                    "temperature": 0}  # fmt: skip
            t = time.perf_counter()
            r = c.post("/v1/chat/completions", json=body)
            seconds += time.perf_counter() - t
            if r.status_code != 200:
                raise RuntimeError(f"{base_url} turn {turn}: {r.status_code} {r.text}")
            data = r.json()
            msg = data["choices"][0]["message"]
            tokens += data["usage"]["completion_tokens"]
            # Call ids are random: numbered instead, so that both servers see the same prompts.
            calls = [
                {**call, "id": f"call_{turn}_{j}"}
                for j, call in enumerate(msg.get("tool_calls") or [])
            ]
            answers.append([msg.get("content"), calls])
            result = s["results"][turn % len(s["results"])]
            if calls:
                messages.append({"role": "assistant", "content": msg.get("content"),
                                 "tool_calls": calls})  # fmt: skip
                messages += [{"role": "tool", "tool_call_id": call["id"], "content": result}
                             for call in calls]  # fmt: skip
            else:
                messages.append({"role": "assistant", "content": msg.get("content") or ""})
                messages.append({"role": "user", "content": f"Tool output:\n{result}"})
    return {"tokens": tokens, "seconds": seconds, "answers": answers}


def run_cell(base_url: str, sessions: list[dict], turns: int, concurrency: int) -> dict:
    wait_idle(base_url)
    before = spec_counters(base_url)
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda s: run_session(base_url, s, turns), sessions))
    wall = time.perf_counter() - t
    after = spec_counters(base_url)
    tokens = sum(d["tokens"] for d in done)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "spec": {k: after[k] - before.get(k, 0.0) for k in after},
            "answers": [d["answers"] for d in done]}  # fmt: skip


def _min_med_max(xs: list[float]) -> list[float]:
    return [round(min(xs), 2), round(statistics.median(xs), 2), round(max(xs), 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sessions", type=int, default=4, help="sessions a cell at 1 stream")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--spec", default=SUFFIX)
    p.add_argument("--ngram", action="store_true", help="a third server: the ngram method")
    p.add_argument("--also", action="append", default=[], metavar="NAME=JSON",
                   help="one more server with this --speculative-config (repeatable)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/agent_loop.json")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench_agent_"))
    common = ["--max-num-seqs", "32", "--log-level", "warning"]
    # Off by name, all of it: suffix decoding is the default since d1720d7, grammar
    # fast-forward always was.
    modes = {"off": [*common, "--speculative-config", "off", "--no-grammar-fast-forward"],
             "on": [*common, "--speculative-config", args.spec]}  # fmt: skip
    if args.ngram:
        modes["ngram"] = [*common, "--speculative-config", NGRAM]
    for item in args.also:
        name, spec = item.split("=", 1)
        modes[name] = [*common, "--speculative-config", spec]
    servers = {}
    rng, cells = random.Random(0), []
    try:
        for mode, flags in modes.items():
            servers[mode] = start_server(flags, logs / f"{mode}.log")
        warm = [session(rng)]
        for srv in servers.values():  # compile, first steps measured
            run_cell(srv.base_url, warm, 1, 1)
        for conc in map(int, args.concurrency.split(",")):
            cell = {"concurrency": conc, "runs": []}
            for rep in range(args.reps):
                sessions = [session(rng) for _ in range(max(args.sessions, conc))]
                answers = {}
                modes = list(servers)
                for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                    r = run_cell(servers[mode].base_url, sessions, args.turns, conc)
                    answers[mode] = r.pop("answers")
                    cell["runs"].append({"mode": mode, "rep": rep, **r})
                    print(f"c={conc} rep {rep} {mode}: {r['tok_s']:.1f} tok/s {r['tokens']} tokens "
                          f"{r['wall_s']:.1f} s {r['spec']}", flush=True)  # fmt: skip
                cell.setdefault("identical", []).append(
                    all(a == answers["off"] for a in answers.values())
                )
            cells.append(summarize(cell))
    finally:
        for srv in servers.values():
            srv.stop()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
              "speculative_config": args.spec, "sessions": args.sessions, "turns": args.turns,
              "max_tokens": MAX_TOKENS, "cells": cells}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for c in cells:
        print(json.dumps({k: v for k, v in c.items() if k != "runs"}))
    return 0


def summarize(cell: dict) -> dict:
    """Per mode: tok/s min / median / max, and against off: the ratio of the medians, each
    repetition's ratio (min / median / max), the acceptance of its drafts."""
    runs = cell["runs"]
    by_rep = {(r["rep"], r["mode"]): r["tok_s"] for r in runs}
    reps = sorted({r["rep"] for r in runs})
    off = statistics.median(by_rep[(k, "off")] for k in reps)
    for mode in sorted({r["mode"] for r in runs}):
        rates = [by_rep[(k, mode)] for k in reps]
        mine = [r["spec"] for r in runs if r["mode"] == mode]
        drafted = sum(d.get("num_draft_tokens_total", 0) for d in mine)
        accepted = sum(d.get("num_accepted_tokens_total", 0) for d in mine)
        cell[mode] = {"tok_s": _min_med_max(rates),
                      "ratio_of_medians": round(statistics.median(rates) / off, 3),
                      "paired_ratio": _min_med_max([by_rep[(k, mode)] / by_rep[(k, "off")] for k in reps]),
                      "acceptance": round(accepted / drafted, 3) if drafted else None,
                      "drafted": drafted, "accepted": accepted}  # fmt: skip
    cell["identical"] = all(cell["identical"])
    return cell


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Code editing with OpenAI's Predicted Outputs (issue 40): one stream, on the default model,
each request asking for a source file back with one small edit, greedy, three ways,
interleaved: ``off`` (a server with ``--speculative-config off``, no ``prediction``: no
speculation at all), ``plain`` (a server at its default flags, suffix decoding on since
d1720d7, no ``prediction``) and ``predicted`` (that server, ``prediction`` = the file);
each request with its own ``cache_salt``, so that no way replays an earlier identical
request's answer from the suffix cache. Two styles of asking (``STYLES``): ``plain`` and
``fenced`` (the answer read up to its code block's closing fence).
Reports per style and file the completion tokens per second (min / median / max over the
repetitions), the speed-ups off -> predicted (issue 40's "on vs off") and plain ->
predicted (what the prediction adds to the default), that all answers are identical, and
usage's accepted / rejected prediction tokens.

  python benchmarks/bench_prediction.py [--repeats 3] [--styles plain,fenced] [--out benchmarks/results/prediction.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.server import start_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

FILES = {
    "fib.py": '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def main():
    for i in range(10):
        print(i, fibonacci(i))


if __name__ == "__main__":
    main()
''',
    "stack.py": """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
""",
    "greet.js": """function greet(name) {
  const message = "Hello, " + name + "!";
  console.log(message);
  return message;
}

function greetAll(names) {
  for (const name of names) {
    greet(name);
  }
}

greetAll(["Ada", "Grace", "Linus"]);
""",
}
EDITS = {"fib.py": "Rename the function fibonacci to fib.", "stack.py": "Rename the method peek to top.",
         "greet.js": 'Change the greeting "Hello, " to "Hi, ".'}  # fmt: skip


# Two ways to ask. "plain": the file and the edit, "the whole file and nothing else" (the
# model often answers with prose or runs past the file). "fenced": the file in a code block,
# the answer asked as one code block and read up to its closing fence (`stop`), as editors
# that parse the code block do, so the answer is the file as the model gives it back.
STYLES = ("plain", "fenced")


def _body(name: str, style: str, salt: str) -> dict:
    source = FILES[name]
    if style == "plain":
        return {"cache_salt": salt, "messages": [
                    {"role": "system", "content": "You edit code. Reply with the whole file, changed as asked, and nothing else."},
                    {"role": "user", "content": f"{EDITS[name]}\n\n{source}"}],
                "max_tokens": 400, "temperature": 0}  # fmt: skip
    return {"cache_salt": salt, "messages": [
                {"role": "system", "content": "You are a code editor. You return the complete file with the requested change applied, in a single code block, and nothing else."},
                {"role": "user", "content": f"{name}:\n```\n{source}```\n\nInstruction: {EDITS[name]}"}],
            "max_tokens": 400, "temperature": 0, "stop": ["\n```"]}  # fmt: skip


def one(c: httpx.Client, name: str, predicted: bool, salt: str = "warm-up",
        style: str = "plain") -> dict:  # fmt: skip
    source = FILES[name]
    # Its own cache_salt: no drafts (suffix decoding's cross-request cache) or prefix hits
    # from the identical request an earlier repetition or way sent.
    body = _body(name, style, salt)
    if predicted:
        body["prediction"] = {"type": "content", "content": source}
    t = time.perf_counter()
    r = c.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t
    r.raise_for_status()
    data = r.json()
    usage = data["usage"]
    return {"file": name, "style": style, "predicted": predicted, "seconds": seconds,
            "completion_tokens": usage["completion_tokens"],
            "tok_s": usage["completion_tokens"] / seconds,
            "details": usage.get("completion_tokens_details"),
            "text": data["choices"][0]["message"]["content"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "prediction.json"))
    p.add_argument("--styles", default=",".join(STYLES), help="plain,fenced (see STYLES)")
    args = p.parse_args(argv)
    log = Path(args.out).with_suffix(".server.log")
    servers = {
        "off": start_server(
            ["--log-level", "warning", "--speculative-config", "off", "--no-grammar-fast-forward"],
            log.with_suffix(".off.log"),
        ),  # fmt: skip
        "default": start_server(["--log-level", "warning"], log),
    }
    ways = [("off", False), ("plain", False), ("predicted", True)]
    nonce = time.time_ns()
    runs = []
    clients = {k: httpx.Client(base_url=s.base_url, timeout=600) for k, s in servers.items()}
    try:
        for c in clients.values():
            one(c, "fib.py", False)  # warm-up
        styles = args.styles.split(",")
        for rep in range(args.repeats):
            for style in styles:
                for name in FILES:  # interleaved, the order rotating each repetition
                    for way, predicted in ways[rep % 3 :] + ways[: rep % 3]:
                        c = clients["off" if way == "off" else "default"]
                        salt = f"{nonce}-{rep}-{way}-{style}-{name}"  # each its own
                        run = one(c, name, predicted, salt, style)
                        runs.append({**run, "way": way, "repeat": rep})
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()
    cells = {f"{style}/{name}": _cell([r for r in runs if (r["style"], r["file"]) == (style, name)])
             for style in styles for name in FILES}  # fmt: skip
    for name, cell in cells.items():
        print(name, json.dumps(cell))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine_info(), "repeats": args.repeats, "cells": cells,
              "runs": runs}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _cell(runs: list[dict]) -> dict:
    by = {w: [r for r in runs if r["way"] == w] for w in ("off", "plain", "predicted")}

    def spread(xs):
        return [min(xs), statistics.median(xs), max(xs)]

    def speedup(slow, fast):  # per repetition: the slower way's time over the faster's
        return spread(
            [a["seconds"] / b["seconds"] for a, b in zip(by[slow], by[fast], strict=True)]
        )

    texts = {r["text"] for r in runs}
    return {**{f"{w}_tok_s": spread([r["tok_s"] for r in rs]) for w, rs in by.items()},
            "speedup_off_to_predicted": speedup("off", "predicted"),
            "speedup_plain_to_predicted": speedup("plain", "predicted"),
            "identical": len(texts) == 1,
            "completion_tokens": by["off"][0]["completion_tokens"],
            "prediction_details": by["predicted"][0]["details"],
            "text": by["off"][0]["text"]}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Code editing with OpenAI's Predicted Outputs (issue 40): one stream, a real server on the
default model, each request asking for a source file back with one small edit, sent with
``prediction`` = the file and without it, interleaved, greedy. Reports per cell the
completion tokens per second (min / median / max over the repetitions), that both answers
are identical, and usage's accepted / rejected prediction tokens.

  python benchmarks/bench_prediction.py [--repeats 3] [--out benchmarks/results/prediction.json]
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
    "stack.py": '''class Stack:
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
''',
    "greet.js": '''function greet(name) {
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
''',
}
EDITS = {"fib.py": "Rename the function fibonacci to fib.", "stack.py": "Rename the method peek to top.",
         "greet.js": 'Change the greeting "Hello, " to "Hi, ".'}  # fmt: skip


def one(c: httpx.Client, name: str, predicted: bool) -> dict:
    source = FILES[name]
    body = {"messages": [
                {"role": "system", "content": "You edit code. Reply with the whole file, changed as asked, and nothing else."},
                {"role": "user", "content": f"{EDITS[name]}\n\n{source}"}],
            "max_tokens": 400, "temperature": 0}  # fmt: skip
    if predicted:
        body["prediction"] = {"type": "content", "content": source}
    t = time.perf_counter()
    r = c.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t
    r.raise_for_status()
    data = r.json()
    usage = data["usage"]
    return {"file": name, "predicted": predicted, "seconds": seconds,
            "completion_tokens": usage["completion_tokens"],
            "tok_s": usage["completion_tokens"] / seconds,
            "details": usage.get("completion_tokens_details"),
            "text": data["choices"][0]["message"]["content"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "prediction.json"))
    args = p.parse_args(argv)
    server = start_server(["--log-level", "warning"], Path(args.out).with_suffix(".server.log"))
    runs = []
    try:
        with httpx.Client(base_url=server.base_url, timeout=600) as c:
            one(c, "fib.py", False)  # warm-up
            for rep in range(args.repeats):
                for name in FILES:  # interleaved, the order flipping each repetition
                    for predicted in (rep % 2 == 0, rep % 2 != 0):
                        runs.append({**one(c, name, predicted), "repeat": rep})
    finally:
        server.stop()
    cells = {}
    for name in FILES:
        plain = [r for r in runs if r["file"] == name and not r["predicted"]]
        pred = [r for r in runs if r["file"] == name and r["predicted"]]
        speed = [a["seconds"] / b["seconds"] for a, b in zip(plain, pred, strict=True)]
        cells[name] = {
            "plain_tok_s": [min(r["tok_s"] for r in plain), statistics.median(r["tok_s"] for r in plain), max(r["tok_s"] for r in plain)],
            "predicted_tok_s": [min(r["tok_s"] for r in pred), statistics.median(r["tok_s"] for r in pred), max(r["tok_s"] for r in pred)],
            "speedup_min_median_max": [min(speed), statistics.median(speed), max(speed)],
            "identical": all(a["text"] == b["text"] for a, b in zip(plain, pred, strict=True)),
            "completion_tokens": plain[0]["completion_tokens"],
            "prediction_details": pred[0]["details"],
        }  # fmt: skip
        print(name, json.dumps(cells[name]))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine_info(), "repeats": args.repeats, "cells": cells,
              "runs": [{k: v for k, v in r.items() if k != "text"} for r in runs]}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

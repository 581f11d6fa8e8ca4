"""Dump the tokens and text the engine produces, offline and served, for an A/B between two
checkouts (issue 12's "token-identical to the pre-change commit"). Run it once per checkout
with that checkout on PYTHONPATH, then compare the JSON files:

    PYTHONPATH=/path/to/old python scripts/ab_outputs.py old.json
    PYTHONPATH=/path/to/new python scripts/ab_outputs.py new.json
    cmp old.json new.json

Covers greedy and seeded sampling, n > 1, several prompts in one completion request, stop
strings, min_tokens, logprobs, streamed and non-streamed chat and completions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

CHATS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one word.",
    "List three colours.",
    "Explain what a CPU cache is in two sentences.",
]
TEXTS = ["Once upon a time", "The history of Rome", "def fibonacci(n):", "Dear Sir,"]
SAMPLING = [
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 0.8, "top_p": 0.9, "seed": 3, "n": 2},
    {"temperature": 0.0, "stop": ["\n", "."], "min_tokens": 3},
]


def offline() -> list:
    from tinyserve.entrypoints.llm import LLM
    from tinyserve.sampling_params import SamplingParams

    llm = LLM(dtype="float32")
    rows = []
    for kw in SAMPLING:
        params = SamplingParams(max_tokens=24, logprobs=1, **kw)
        outs = llm.generate(TEXTS, params, use_tqdm=False)
        chats = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
        for o in outs + chats:
            rows.append(
                [
                    [c.index, c.token_ids, c.text, c.finish_reason, str(c.stop_reason),
                     [lp.logprob for lp in c.logprobs or []]]
                    for c in o.outputs
                ]
            )  # fmt: skip
    return rows


def _sse(client: httpx.Client, path: str, body: dict) -> list:
    """Each choice's streamed text and finish reasons, joined: how tokens fall into chunks
    depends on timing (a slow reader gets several outputs in one chunk; speculation's
    verified runs), what they spell does not."""
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    events.append([c["index"], c.get("text", c.get("delta")), c["finish_reason"]])
    return _joined(events)


def _joined(events: list) -> list:
    out: dict[int, list] = {}
    for index, piece, finish in events:
        text, reasons = out.setdefault(index, ["", []])
        if isinstance(piece, dict):
            piece = (piece.get("role") or "") + (piece.get("content") or "")
        out[index] = [text + (piece or ""), reasons + ([finish] if finish else [])]
    return [[i, *out[i]] for i in sorted(out)]


def served() -> list:
    port = 8400 + os.getpid() % 500
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyserve.entrypoints.cli", "serve", "--port", str(port),
         "--dtype", "float32", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rows = []
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=300) as c:
            for kw in SAMPLING:
                common = {"max_tokens": 24, **kw}
                body = {"prompt": TEXTS, "logprobs": 1, "echo": True, **common}
                r = c.post("/v1/completions", json=body).json()
                rows.append([r["choices"], r["usage"]])
                rows.append(_sse(c, "/v1/completions", body))
                for chat in CHATS[:2]:
                    body = {"messages": [{"role": "user", "content": chat}], **common}
                    r = c.post("/v1/chat/completions", json=body).json()
                    rows.append([r["choices"], r["usage"]])
                    rows.append(_sse(c, "/v1/chat/completions", body))
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


if __name__ == "__main__":
    result = {"offline": offline(), "served": served()}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)

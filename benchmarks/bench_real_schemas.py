#!/usr/bin/env python
"""Real-world JSON schemas through ``response_format`` (issue 39 item 6), side by side.

Each schema of benchmarks/schema_sample.py's sample (100: SchemaStore, Kubernetes, GitHub /
CI, function calls) is sent once to each server as a chat completion with
``response_format: {"type": "json_schema", ...}``, greedy, ``max_tokens`` 384, 4 at a time,
one server after another. Every answer is put in one class:

* ``valid``: finished (``stop``), parses, and validates against the schema (jsonschema, the
  schema's own draft; formats checked too, counted apart as ``bad_format``);
* ``invalid``: finished but does not parse or validate;
* ``length``: cut by ``max_tokens``;
* ``refused``: a 4xx before any answer (the server cannot take the schema);
* ``checked_after``: a 4xx after generation (tinyserve: a keyword the grammar cannot follow,
  checked on the answer, broken);
* ``error``: a 5xx, a timeout or a dropped connection.

``--x-guidance '{"whitespace_flexible": true}'`` sends each schema with that top-level
``x-guidance`` (tinyserve's grammar options) to compare JSON layouts.

python benchmarks/bench_real_schemas.py --server tinyserve=http://127.0.0.1:8331 \
    [--server vllm=...] [--sample ~/.cache/tinyserve/schema-sample/sample.json] \
    [--out benchmarks/results/real_schemas.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from schema_sample import CACHE, build  # noqa: E402

CLASSES = ("valid", "invalid", "length", "refused", "checked_after", "error")


def prompt_of(item: dict) -> str:
    schema, name = item["schema"], item["name"].split(":", 1)[1].removesuffix(".json")
    what = schema.get("title") or name
    about = schema.get("description")
    about = f" ({about[:160]})" if isinstance(about, str) and about else ""
    return f"Write a short, realistic example of a {what} JSON document{about}. Reply with the JSON only."


def check(schema: dict, text: str) -> tuple[str, bool]:
    """(class, formats all right) of a finished answer."""
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return "invalid", True
    cls = jsonschema.validators.validator_for(schema)
    if next(iter(cls(schema).iter_errors(value)), None) is not None:
        return "invalid", True
    formats = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return "valid", next(iter(formats.iter_errors(value)), None) is None


def one(url: str, model: str, item: dict, max_tokens: int, extra: dict | None = None,
        temperature: float = 0.0) -> dict:  # fmt: skip
    schema = {**item["schema"], "x-guidance": extra} if extra else item["schema"]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = {"model": model, "messages": [{"role": "user", "content": prompt_of(item)}],
            "max_tokens": max_tokens, "temperature": temperature, "response_format": fmt}  # fmt: skip
    if temperature:  # sampled: a seed per schema, the same on every server and layout
        body["seed"] = sum(map(ord, item["name"]))
    t0 = time.perf_counter()
    row = {"name": item["name"]}
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    except httpx.HTTPError as e:
        return {**row, "class": "error", "detail": repr(e)[:300], "s": time.perf_counter() - t0}
    row["s"] = round(time.perf_counter() - t0, 2)
    row["status"] = r.status_code
    if r.status_code >= 500:
        return {**row, "class": "error", "detail": r.text[:300]}
    if r.status_code >= 400:
        after = "checked after generation" in r.text
        return {**row, "class": "checked_after" if after else "refused", "detail": r.text[:300]}
    data = r.json()
    choice = data["choices"][0]
    text = choice["message"].get("content") or ""
    row.update(finish=choice["finish_reason"], tokens=data["usage"]["completion_tokens"])
    if choice["finish_reason"] == "length":
        return {**row, "class": "length", "text": text[:200]}
    cls, formats_ok = check(item["schema"], text)
    return {**row, "class": cls, "formats_ok": formats_ok, "text": text[:400]}


def run(
    url: str,
    model: str,
    sample: list[dict],
    max_tokens: int,
    concurrency: int,
    extra=None,
    temperature: float = 0.0,
) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        rows = list(ex.map(lambda it: one(url, model, it, max_tokens, extra, temperature),
                           sample))  # fmt: skip
    counts = Counter(r["class"] for r in rows)
    summary = {c: counts.get(c, 0) for c in CLASSES}
    summary["bad_format"] = sum(r.get("formats_ok") is False for r in rows)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    by_source = {}
    for r in rows:
        src = by_source.setdefault(r["name"].split(":")[0], Counter())
        src[r["class"]] += 1
    summary["by_source"] = {k: dict(v) for k, v in by_source.items()}
    return {"summary": summary, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", action="append", required=True, help="label=base_url")
    ap.add_argument("--sample", type=Path, default=CACHE / "sample.json")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/real_schemas.json"))
    ap.add_argument("--x-guidance", type=json.loads, default=None,
                    help="JSON put under each schema's top-level x-guidance (tinyserve's "
                    "llguidance options, e.g. whitespace)")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the default); above: sampled, seeded per schema")  # fmt: skip
    args = ap.parse_args()
    sample = json.loads(args.sample.read_text()) if args.sample.exists() else build()
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = old.get("servers", {})
    for label, url in (s.split("=", 1) for s in args.server):
        results[label] = run(url, args.model, sample, args.max_tokens, args.concurrency,
                             args.x_guidance, args.temperature)  # fmt: skip
        results[label]["x_guidance"] = args.x_guidance
        results[label]["temperature"] = args.temperature
        print(label, json.dumps(results[label]["summary"]), flush=True)
    out = {"machine": machine_info(), "max_tokens": args.max_tokens,
           "sample": [s["name"] for s in sample], "servers": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

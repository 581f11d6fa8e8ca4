#!/usr/bin/env python
"""llguidance vs xgrammar on this machine, to choose the library behind tinyserve/structured/.

Measured with SmolLM2-135M-Instruct's tokenizer (vocab 49,152):
  * compile: a typical schema (8 properties, a nested object, an enum, an array) and a large
    one (50 properties, $defs/$ref, anyOf): first compile in the process, then the same schema
    again (the library's own cache, if it has one; tinyserve caches compiled grammars by spec
    anyway), and the cost of a fresh per-request matcher from a compiled grammar;
  * mask: one row's bitmask at every position of a valid document (median), one row inside a
    string value (the widest realistic mask; median of --steps), and 32 rows at once at 32
    positions of the document, the library's batched/parallel call (median of --steps);
  * footprint: wheel and unpacked sizes of the library and what it adds (``--wheels DIR``).

Each library needs its own environment (xgrammar pulls triton on Linux x86_64, so it is
measured in a scratch venv), so each run measures one and ``--merge`` joins the JSONs:

    python benchmarks/bench_grammar_libs.py --lib llguidance --out /tmp/llg.json
    /path/to/xgr-venv/bin/python benchmarks/bench_grammar_libs.py --lib xgrammar \
        --tokenizer-dir DIR --out /tmp/xgr.json
    python benchmarks/bench_grammar_libs.py --merge /tmp/llg.json /tmp/xgr.json \
        --wheels /tmp/wheels --out benchmarks/results/grammar_libs_<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TYPICAL = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 64},
        "email": {"type": "string", "format": "email"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
    },
    "required": ["id", "name", "role", "tags", "address"],
}

TYPICAL_DOC = (
    '{"id": 42, "name": "Alice Example", "email": "alice@example.com", "active": true, '
    '"role": "editor", "score": 87.5, "tags": ["a", "bb", "ccc"], '
    '"address": {"street": "1 Main Street", "city": "Springfield", "zip": "12345"}}'
)
IN_STRING_PREFIX = '{"id": 42, "name": "Alice Ex'


def large_schema(n: int = 50) -> dict:
    """n properties over $defs/$ref and anyOf: the shape of a real API's request body."""
    defs = {
        "Address": TYPICAL["properties"]["address"],
        "Money": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
            "required": ["amount", "currency"],
        },
        "Contact": {
            "anyOf": [
                {"type": "object", "properties": {"email": {"type": "string"}}},
                {"type": "object", "properties": {"phone": {"type": "string"}}},
            ]
        },
    }
    kinds = [
        {"type": "string"},
        {"type": "integer"},
        {"$ref": "#/$defs/Address"},
        {"$ref": "#/$defs/Money"},
        {"$ref": "#/$defs/Contact"},
        {"anyOf": [{"type": "string"}, {"type": "null"}]},
        {"type": "array", "items": {"$ref": "#/$defs/Money"}},
        {"enum": [f"v{i}" for i in range(20)]},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "$defs": defs, "properties": props, "required": list(props)[:10]}


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, hf_tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))
        self.executor = llguidance.LLExecutor()
        self.vocab = len(hf_tokenizer)

    def version(self) -> str:
        from importlib.metadata import version

        return version("llguidance")

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def accept(self, matcher, ids: list[int]) -> None:
        assert matcher.consume_tokens(ids), matcher.get_error()

    def rollback(self, matcher, n: int) -> None:
        assert matcher.rollback(n)

    def bitmask(self, rows: int):
        return self.lt.allocate_token_bitmask(rows, self.vocab)

    def fill_one(self, matcher, bitmask) -> None:
        self.lt.fill_next_token_bitmask(matcher, bitmask, 0)

    def fill_batch(self, matchers, bitmask) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.lt.fill_next_token_bitmask_par(self.executor, pairs, bitmask)


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, hf_tokenizer):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        self.vocab = len(hf_tokenizer)

    def version(self) -> str:
        from importlib.metadata import version

        return version("xgrammar")

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, matcher, ids: list[int]) -> None:
        for t in ids:
            assert matcher.accept_token(t)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill_one(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def fill_batch(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


def measure_compile(lib, schemas: dict[str, dict], repeats: int) -> dict:
    out = {}
    for label, schema in schemas.items():
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        first = time.perf_counter() - t0
        again = _timed(lambda s=schema: lib.compile(s), repeats)
        fresh = _timed(lambda c=compiled: lib.new_matcher(c), repeats * 10)
        out[label] = {
            "first_ms": round(first * 1e3, 3),
            "again_median_ms": _median_ms(again),
            "new_matcher_median_ms": _median_ms(fresh),
        }
    return out


def _timed_fresh(lib, pairs, fill, steps: int) -> list[float]:
    """Time ``fill()`` ``steps`` times, each on a state the library has not seen just before:
    every matcher takes its next token and rolls it back first (untimed), so a mask cached for
    the last state cannot answer."""
    out = []
    for _ in range(steps):
        for matcher, token in pairs:
            lib.accept(matcher, [token])
            lib.rollback(matcher, 1)
        t0 = time.perf_counter()
        fill()
        out.append(time.perf_counter() - t0)
    return out


def measure_masks(lib, hf_tokenizer, steps: int) -> dict:
    compiled = lib.compile(TYPICAL)
    doc_ids = hf_tokenizer.encode(TYPICAL_DOC, add_special_tokens=False)
    one = lib.bitmask(1)
    walk = lib.new_matcher(compiled)
    per_position = []
    for t in doc_ids:
        t0 = time.perf_counter()
        lib.fill_one(walk, one)
        per_position.append(time.perf_counter() - t0)
        lib.accept(walk, [t])

    prefix = hf_tokenizer.encode(IN_STRING_PREFIX, add_special_tokens=False)
    in_string = lib.new_matcher(compiled)
    lib.accept(in_string, prefix)
    lib.fill_one(in_string, one)
    allowed = int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in one[0].tolist()))
    nxt = hf_tokenizer.encode("ample", add_special_tokens=False)[0]
    string_times = _timed_fresh(
        lib, [(in_string, nxt)], lambda: lib.fill_one(in_string, one), steps
    )

    rows = 32
    pairs = []
    for r in range(rows):
        m = lib.new_matcher(compiled)
        k = (r * (len(doc_ids) - 1)) // rows
        lib.accept(m, doc_ids[:k])
        pairs.append((m, doc_ids[k]))
    matchers = [m for m, _ in pairs]
    batch = lib.bitmask(rows)
    batch_times = _timed_fresh(lib, pairs, lambda: lib.fill_batch(matchers, batch), steps)
    loop = lambda: [lib.fill_one(m, one) for m in matchers]  # noqa: E731
    loop_times = _timed_fresh(lib, pairs, loop, max(steps // 4, 5))
    return {
        "doc_tokens": len(doc_ids),
        "one_row_doc_walk_median_ms": _median_ms(per_position),
        "one_row_doc_walk_max_ms": round(max(per_position) * 1e3, 3),
        "one_row_in_string_median_ms": _median_ms(string_times),
        "in_string_allowed_tokens": allowed,
        "rows32_batched_median_ms": _median_ms(batch_times),
        "rows32_sequential_median_ms": _median_ms(loop_times),
    }


def wheel_sizes(wheels: Path) -> dict:
    """Per wheel in ``wheels``: download size and unpacked size, MiB."""
    out = {}
    for whl in sorted(wheels.rglob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            unpacked = sum(i.file_size for i in z.infolist())
        out[whl.name.split("-")[0]] = {
            "wheel": whl.name,
            "wheel_mib": round(whl.stat().st_size / 2**20, 1),
            "installed_mib": round(unpacked / 2**20, 1),
        }
    return out


def footprint(sizes: dict) -> dict:
    """What each library adds to tinyserve's install (torch/transformers/numpy/pydantic are
    already tinyserve dependencies)."""
    adds = {"llguidance": ["llguidance"], "xgrammar": ["xgrammar", "apache_tvm_ffi", "triton"]}
    out = {}
    for lib, names in adds.items():
        have = [sizes[n] for n in names if n in sizes]
        out[lib] = {
            "adds": names,
            "wheel_mib": round(sum(s["wheel_mib"] for s in have), 1),
            "installed_mib": round(sum(s["installed_mib"] for s in have), 1),
        }
    return out


def load_tokenizer(tokenizer_dir: str | None):
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        from tinyserve.models.default_model import ensure_default_model, tokenizer_dir_for

        tokenizer_dir = str(tokenizer_dir_for(ensure_default_model(progress=False)))
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def run_one(args) -> dict:
    hf_tokenizer = load_tokenizer(args.tokenizer_dir)
    lib = {"llguidance": LLGuidanceLib, "xgrammar": XGrammarLib}[args.lib](hf_tokenizer)
    schemas = {"typical": TYPICAL, "large": large_schema()}
    return {
        "version": lib.version(),
        "vocab": len(hf_tokenizer),
        "compile": measure_compile(lib, schemas, args.repeats),
        "mask": measure_masks(lib, hf_tokenizer, args.steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", choices=["llguidance", "xgrammar"])
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--merge", nargs="+", default=None, help="per-library JSONs to join")
    p.add_argument("--wheels", type=Path, default=None, help="folder of the downloaded wheels")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.merge:
        libs = {}
        for path in args.merge:
            libs.update(json.loads(Path(path).read_text())["libs"])
        result = {"libs": libs, "machine": json.loads(Path(args.merge[0]).read_text())["machine"]}
        if args.wheels:
            result["wheels"] = wheel_sizes(args.wheels)
            result["footprint"] = footprint(result["wheels"])
    else:
        from machine import machine_info

        result = {"libs": {args.lib: run_one(args)}, "machine": machine_info()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Engine-level fuzz of constrained decoding: N random JSON schemas (objects, bounded arrays,
enums, const, patterns, formats, number ranges, anyOf / oneOf, $ref, recursion; see
tinyserve/testing/schemas.py) x S sampling seeds, plus random regexes and choice lists, at
temperature 1.0 through ONE engine (64 requests in flight) over the 2-layer random Llama with
SmolLM2's tokenizer. Every output that ends with ``stop`` must parse and validate
(jsonschema, formats checked) or match; a schema the grammar library does not implement must
be refused with a ValueError naming the keyword; nothing may crash or hang.

The driver is tinyserve/testing/structured_fuzz.py; tests/engine/test_structured_fuzz.py
runs it smaller.

python benchmarks/fuzz_structured.py [--schemas 500] [--seeds 2] [--regex 100] [--choice 100]
    [--max-tokens 200] [--in-flight 64] [--seed 0] [--out benchmarks/results/fuzz_structured_<date>.json]
Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

from tinyserve.testing.structured_fuzz import build_fuzz_engine, make_cases, run_fuzz  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemas", type=int, default=500)
    p.add_argument("--seeds", type=int, default=2, help="sampling seeds per schema")
    p.add_argument("--regex", type=int, default=100)
    p.add_argument("--choice", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--unsupported", type=float, default=0.03,
                   help="share of schemas given a keyword llguidance refuses")  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def main() -> int:
    args = _parse()
    engine = build_fuzz_engine(max_num_seqs=args.in_flight)
    cases = make_cases(args.schemas, args.seeds, args.regex, args.choice, seed=args.seed,
                       unsupported=args.unsupported)  # fmt: skip
    result = run_fuzz(engine, cases, max_in_flight=args.in_flight, max_tokens=args.max_tokens)
    summary = result.summary()
    refused_by = Counter(r["message"].split(":", 1)[-1].strip()[:80] for r in result.refusals)
    out = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "refusal_messages": dict(refused_by.most_common()),
        "failures": result.failures,
        "machine": machine_info(),
    }
    path = args.out or RESULTS / f"fuzz_structured_{time.strftime('%Y-%m-%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False, default=str) + "\n")
    stop = summary["finish"].get("stop", 0)
    print(f"cases {summary['cases']}  finish {summary['finish']}  by kind {summary['by_kind']}")
    print(f"stop outputs checked {stop}, invalid {summary['invalid']}, "
          f"failures {summary['failures']}, refused {summary['refused']}")  # fmt: skip
    print(f"{summary['output_tokens']} output tokens in {summary['steps']} steps, "
          f"{summary['seconds']:.0f} s  -> {path}")  # fmt: skip
    for message, count in refused_by.most_common(5):
        print(f"  refused x{count}: {message}")
    for failure in result.failures[:10]:
        print("FAIL", json.dumps(failure, ensure_ascii=False)[:600])
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine-level fuzz of constrained decoding, small (benchmarks/fuzz_structured.py runs it at
1,000+ cases): random JSON schemas x 2 seeds plus regexes and choice lists, temperature 1.0,
64 requests in flight on one engine over the 2-layer random Llama with SmolLM2's tokenizer.
Every output that ends with ``stop`` must match its constraint; nothing may crash."""

from __future__ import annotations

import json
import random

import jsonschema

from tests.support.engine import assert_no_leaks, build_engine
from tinyserve.testing.schemas import random_schema, unsupported_keyword
from tinyserve.testing.structured_fuzz import make_cases, run_fuzz


def test_random_schemas_are_valid_json_schemas_and_cover_the_generator():
    rng = random.Random(0)
    schemas = [random_schema(rng, depth=4, unsupported=0.05) for _ in range(200)]
    text = json.dumps(schemas)
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
    for keyword in ("anyOf", "oneOf", "allOf", "$ref", "$defs", "enum", "const", "pattern",
                    "format", "minItems", "maxItems", "prefixItems", "exclusiveMinimum",
                    "exclusiveMaximum", "additionalProperties", "minLength", '"null"'):  # fmt: skip
        assert keyword in text, keyword
    assert '"#/$defs/node"' in text  # recursive
    assert 0 < sum(unsupported_keyword(s) is not None for s in schemas) < 30


def test_fuzzed_constrained_outputs_validate(fuzz_model):
    engine = build_engine(model=fuzz_model, block_size=16, num_blocks=1024,
                          max_num_seqs=64, max_num_batched_tokens=1024)  # fmt: skip
    cases = make_cases(60, seeds=2, num_regex=12, num_choice=12, seed=13)
    result = run_fuzz(engine, cases, max_in_flight=64, max_tokens=120)
    summary = result.summary()
    assert not result.failures, json.dumps(result.failures[:3], ensure_ascii=False, indent=1)
    assert summary["cases"] == len(cases)
    assert set(summary["finish"]) <= {"stop", "length", "refused"}, summary
    assert summary["finish"].get("stop", 0) >= 0.5 * len(cases), summary
    for refusal in result.refusals:
        assert refusal["message"].startswith("structured_outputs:"), refusal
    assert_no_leaks(engine)

"""Constrained decoding through the whole engine, on a 2-layer random Llama with SmolLM2's
tokenizer: random weights sampled at temperature 1 produce text no grammar would, so every
valid output is the grammar's doing."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from tests.support.engine import assert_no_leaks, build_engine, drain
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


def _engine(path: str, **kw):
    return build_engine(model=path, block_size=16, num_blocks=kw.pop("num_blocks", 512), **kw)


def _params(so: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 160, **kw}, structured_outputs=so)


def _texts(collector, rid: str) -> list[tuple[str, str | None]]:
    return [(c.text, c.finish_reason) for _, c in sorted(collector.choices[rid].items())]


def test_json_schema_outputs_validate_for_every_seed_and_sample(fuzz_model):
    engine = _engine(fuzz_model)
    prompt = engine.tokenizer.encode("Give me a person:")
    so = StructuredOutputsParams(json=SCHEMA)
    for seed in range(6):
        engine.add_request(f"r{seed}", prompt, _params(so, seed=seed, n=2))
    out = drain(engine)
    stopped = 0
    for seed in range(6):
        for text, finish in _texts(out, f"r{seed}"):
            assert finish in ("stop", "length"), finish
            if finish == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
                stopped += 1
    assert stopped >= 6, "too few outputs finished inside max_tokens to show anything"
    assert_no_leaks(engine)


# Keywords the grammar narrows (if/then, not, contains, dependentRequired) or drops and checks
# after (uniqueItems, propertyNames): structured/schema_approx.py.
APPROX_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "b"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "extra": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3,
                 "contains": {"const": "z"}, "uniqueItems": True},
        "meta": {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,3}$"},
                 "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    },
    "required": ["kind", "tags"],
    "additionalProperties": False,
    "if": {"properties": {"kind": {"const": "a"}}},
    "then": {"required": ["n"]},
    "not": {"required": ["kind", "extra"]},
    "dependentRequired": {"meta": ["n"]},
}  # fmt: skip


def test_narrowed_keywords_give_valid_answers_or_a_400_naming_the_field(fuzz_model):
    """Every answer the grammar ends validates against the schema as written; the few that
    break a keyword checked after (a repeated tag) end with an error naming the field and
    the keyword, never as a "stop". Nothing leaks."""
    engine = _engine(fuzz_model)
    prompt = engine.tokenizer.encode("Give me a record:")
    so = StructuredOutputsParams(json=APPROX_SCHEMA, field="response_format")
    for seed in range(8):
        engine.add_request(f"r{seed}", prompt, _params(so, seed=seed, n=2))
    out = drain(engine)
    finishes = [c for rid in out.choices for c in out.choices[rid].values()]
    for c in finishes:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), APPROX_SCHEMA)
        elif c.finish_reason == "error":
            assert c.error.startswith("response_format: the answer breaks the schema's"), c.error
            assert "'uniqueItems'" in c.error or "'propertyNames'" in c.error, c.error
        else:
            assert c.finish_reason == "length", c.finish_reason
    assert sum(c.finish_reason == "stop" for c in finishes) >= 4
    assert_no_leaks(engine)


def test_an_answer_that_breaks_a_checked_keyword_is_an_error(fuzz_model):
    """The grammar allows only [1, 1] here; uniqueItems refuses it after generation."""
    engine = _engine(fuzz_model)
    schema = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}  # fmt: skip
    so = StructuredOutputsParams(json=schema, field="response_format")
    engine.add_request("dup", engine.tokenizer.encode("Numbers:"), _params(so, seed=0))
    choice = drain(engine).choices["dup"][0]
    assert choice.finish_reason == "error"
    assert "'uniqueItems'" in choice.error and choice.error.startswith("response_format:")
    assert_no_leaks(engine)


def test_grammar_forced_tokens_are_drafts_that_change_nothing(fuzz_model):
    """Grammar fast-forward (on by default, no --speculative-config): the tokens a schema
    forces (keys, punctuation, enum tails) are drafted and all accepted, in fewer steps,
    and every output (greedy and seeded sampling, n=2) is the one plain decoding
    (``grammar_fast_forward=False``: --no-grammar-fast-forward) gives."""

    def run(fast_forward: bool):
        engine = _engine(fuzz_model, grammar_fast_forward=fast_forward)
        prompt = engine.tokenizer.encode("Give me a person:")
        so = StructuredOutputsParams(json=SCHEMA)
        engine.add_request("greedy", prompt, _params(so, temperature=0.0))
        for seed in range(3):
            engine.add_request(f"r{seed}", prompt, _params(so, seed=seed, n=2))
        out = drain(engine)
        texts = {rid: [(c.token_ids, c.finish_reason) for _, c in sorted(out.choices[rid].items())]
                 for rid in out.choices}  # fmt: skip
        assert_no_leaks(engine)
        return texts, engine.core.proposer.stats, engine.core.num_steps

    fast, stats, steps = run(True)
    plain, plain_stats, plain_steps = run(False)
    assert fast == plain
    assert plain_stats.num_draft_tokens == 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert steps < plain_steps


def test_a_dead_end_in_the_grammar_fails_its_request_not_the_engine(fuzz_model):
    """A schema part no value satisfies (A refers only to itself): the forced tokens
    `{"a":` are drafted, the matcher finds nothing after them and the library refuses to
    roll back (the engine thread died of it). The request ends in an error naming the dead
    end, as plain decoding's does (which had ended 'stop' on `{"a": `, invalid: a matcher in
    an error state took EOS as a finished grammar's), and another request runs on."""
    dead = {"$defs": {"A": {"$ref": "#/$defs/A"}}, "type": "object",
            "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}  # fmt: skip
    ends = {}
    for fast_forward in (True, False):
        engine = _engine(fuzz_model, grammar_fast_forward=fast_forward)
        prompt = engine.tokenizer.encode("Give me JSON:")
        so = StructuredOutputsParams(json=dead, field="response_format")
        engine.add_request("dead", prompt, _params(so, temperature=0.0))
        engine.add_request("ok", prompt, _params(StructuredOutputsParams(json=SCHEMA),
                                                 temperature=0.0, max_tokens=24))  # fmt: skip
        out = drain(engine).choices
        ((_, dead_end),) = out["dead"].items()
        assert dead_end.finish_reason == "error" and "allows nothing" in dead_end.error
        assert dead_end.error.startswith("response_format:")
        ends[fast_forward] = out["ok"][0].token_ids
        assert_no_leaks(engine)
    assert ends[True] == ends[False]  # drafts or not, the other request's tokens


def test_a_schema_no_finite_value_satisfies_fails_its_request(fuzz_model):
    """An object whose required property refers back to it ({"c": {"c": ...}} without end):
    the grammar forces tokens without end and llguidance's fast-forward stops at its item
    limit. The request ends in an error saying so, naming its field; another runs on."""
    endless = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
               "required": ["c"]}}, "$ref": "#/$defs/n"}  # fmt: skip
    engine = _engine(fuzz_model)
    prompt = engine.tokenizer.encode("Give me JSON:")
    so = StructuredOutputsParams(json=endless, field="response_format")
    engine.add_request("endless", prompt, _params(so, temperature=0.0, max_tokens=30))
    engine.add_request("ok", prompt, _params(StructuredOutputsParams(json=SCHEMA),
                                             temperature=0.0, max_tokens=24))  # fmt: skip
    out = drain(engine).choices
    ((_, end),) = out["endless"].items()
    assert end.finish_reason == "error" and "without end" in end.error, end.error
    assert end.error.startswith("response_format:")
    assert out["ok"][0].finish_reason in ("stop", "length")
    assert_no_leaks(engine)


def test_regex_choice_and_json_object(fuzz_model):
    engine = _engine(fuzz_model)
    prompt = engine.tokenizer.encode("Answer:")
    cases = {
        "re": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        "ch": StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
        "obj": StructuredOutputsParams(json_object=True),
    }
    for rid, so in cases.items():
        engine.add_request(rid, prompt, _params(so, seed=7, n=3, max_tokens=80))
    out = drain(engine)
    for text, finish in _texts(out, "re"):
        assert finish == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    for text, finish in _texts(out, "ch"):
        assert finish == "stop" and text in ("yes", "no", "maybe later"), text
    for text, finish in _texts(out, "obj"):
        assert finish == "length" or isinstance(json.loads(text), dict), text


def test_greedy_and_logprobs_follow_the_masked_distribution(fuzz_model):
    engine = _engine(fuzz_model)
    prompt = engine.tokenizer.encode("Pick:")
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    engine.add_request("g", prompt, _params(so, temperature=0.0, logprobs=3))
    (choice,) = drain(engine).choices["g"].values()
    assert choice.text in ("alpha", "beta") and choice.finish_reason == "stop"
    for lp in choice.logprobs:
        assert lp.logprob <= 0.0 and lp.top[0][0] == lp.token_id  # greedy: the best allowed


def test_constrained_tokens_survive_preemption_and_prefix_hits(fuzz_model):
    """A seeded constrained request gives the same tokens alone and when squeezed into a cache
    small enough to preempt (recompute) it, next to requests sharing its prompt prefix."""
    prompt = _engine(fuzz_model).tokenizer.encode("A person record: " * 6)
    so = StructuredOutputsParams(json=SCHEMA)
    alone = _engine(fuzz_model)
    alone.add_request("x", prompt, _params(so, seed=3, max_tokens=96))
    ref = _texts(drain(alone), "x")

    busy = _engine(fuzz_model, num_blocks=14, max_num_batched_tokens=64)
    # Grammar fast-forward drafts by the step costs it measures (wall clock), which would
    # make the schedule, and whether anything is preempted, vary from run to run: here it
    # drafts every forced run in full, so the schedule is the same each time.
    proposer = busy.core.proposer
    proposer.config = dataclasses.replace(proposer.config, adaptive=False)
    for i in range(4):
        busy.add_request(f"o{i}", prompt, _params(so, seed=10 + i, max_tokens=96))
    busy.add_request("x", prompt, _params(so, seed=3, max_tokens=96))
    out = drain(busy)
    assert busy.core.scheduler.num_preemptions > 0, "the cache was not small enough"
    assert proposer.stats.num_draft_tokens > 0  # forced drafts were verified, and rolled back
    assert _texts(out, "x") == ref
    assert_no_leaks(busy)


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutputsParams(json={"type": "object", "$dynamicRef": "#meta"}),
         "structured_outputs: unsupported JSON schema keyword '\\$dynamicRef'"),
        (StructuredOutputsParams(regex="(unclosed"), "regex"),
        (StructuredOutputsParams(grammar="start: ???"), "grammar"),
    ],
)  # fmt: skip
def test_a_bad_spec_is_a_value_error_and_leaves_nothing(fuzz_model, so, message):
    engine = _engine(fuzz_model)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", [1, 2, 3], _params(so))
    assert "bad" not in engine.output_processor
    assert_no_leaks(engine)


def test_structured_outputs_params_take_exactly_one_mode():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    from tinyserve.engine.structured_output import StructuredOutputManager

    so = StructuredOutputsParams(json='{"b": 1, "a": 2}', field="response_format")
    spec = StructuredOutputManager._spec(SamplingParams(structured_outputs=so))
    assert (spec.kind, spec.value, spec.field) == ("json", '{"b":1,"a":2}', "response_format")


def test_the_engine_thread_takes_the_grammar_the_front_awaited(fuzz_model):
    """The async front awaits a request's compile, then the engine thread adds it; if the
    compile cache evicted the grammar in between (other requests' grammars), the engine
    thread compiled it again itself, every stream waiting meanwhile. The front keeps it on
    the request's params: evicted or not, the engine thread compiles nothing."""
    import asyncio

    from tinyserve.engine.async_engine import AsyncEngine

    engine = _engine(fuzz_model)
    so = StructuredOutputsParams(json=SCHEMA)
    params = _params(so, max_tokens=8)

    async def main():
        front = AsyncEngine(engine)
        front.start()
        await front.prepare(params)
        pool = engine.structured._ensure_pool()
        compiles = pool.num_compiles
        pool._cache.clear()  # evicted meanwhile
        async for _ in front.generate("r", [1, 2, 3], params):
            pass
        front.shutdown()
        return pool.num_compiles - compiles

    assert params.compiled_grammar is None
    assert asyncio.run(asyncio.wait_for(main(), 60)) == 0
    assert params.compiled_grammar is not None

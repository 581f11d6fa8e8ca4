"""Engine-level fuzz of constrained decoding: random JSON schemas, regexes and choice lists
(:mod:`tinyserve.testing.schemas`), each sampled at temperature 1.0 with its own seed, many
requests in flight on one engine. benchmarks/fuzz_structured.py runs it full size,
tests/engine/test_structured_fuzz.py smaller.

What must hold, per case:

* an output that ends with ``stop`` matches its constraint: JSON that validates against the
  schema (jsonschema, draft 2020-12, formats checked), a full match of the regex, exactly one
  of the choices; ``length`` (max_tokens reached first) is allowed, anything else
  (``error``: the grammar rejected a sampled token; ``abort``) is a failure;
* a schema the grammar library does not implement is refused by ``add_request`` with a
  ValueError (``refused``); one the generator marked unsupported must name its keyword;
* no exception other than that ValueError, and the engine drains within a step budget.

The engine given must sample (a tokenizer loaded); the 2-layer random Llama of
:func:`tinyserve.testing.checkpoints.build_fuzz_model` makes every valid output the
grammar's doing.
"""

from __future__ import annotations

import json
import random
import re
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import jsonschema

from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tinyserve.testing.schemas import (
    random_choices,
    random_regex,
    random_schema,
    unsupported_keyword,
)

PROMPTS = ("Give me a record:", "JSON:", "Answer with data.", "{", "Output:", "The value is")


@dataclass(frozen=True)
class Case:
    label: str  # "json-17-s2": kind, generator index, seed
    kind: str  # json | regex | choice
    spec: object  # the schema (dict), the regex (str) or the choices (list[str])
    seed: int

    def params(self, max_tokens: int) -> SamplingParams:
        so = {"json": "json", "regex": "regex", "choice": "choice"}[self.kind]
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=self.seed,
                              structured_outputs=StructuredOutputsParams(**{so: self.spec}))  # fmt: skip


def make_cases(
    num_schemas: int, seeds: int, num_regex: int = 0, num_choice: int = 0,
    seed: int = 0, depth: int = 4, unsupported: float = 0.03,
) -> list[Case]:  # fmt: skip
    """``num_schemas`` schemas x ``seeds`` sampling seeds, plus regex and choice cases (one
    seed each), all from one generator seed. Interleaved so every batch mixes kinds."""
    rng = random.Random(seed)
    cases = []
    for i in range(num_schemas):
        schema = random_schema(rng, depth=rng.randint(1, depth), unsupported=unsupported)
        cases += [Case(f"json-{i}-s{s}", "json", schema, 1000 * i + s) for s in range(seeds)]
    cases += [Case(f"regex-{i}", "regex", random_regex(rng), i) for i in range(num_regex)]
    cases += [Case(f"choice-{i}", "choice", random_choices(rng), i) for i in range(num_choice)]
    rng.shuffle(cases)
    return cases


def check_output(case: Case, text: str) -> str | None:
    """None if ``text`` (an output that ended with ``stop``) meets the case's constraint,
    else what is wrong."""
    if case.kind == "regex":
        return None if re.fullmatch(case.spec, text) else "does not match the regex"
    if case.kind == "choice":
        return None if text in case.spec else "is not one of the choices"
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"is not JSON: {e}"
    validator = jsonschema.Draft202012Validator(
        case.spec, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
    return f"does not validate: {errors[0].message}" if errors else None


@dataclass
class FuzzResult:
    cases: int = 0
    finish: Counter = field(default_factory=Counter)  # stop / length / refused / error / ...
    by_kind: dict = field(default_factory=dict)  # kind -> Counter of finishes
    failures: list[dict] = field(default_factory=list)  # invalid outputs, errors, crashes
    refusals: list[dict] = field(default_factory=list)
    output_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    def record(self, case: Case, outcome: str) -> None:
        self.cases += 1
        self.finish[outcome] += 1
        self.by_kind.setdefault(case.kind, Counter())[outcome] += 1

    def fail(self, case: Case, problem: str, text: str | None = None) -> None:
        self.failures.append({"case": case.label, "kind": case.kind, "spec": case.spec,
                              "seed": case.seed, "problem": problem, "text": text})  # fmt: skip

    def summary(self) -> dict:
        return {
            "cases": self.cases,
            "finish": dict(self.finish),
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
            "invalid": sum(f["problem"].startswith(("does not", "is not")) for f in self.failures),
            "failures": len(self.failures),
            "refused": len(self.refusals),
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "seconds": round(self.seconds, 2),
        }


def _add(engine, case: Case, prompt: list[int], max_tokens: int, result: FuzzResult) -> bool:
    """Add one case's request; False (recorded) when it was refused or raised."""
    try:
        engine.add_request(case.label, prompt, case.params(max_tokens))
        return True
    except ValueError as e:
        result.record(case, "refused")
        result.refusals.append({"case": case.label, "spec": case.spec, "message": str(e)})
        keyword = unsupported_keyword(case.spec) if case.kind == "json" else None
        if keyword is not None and keyword not in str(e):
            result.fail(case, f"refused without naming {keyword!r}: {e}")
    except Exception:
        result.record(case, "crash")
        result.fail(case, "add_request raised: " + traceback.format_exc(limit=6))
    return False


def _finish(case: Case, text: str, reason: str | None, error, result: FuzzResult) -> None:
    result.record(case, reason or "none")
    if reason == "stop":
        problem = check_output(case, text)
        if problem is not None:
            result.fail(case, problem, text)
        elif case.kind == "json" and unsupported_keyword(case.spec):
            result.fail(case, "a schema with an unsupported keyword was accepted", text)
    elif reason != "length":
        result.fail(case, f"finished with {reason!r}: {error}", text)


def run_fuzz(
    engine, cases: list[Case], max_in_flight: int = 64, max_tokens: int = 200,
    max_steps: int | None = None,
) -> FuzzResult:  # fmt: skip
    """Run ``cases`` through ``engine``, at most ``max_in_flight`` requests at once."""
    result, t0 = FuzzResult(), time.perf_counter()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    pending, live = list(reversed(cases)), {}  # request id -> (case, text parts)
    budget = (
        max_steps if max_steps is not None else 4 * max_tokens * (len(cases) // max_in_flight + 2)
    )
    while pending or live:
        while pending and len(live) < max_in_flight:
            case = pending.pop()
            if _add(engine, case, prompts[case.seed % len(prompts)], max_tokens, result):
                live[case.label] = (case, [])
        if not live:
            continue
        if result.steps >= budget:
            for case, parts in live.values():
                result.record(case, "hang")
                result.fail(case, f"unfinished after {budget} engine steps", "".join(parts))
            break
        try:
            outputs = engine.step()
        except Exception:
            for case, _ in live.values():
                result.record(case, "crash")
                result.fail(case, "engine.step raised: " + traceback.format_exc(limit=8))
            break
        result.steps += 1
        for out in outputs:
            case, parts = live[out.request_id]
            parts.append(out.text_delta)
            result.output_tokens += len(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                _finish(case, "".join(parts), out.finish_reason, out.error, result)
    result.seconds = time.perf_counter() - t0
    return result


def build_fuzz_engine(**kwargs):
    """An fp32 CPU engine over the fuzz model (:func:`tinyserve.testing.fuzz.fuzz_model_dir`:
    the 2-layer random Llama with SmolLM2's tokenizer, built in the cache folder once)."""
    from tinyserve.engine.arg_utils import EngineArgs
    from tinyserve.engine.llm_engine import LLMEngine
    from tinyserve.testing.fuzz import fuzz_model_dir

    args = {"dtype": "float32", "device": "cpu", "block_size": 16, "num_blocks": 2048,
            "max_num_seqs": 64, "max_num_batched_tokens": 1024, **kwargs}  # fmt: skip
    return LLMEngine(EngineArgs(model=str(fuzz_model_dir()), **args))

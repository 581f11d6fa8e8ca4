"""Speculative decoding through the whole engine (SmolLM2, CPU kernels, fp32): lossless for
greedy requests — token-identical to plain decoding alone and batched, with stop strings,
max_tokens cut inside an accepted run, prefix-cache hits, preemption and aborts — with
nothing leaked and no block hashed past a request's verified tokens."""

from __future__ import annotations

import random

import pytest

from tests.support.engine import assert_no_leaks, drain, run_alone, run_batch
from tests.support.spec_decode import (
    SPEC,
    greedy_requests,
    grounded_prompts,
    hashed_tokens_are_real,
    outputs_of,
    run_checking_hashes,
    spec_engine,
)
from tinyserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_greedy_is_token_identical_batched_alone_and_on_prefix_hits(smol_path):
    plain = spec_engine(smol_path, None)
    reqs = greedy_requests(plain.tokenizer)
    reference = outputs_of(run_batch(plain, reqs), reqs)
    assert_no_leaks(plain)

    spec = spec_engine(smol_path, SPEC)
    assert outputs_of(run_batch(spec, reqs), reqs) == reference  # batched
    again = reqs[::10]
    hits = spec.core.kv_cache_manager.prefix_cache_hits
    assert outputs_of(run_batch(spec, again), again) == {r: reference[r] for r, _, _ in again}
    assert spec.core.kv_cache_manager.prefix_cache_hits > hits  # prefix-cache hits
    alone = reqs[:2] + reqs[30:31]
    assert outputs_of(run_alone(spec, alone), alone) == {r: reference[r] for r, _, _ in alone}
    stats = spec.core.proposer.stats
    assert stats.num_accepted_tokens > 100, stats  # the grounded prompts were sped up
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # and some drafts failed
    assert_no_leaks(spec)


def test_greedy_is_token_identical_on_a_bf16_kv_cache(smol_path):
    """--kv-cache-dtype bfloat16: a verification run writes its drafts' K/V rounded and reads
    them back like decode steps do, so speculation still changes nothing."""
    reqs = greedy_requests(spec_engine(smol_path, None).tokenizer)[::8]
    plain = spec_engine(smol_path, None, kv_cache_dtype="bfloat16")
    spec = spec_engine(smol_path, SPEC, kv_cache_dtype="bfloat16")
    assert outputs_of(run_batch(spec, reqs), reqs) == outputs_of(run_batch(plain, reqs), reqs)
    assert spec.core.proposer.stats.num_accepted_tokens > 0
    assert_no_leaks(spec)


def test_the_adaptive_policy_prices_drafts_with_this_machines_steps(smol_path):
    """With the default (adaptive) policy the engine times its steps by row count — decode
    steps, prompt-sized prefill steps and the verification steps it drafts — and copy
    prompts alone still draft; outputs stay identical to plain decoding."""
    plain = spec_engine(smol_path, None)
    reqs = greedy_requests(plain.tokenizer)[:4]  # grounded
    reference = outputs_of(run_alone(plain, reqs), reqs)
    spec = spec_engine(smol_path, {k: v for k, v in SPEC.items() if k != "adaptive"})
    assert spec.core.proposer.config.adaptive
    assert outputs_of(run_alone(spec, reqs), reqs) == reference
    rows = spec.core.proposer.cost.measured_rows
    assert 1 in rows and max(rows) >= min(len(p) for _, p, _ in reqs) - 1
    assert any(2 <= n <= 5 for n in rows)  # verification steps of 1 + k <= 4 drafts
    assert spec.core.proposer.stats.num_accepted_tokens > 0
    assert_no_leaks(spec)


def test_greedy_identical_under_preemption_and_no_stale_hashes(smol_path):
    plain = spec_engine(smol_path, None, num_blocks=512)
    reqs = [(r, p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for r, p, _ in greedy_requests(plain.tokenizer)[:8]]  # fmt: skip
    reference = outputs_of(run_batch(plain, reqs), reqs)
    spec = spec_engine(smol_path, SPEC, num_blocks=28)  # 448 slots for 8 requests: preemption
    assert run_checking_hashes(spec, reqs) == reference
    assert spec.core.scheduler.num_preemptions > 0
    assert_no_leaks(spec)


def test_random_aborts_during_verification_leak_nothing(smol_path):
    spec = spec_engine(smol_path, SPEC, num_blocks=64)
    reqs = greedy_requests(spec.tokenizer)[:20]
    rng = random.Random(3)
    for rid, prompt, params in reqs:
        spec.add_request(rid, prompt, params)
    live = {rid for rid, _, _ in reqs}
    while spec.has_unfinished():
        for out in spec.step():
            if out.finished:
                live.discard(out.request_id)
        hashed_tokens_are_real(spec)
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            spec.abort(victim)
            live.discard(victim)
    assert spec.core.proposer.stats.num_drafts > 0
    assert_no_leaks(spec)


def test_seeded_sampling_with_speculation_is_reproducible_and_equals_plain(smol_path):
    """A seeded row's noise is a function of (seed, position) (worker/sampler.py), and a
    verification row at position t sees plain decoding's distribution at t: so seeded
    sampling with speculation gives exactly the tokens it gives without."""
    prompts = grounded_prompts(spec_engine(smol_path, None).tokenizer, 2)

    def run(spec):
        engine = spec_engine(smol_path, spec)
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, n=2)
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params)
        out = drain(engine)
        if spec is not None:
            assert engine.core.proposer.stats.num_drafts > 0
        return {k: [c.token_ids for _, c in sorted(v.items())] for k, v in out.choices.items()}

    with_spec = run(SPEC)
    assert with_spec == run(SPEC)
    assert with_spec == run(None)


def test_constrained_requests_draft_with_per_position_masks(smol_path):
    """A JSON-schema request echoing a record from its prompt: drafts are verified under the
    grammar's mask at each position; greedy output equals speculation off and validates."""
    import json

    import jsonschema

    from tinyserve.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "city", "tags"], "additionalProperties": False}  # fmt: skip
    record = '{"name": "Ada Lovelace", "city": "London", "tags": ["math", "poetry", "engines"]}'
    text = f"Repeat this JSON record exactly:\n{record}\nRecord: "
    plain = spec_engine(smol_path, None)
    prompt = plain.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    reqs = [(f"j{i}", prompt, params) for i in range(3)]
    reference = outputs_of(run_batch(plain, reqs), reqs)
    spec = spec_engine(smol_path, SPEC)
    got = outputs_of(run_batch(spec, reqs), reqs)
    assert got == reference
    jsonschema.validate(json.loads(got["j0"][1]), schema)
    assert spec.core.proposer.stats.num_accepted_tokens > 10
    assert_no_leaks(spec)

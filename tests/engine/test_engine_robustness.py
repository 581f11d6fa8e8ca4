"""Requests that leave early never leak: random aborts mid-prefill and mid-decode give back
every block and every piece of per-request state, and survivors' outputs are unchanged. An
exception inside a step fails just that step's requests; the engine keeps serving, correctly."""

from __future__ import annotations

import random

import pytest

from tests.support.engine import (
    Collector,
    assert_no_leaks,
    build_engine,
    drain,
    greedy,
    random_prompt,
    record_schedules,
    run_alone,
    run_batch,
    text_prompts,
    tiny_engine,
)
from tinyserve.request import RequestStatus
from tinyserve.sampling_params import SamplingParams


def _phase(engine, parent_id: str) -> str:
    """Where a live request is: waiting, prefill (prompt not all computed) or decode."""
    reqs = [
        engine.core.scheduler.requests[c] for c in engine.output_processor.parents[parent_id].live
    ]
    if any(r.num_output_tokens > 0 for r in reqs):
        return "decode"
    if all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in reqs):
        return "waiting"
    return "prefill"


def _run_with_random_aborts(engine, requests, rng: random.Random, abort_prob: float):
    """Requests arrive 0-3 per step; before each step a random live one may be aborted
    (and the first one seen mid-prefill is).
    Returns (collector, {request id: phase it was aborted in})."""
    collector = Collector()
    pending = list(requests)
    live: dict[str, int] = {}  # request id -> n
    aborted: dict[str, str] = {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3) if engine.has_unfinished() else 1):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, prompt, params)
                live[rid] = params.n
        victim = None
        if live and rng.random() < abort_prob:
            victim = rng.choice(sorted(live))
        elif "prefill" not in aborted.values():  # make sure one is caught mid-prefill
            victim = next((r for r in sorted(live) if _phase(engine, r) == "prefill"), None)
        if victim is not None:
            rid = victim
            aborted[rid] = _phase(engine, rid)
            assert engine.abort(rid) is True
            assert engine.abort(rid) is False  # a second abort is a no-op
            del live[rid]
        collector.feed(engine.step())
        for rid in list(live):
            choices = collector.choices.get(rid, {})
            if len(choices) == live[rid] and all(c.finish_reason for c in choices.values()):
                assert engine.abort(rid) is False  # finished: nothing to abort
                del live[rid]
    return collector, aborted


def _tiny_requests(rng: random.Random, count: int):
    bases = [random_prompt(12, seed=700 + i) for i in range(3)]  # shared prefixes
    requests = []
    for i in range(count):
        prompt = rng.choice(bases) + random_prompt(rng.randint(1, 40), seed=800 + i)
        if rng.random() < 0.3:
            prompt = random_prompt(rng.randint(1, 50), seed=900 + i)
        max_tokens = rng.randint(1, 20)
        kind = rng.random()
        if kind < 0.6:
            params = greedy(max_tokens)
        elif kind < 0.8:
            params = SamplingParams(temperature=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=max_tokens)
        requests.append((f"r{i}", prompt, params))
    return requests


def test_random_aborts_leak_nothing_and_keep_survivors_outputs(tiny_qwen2_path):
    rng = random.Random(1234)
    requests = _tiny_requests(rng, 48)
    kw = dict(num_blocks=48, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
    ref = run_batch(tiny_engine(tiny_qwen2_path, **kw), requests)

    engine = tiny_engine(tiny_qwen2_path, **kw)
    got, aborted = _run_with_random_aborts(engine, requests, rng, abort_prob=0.3)
    assert {"waiting", "prefill", "decode"} <= set(aborted.values()), aborted
    assert len(aborted) >= 10
    assert engine.core.scheduler.num_preemptions > 0  # aborts met preempted requests too
    assert_no_leaks(engine)
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    assert engine.stats().kv_cache_usage == 0.0

    survivors = [rid for rid, _, _ in requests if rid not in aborted]
    assert len(survivors) >= 10
    for rid in survivors:
        assert {i: c.token_ids for i, c in got.choices[rid].items()} == {
            i: c.token_ids for i, c in ref.choices[rid].items()
        }, rid
        assert all(c.finish_reason == "length" for c in got.choices[rid].values())
    for rid in aborted:  # an aborted request never reports a finish
        assert all(c.finish_reason is None for c in got.choices.get(rid, {}).values())


@pytest.mark.slow
def test_random_aborts_with_tokenizer_stop_strings_and_seeds(smol_path):
    """The same on SmolLM2: detokenizers, n > 1 children and seeded generators all go."""
    engine = build_engine(
        model=smol_path, num_blocks=40, block_size=16, max_num_batched_tokens=48, max_num_seqs=6
    )
    rng = random.Random(99)
    prompts = text_prompts(engine.tokenizer, [rng.randint(8, 70) for _ in range(14)], seed=61)
    requests = []
    for i, prompt in enumerate(prompts):
        params = [
            greedy(rng.randint(3, 10), stop=["the", "\n"]),
            SamplingParams(temperature=0.9, seed=i, max_tokens=rng.randint(3, 10), stop=[" a"]),
            SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=rng.randint(3, 8)),
        ][i % 3]
        requests.append((f"s{i}", prompt, params))
    _, aborted = _run_with_random_aborts(engine, requests, rng, abort_prob=0.35)
    assert {"prefill", "decode"} <= set(aborted.values()), aborted
    assert_no_leaks(engine)


# ---------------------------------------------------------------- an exception inside a step


def test_step_exception_fails_its_requests_and_engine_recovers(tiny_qwen2_path, monkeypatch):
    base = random_prompt(24, seed=600)
    requests = {
        "a": (base + random_prompt(5, seed=601), greedy(12)),
        "b": (random_prompt(9, seed=602), greedy(12)),
        # Shares a's first 6 blocks; its 7th block is hashed in the failing step, never written.
        "c": (base + random_prompt(7, seed=603), greedy(10)),
        "d": (random_prompt(13, seed=604), greedy(8)),  # waiting (max_num_seqs) during the failure
    }
    kw = dict(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    ref = run_alone(tiny_engine(tiny_qwen2_path, **kw), [(k, *v) for k, v in requests.items()])

    engine = tiny_engine(tiny_qwen2_path, **kw)
    collector = Collector()
    for rid in ("a", "b"):
        engine.add_request(rid, *requests[rid])
    for _ in range(3):
        collector.feed(engine.step())
    for rid in ("c", "d"):
        engine.add_request(rid, *requests[rid])

    model = engine.executor.runner.model
    real_forward = model.forward
    calls = []
    schedules = record_schedules(engine)

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)
    outputs = engine.step()
    scheduled = {it.request.request_id for it in schedules[-1].scheduled}
    assert scheduled == {"a", "b", "c"}
    assert {o.request_id: o.finish_reason for o in outputs} == dict.fromkeys(scheduled, "error")
    assert all("injected failure" in o.error for o in outputs)
    collector.feed(outputs)

    drain(engine, collector)
    assert collector["d"].finish_reason == "length"
    assert collector["d"].token_ids == ref["d"].token_ids
    assert_no_leaks(engine)

    # The engine keeps serving: the same prompts again give the reference outputs.
    again = run_batch(engine, [(f"{k}2", *v) for k, v in requests.items()])
    for rid in requests:
        assert again[f"{rid}2"].token_ids == ref[rid].token_ids, rid
    assert len(calls) > 1
    assert_no_leaks(engine)


def test_a_grammar_mask_that_raises_fails_its_step_not_the_engine(tiny_qwen2_path):
    """The grammars' masks are filled inside the step's guard (EngineCore._execute): a
    matcher that raises (a grammar the library cannot roll back killed the engine thread)
    fails that step's requests, and the next ones run."""
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64)
    ref = run_alone(tiny_engine(tiny_qwen2_path, num_blocks=64),
                    [("later", random_prompt(9, seed=611), greedy(6))])  # fmt: skip

    class Raising:  # the structured-output manager, once
        calls = 0

        def fill_bitmask(self, sched):
            Raising.calls += 1
            if Raising.calls == 1:
                raise ValueError("cannot roll back 3 tokens: injected")

    engine.core.structured = Raising()
    engine.add_request("a", random_prompt(7, seed=610), greedy(6))
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
    assert "cannot roll back" in outputs[0].error
    engine.add_request("later", random_prompt(9, seed=611), greedy(6))
    assert drain(engine).choices["later"][0].token_ids == ref["later"].token_ids
    assert_no_leaks(engine)


def test_an_output_that_raises_fails_its_request_not_the_engine(tiny_qwen2_path, monkeypatch):
    """The output processor raising for one request (a validator's OverflowError killed the
    engine thread) ends that request as an error — the scheduler frees its blocks — and
    the batch's other request goes on to the tokens it has alone."""
    requests = [("a", random_prompt(7, seed=620), greedy(8)),
                ("b", random_prompt(11, seed=621), greedy(8))]  # fmt: skip
    ref = run_alone(tiny_engine(tiny_qwen2_path, num_blocks=64), requests)
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64)
    proc = engine.output_processor
    real, calls = proc._token_output, []

    def raising(parent, req, runner_out, stops):
        calls.append(req.request_id)
        if req.request_id.startswith("a") and calls.count(req.request_id) == 3:
            raise OverflowError("injected")
        return real(parent, req, runner_out, stops)

    monkeypatch.setattr(proc, "_token_output", raising)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out = drain(engine).choices
    assert out["a"][0].finish_reason == "error" and "OverflowError" in out["a"][0].error
    assert out["b"][0].token_ids == ref["b"].token_ids
    assert_no_leaks(engine)

"""Scheduler: budgets, iteration-level joins, chunked prefill, preemption, aborts, stops."""

from __future__ import annotations

import itertools
import subprocess
import sys

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.engine.scheduler import Scheduler
from tinyserve.outputs import ModelRunnerOutput, SchedulerOutput
from tinyserve.request import Request, RequestStatus
from tinyserve.sampling_params import SamplingParams

EOS = 2
_fresh_tokens = itertools.count(100)  # int prompts never share a prefix by accident


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    **kwargs,
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        **kwargs,
    )
    kv = KVCacheManager(num_blocks, block_size, CacheConfig().enable_prefix_caching)
    return Scheduler(sched_cfg, kv)


def make_request(rid: str, prompt: list[int] | int, max_model_len: int = 64, **params) -> Request:
    if isinstance(prompt, int):
        prompt = [next(_fresh_tokens) for _ in range(prompt)]
    params.setdefault("max_tokens", 16)
    return Request(
        rid, prompt, SamplingParams(**params), eos_token_ids=(EOS,), max_model_len=max_model_len
    )


class FakeRunner:
    """Samples a token for each request that catches up this step: scripted, else 1000+."""

    def __init__(self, scripts: dict[str, list[int]] | None = None):
        self.scripts = {k: list(v) for k, v in (scripts or {}).items()}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                rid = s.request.request_id
                script = self.scripts.get(rid)
                sampled[rid] = [script.pop(0) if script else 1000 + s.request.num_output_tokens]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def step(sched: Scheduler, runner: FakeRunner | None = None):
    out = sched.schedule()
    changed = sched.update_from_output(out, (runner or FakeRunner()).execute(out)).requests
    return out, changed


def shares(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.req_to_blocks == {}


# -- budgets -------------------------------------------------------------------------------


def test_admission_under_token_budget_chunks_the_last():
    sched = make_scheduler(max_num_batched_tokens=10)
    for rid in "abc":
        sched.add_request(make_request(rid, 4))
    out = sched.schedule()
    assert shares(out) == {"a": 4, "b": 4, "c": 2}
    assert [s.samples for s in out.scheduled] == [True, True, False]
    assert sched.num_running == 3 and sched.num_waiting == 0


def test_admission_without_chunked_prefill_stops_at_first_misfit():
    sched = make_scheduler(
        max_num_batched_tokens=10, max_model_len=10, enable_chunked_prefill=False
    )
    for rid in "abcd":
        sched.add_request(make_request(rid, [7, 8] if rid == "d" else 4, max_model_len=10))
    out = sched.schedule()
    assert shares(out) == {"a": 4, "b": 4}  # c does not fit whole; d may not skip it
    assert [r.request_id for r in sched.waiting] == ["c", "d"]


def test_admission_under_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    out, _ = step(sched)
    assert shares(out) == {"a": 3, "b": 3}
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, _ = step(sched)
    assert shares(out) == {"a": 1, "b": 1}


def test_new_request_joins_at_next_step_while_others_decode():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    out, changed = step(sched)
    assert shares(out) == {"a": 5} and [r.request_id for r in changed] == ["a"]
    out, _ = step(sched)
    assert shares(out) == {"a": 1}
    sched.add_request(make_request("b", 6))
    out, changed = step(sched)
    assert shares(out) == {"a": 1, "b": 6}
    assert {r.request_id for r in changed} == {"a", "b"}
    a = sched.requests["a"]
    assert a.num_output_tokens == 3 and a.num_computed_tokens == a.num_tokens - 1


def test_long_prompt_is_chunked_while_decodes_advance():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 20))
    plan = []
    for _ in range(4):
        out = sched.schedule()
        plan.append((shares(out), [s.samples for s in out.scheduled]))  # before the update
        sched.update_from_output(out, FakeRunner().execute(out))
    assert plan == [
        ({"a": 3, "b": 5}, [True, False]),
        ({"a": 1, "b": 7}, [True, False]),
        ({"a": 1, "b": 7}, [True, False]),
        ({"a": 1, "b": 1}, [True, True]),
    ]
    b = sched.requests["b"]
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1
    assert sched.requests["a"].num_output_tokens == 4


# -- preemption ----------------------------------------------------------------------------


def test_preempts_latest_admitted_to_front_of_waiting():
    # 6 blocks of 2 tokens; three 3-token prompts take 2 blocks each.
    sched = make_scheduler(num_blocks=6, block_size=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    step(sched)  # prefill: 3 tokens + 1 sampled each
    step(sched)  # decode: 4 computed + 1 sampled each; all 6 blocks used
    sched.add_request(make_request("d", 2))
    out, _ = step(sched)  # a needs a 3rd block: c goes
    assert out.preempted_request_ids == ["c"]
    assert shares(out) == {"a": 1, "b": 1}  # no admissions in a step that preempted
    c = sched.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert "c" not in sched.kv_cache_manager.req_to_blocks


def test_last_running_request_preempts_itself():
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("x", 3))
    sched.add_request(make_request("y", 4))
    step(sched)  # x: 2 blocks for 3 tokens, y: 2 blocks for 4 tokens
    out, _ = step(sched)  # x fits its 4th token; y needs a 3rd block and is the last
    assert out.preempted_request_ids == ["y"]
    assert shares(out) == {"x": 1}
    assert [r.request_id for r in sched.waiting] == ["y"]
    assert sched.num_preemptions == 1


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    sched.add_request(make_request("a", 3, max_tokens=4))
    sched.add_request(make_request("b", 3, max_tokens=4))
    step(sched)
    step(sched)
    first_block = sched.kv_cache_manager.blocks[sched.kv_cache_manager.req_to_blocks["b"][0]]
    out, _ = step(sched)
    assert out.preempted_request_ids == ["b"]
    b = sched.requests["b"]
    assert b.output_token_ids == [1000, 1001] and first_block.token_ids == tuple(
        b.all_token_ids[:2]
    )
    while "a" in sched.requests:
        step(sched)
    out = sched.schedule()
    # Re-admitted as a prefill of prompt + outputs (5 tokens); its first block is still cached.
    (s,) = out.scheduled
    assert s.request is b and s.samples
    assert s.num_new_tokens == 3 and s.block_ids[0] == first_block.block_id
    sched.update_from_output(out, FakeRunner().execute(out))
    assert b.output_token_ids == [1000, 1001, 1002] and b.num_computed_tokens == 5
    assert b.num_cached_tokens == 0  # recorded on first admission only


# -- aborts --------------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_everything():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    step(sched)
    assert sched.abort_request("b")  # waiting
    assert sched.abort_request("a")  # running
    assert not sched.abort_request("a") and not sched.abort_request("zzz")
    assert sched.num_running == sched.num_waiting == 0 and not sched.has_unfinished()
    assert_all_blocks_free(sched)
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["b", "a"]
    assert sched.schedule().finished_request_ids == []


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert sched.abort_request("b")
    assert sched.requests.keys() == {"a"} and not sched.waiting
    sched.abort_request("a")
    assert_all_blocks_free(sched)


def test_abort_between_schedule_and_update_is_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    out = sched.schedule()
    result = FakeRunner().execute(out)
    assert sched.abort_request("a")
    changed = sched.update_from_output(out, result).requests
    a = out.scheduled[0].request
    assert [r.request_id for r in changed] == ["b"]
    assert a.status is RequestStatus.FINISHED_ABORTED and a.output_token_ids == []
    sched.abort_request("b")
    assert_all_blocks_free(sched)


# -- static policy -------------------------------------------------------------------------


def test_static_policy_waits_for_the_gang():
    sched = make_scheduler(policy="static")
    sched.add_request(make_request("a", 3, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=3))
    out, _ = step(sched)
    assert shares(out) == {"a": 3, "b": 3}
    assert sched.requests.get("a") is None  # finished after one token
    sched.add_request(make_request("c", 3))
    out, _ = step(sched)
    assert shares(out) == {"b": 1}  # c waits although there is room
    out, _ = step(sched)
    assert shares(out) == {"b": 1} and "b" not in sched.requests
    out, _ = step(sched)
    assert shares(out) == {"c": 3}


# -- stop checks ---------------------------------------------------------------------------


def run_to_end(sched: Scheduler, runner: FakeRunner) -> None:
    for _ in range(100):
        if not sched.has_unfinished():
            return
        step(sched, runner)
    raise AssertionError("did not finish")


def test_stops():
    sched = make_scheduler()
    cases = {
        "eos": ({}, [5, EOS, 6]),
        "ignore_eos": ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 6, 7]),
        "min_tokens": ({"min_tokens": 2}, [EOS, EOS]),
        "stop_id": ({"stop_token_ids": [9]}, [5, 9, 6]),
        "max_tokens": ({"max_tokens": 2}, [5, 6, 7]),
    }
    requests = {}
    for rid, (params, _) in cases.items():
        requests[rid] = make_request(rid, 3, **params)
        sched.add_request(requests[rid])
    requests["ctx"] = make_request("ctx", 3, max_model_len=5, max_tokens=None)
    sched.add_request(requests["ctx"])
    run_to_end(sched, FakeRunner({rid: script for rid, (_, script) in cases.items()}))

    def result(rid):
        r = requests[rid]
        return r.output_token_ids, r.status, r.stop_reason

    stopped, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
    assert result("eos") == ([5, EOS], stopped, None)
    assert result("ignore_eos") == ([5, EOS, 6], length, None)
    assert result("min_tokens") == ([EOS, EOS], stopped, None)
    assert result("stop_id") == ([5, 9], stopped, 9)
    assert result("max_tokens") == ([5, 6], length, None)
    assert result("ctx")[1:] == (length, None) and requests["ctx"].num_tokens == 5
    assert_all_blocks_free(sched)


def test_finished_requests_reported_and_freed():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=1))
    out, changed = step(sched)
    assert changed[0].status is RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(sched)
    assert sched.schedule().finished_request_ids == ["a"]


def test_finish_request_for_stop_strings():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    step(sched)
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished()
    assert_all_blocks_free(sched)


# -- prefix cache and capacity -------------------------------------------------------------


def test_prefix_hits_at_admission_including_same_step():
    sched = make_scheduler(block_size=4)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))
    out = sched.schedule()
    # b hits a's blocks registered earlier in this very step.
    assert shares(out) == {"a": 10, "b": 2}
    b = sched.requests["b"]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert out.scheduled[1].block_ids[:2] == out.scheduled[0].block_ids[:2]


def test_request_too_long_for_the_whole_cache_fails():
    sched = make_scheduler(num_blocks=2, block_size=2)
    sched.add_request(make_request("big", 5))
    sched.add_request(make_request("ok", 3, max_tokens=1))
    out, changed = step(sched)
    assert [r.request_id for r in changed] == ["big", "ok"]
    assert changed[0].status is RequestStatus.FINISHED_ERROR and changed[0].error
    assert shares(out) == {"ok": 3}
    assert_all_blocks_free(sched)


def test_no_torch_import():
    code = (
        "import sys\n"
        "import tinyserve.engine.kv_cache_manager, tinyserve.engine.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_prefix_cache_lookups_count_once_per_admission_not_per_attempt():
    """A request blocked at the head of the queue (no free blocks) is looked up every step;
    it used to be counted as a query (and its hits as hits) every time."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    kv = sched.kv_cache_manager
    shared = [next(_fresh_tokens) for _ in range(8)]
    sched.add_request(make_request("a", shared + [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2))
    step(sched)  # a: 17 tokens -> 5 of the 6 blocks
    sched.add_request(make_request("b", shared + [9, 9, 9, 9, 9], max_tokens=2))
    before = (kv.prefix_cache_queries, kv.prefix_cache_hits)
    for _ in range(3):  # b (2 cached blocks + 2 new) does not fit while a runs
        out, _ = step(sched)
        if "b" in shares(out):
            break
        assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == before
    while "b" not in shares(out):
        out, _ = step(sched)
    assert kv.prefix_cache_queries - before[0] == 13  # b's tokens, once
    assert kv.prefix_cache_hits - before[1] == 8  # its two shared blocks, once


def _priced(sched: Scheduler, per_token_ms: float) -> None:
    """A step-cost model that measured a machine where a step of n tokens costs
    (5 + per_token_ms * n) ms (not the fake steps' own microseconds)."""
    from tinyserve.spec_decode.cost import StepCostModel

    sched.step_cost = StepCostModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        for _ in range(8):
            sched.step_cost.observe(n, (5.0 + per_token_ms * n) / 1000)


def test_decode_step_bound_caps_prompt_chunks_while_requests_decode():
    from tinyserve.engine.scheduler import MIN_PROMPT_CHUNK

    sched = make_scheduler(
        num_blocks=256, max_num_batched_tokens=128, max_model_len=256, max_decode_step_ms=40.0
    )
    _priced(sched, per_token_ms=0.5)  # 40 ms: 70 tokens a step
    # Nothing decodes yet: a prompt takes the whole budget.
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    out, _ = step(sched)
    assert shares(out) == {"a": 8, "b": 8}
    # a and b now decode; a long prompt arrives: its chunks keep the step within 40 ms.
    sched.add_request(make_request("long", 200, max_model_len=256))
    for _ in range(2):  # two chunks of ~68 of the 200
        _priced(sched, per_token_ms=0.5)
        out = sched.schedule()
        got = shares(out)
        assert got["a"] == got["b"] == 1
        rows = got["long"] + 2  # beside the two decode rows: the most the bound allows
        cost = sched.step_cost
        assert cost.estimate(rows) <= 0.040 < cost.estimate(rows + 1)
        assert 60 <= rows <= 80  # ~70: 5 + 0.5 * 70 = 40 ms
        sched.update_from_output(out, FakeRunner().execute(out))
    # A machine twice as slow per token: shorter chunks, never below MIN_PROMPT_CHUNK.
    _priced(sched, per_token_ms=4.0)
    assert shares(step(sched)[0])["long"] == MIN_PROMPT_CHUNK


def test_without_the_bound_or_a_measurement_prompts_take_the_whole_budget():
    for bound, priced in ((None, True), (40.0, False)):
        sched = make_scheduler(
            num_blocks=256, max_num_batched_tokens=128, max_model_len=256,
            max_decode_step_ms=bound,
        )  # fmt: skip
        sched.add_request(make_request("a", 8))
        step(sched)
        if priced:
            _priced(sched, per_token_ms=0.5)
        else:
            sched.step_cost = type(sched.step_cost)()  # forget the first step: nothing known
        sched.add_request(make_request("long", 200, max_model_len=256))
        assert shares(sched.schedule()) == {"a": 1, "long": 127}


def test_decode_step_bound_is_checked():
    import pytest

    with pytest.raises(ValueError, match="max_decode_step_ms"):
        SchedulerConfig(max_decode_step_ms=0)

"""Speculative steps in the bare scheduler (no model): drafts scheduled as extra query
tokens within the budget, the computed count moved back over rejected drafts, the blocks
past the tokens freed, nothing kept past a stop inside an accepted run, no draft hashed."""

from __future__ import annotations

import dataclasses

from tinyserve.config import SchedulerConfig
from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.engine.scheduler import Scheduler
from tinyserve.outputs import ModelRunnerOutput
from tinyserve.request import Request, RequestStatus
from tinyserve.sampling_params import SamplingParams
from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.proposer import NgramProposer

EOS = 2
PROMPT = [10, 11, 12, 13, 14, 15, 10, 11]  # suffix [10, 11] -> drafts 12, 13, 14, 15


def _scheduler(k=4, budget=64, num_blocks=64):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=k))
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), proposer)


def _request(**params) -> Request:
    params.setdefault("max_tokens", 20)
    return Request("a", list(PROMPT), SamplingParams(**params), eos_token_ids=(EOS,),
                   max_model_len=64)  # fmt: skip


def _prefilled(sched, req):
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == []  # prefill: no drafts
    sched.update_from_output(out, ModelRunnerOutput({"a": [12]}))  # tokens ... 10, 11, 12
    return req


def test_drafts_are_extra_query_tokens_and_rejected_ones_roll_back():
    sched = _scheduler()
    req = _prefilled(sched, _request())
    out = sched.schedule()
    item = out.scheduled[0]
    assert item.spec_token_ids == [13, 14, 15, 10]  # what followed 10 11 12 in the prompt
    assert item.num_new_tokens == 5 and item.samples
    before = req.num_computed_tokens
    # Two drafts kept, then a correction token.
    runner_out = ModelRunnerOutput({"a": [13, 14, 99]})
    sched.update_from_output(out, runner_out)
    assert req.output_token_ids == [12, 13, 14, 99]
    assert req.num_computed_tokens == before + 3  # the last token + 2 kept drafts
    kv = sched.kv_cache_manager
    assert len(kv.req_to_blocks["a"]) == -(-req.num_tokens // 4)  # nothing past the tokens
    for i, block_id in enumerate(kv.req_to_blocks["a"]):
        tokens = kv.blocks[block_id].token_ids
        if tokens is not None:
            assert list(tokens) == req.all_token_ids[i * 4 : (i + 1) * 4]
            assert (i + 1) * 4 <= req.num_computed_tokens
    assert sched.proposer.stats.num_drafts == 1 and sched.proposer.stats.num_accepted_tokens == 2


def test_a_stop_inside_an_accepted_run_keeps_nothing_after_it():
    sched = _scheduler()
    req = _prefilled(sched, _request())
    out = sched.schedule()
    runner_out = ModelRunnerOutput({"a": [13, EOS]})  # draft 14 rejected, EOS sampled
    sched.update_from_output(out, runner_out)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [12, 13, EOS]
    runner_out = ModelRunnerOutput({"a": [13, 14, 15, 10, 77]})
    sched = _scheduler()
    req = _prefilled(sched, _request(stop_token_ids=[14]))
    update = sched.update_from_output(sched.schedule(), runner_out)
    assert req.output_token_ids == [12, 13, 14] and req.stop_reason == 14
    assert update.new_token_ids["a"] == [13, 14]  # what the API will see
    assert runner_out.sampled_token_ids["a"] == [13, 14, 15, 10, 77]  # handed on, not rewritten
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_drafts_fit_the_budget_and_max_tokens():
    sched = _scheduler()
    req = _prefilled(sched, _request())
    sched.scheduler_config = dataclasses.replace(sched.scheduler_config, max_num_batched_tokens=3)
    assert sched.schedule().scheduled[0].spec_token_ids == [13, 14]  # 1 + 2 = the budget
    sched = _scheduler()
    req = _prefilled(sched, _request(max_tokens=3))
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [13]  # 1 output so far, room for 1 + bonus
    sched.update_from_output(out, ModelRunnerOutput({"a": [13, 14]}))
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 3


def test_each_step_is_timed_by_its_rows_unless_it_failed():
    sched = _scheduler()
    req = _prefilled(sched, _request())
    assert sched.proposer.cost.measured_rows == (len(PROMPT),)  # the prefill step
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({"a": [13, 99]}))
    assert sched.proposer.cost.measured_rows == (5, len(PROMPT))  # 1 + 4 drafts
    out = sched.schedule()
    # A failed step: the engine finishes its requests before the update; nothing is timed.
    sched.finish_request("a", RequestStatus.FINISHED_ERROR)
    sched.update_from_output(out, ModelRunnerOutput())
    assert sched.proposer.cost.measured_rows == (5, len(PROMPT)) and req.is_finished

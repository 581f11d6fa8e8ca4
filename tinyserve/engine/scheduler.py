"""Scheduler: which requests run each step and with how many tokens (vLLM v1 style).

Plain Python, no torch. There are no prefill/decode phases: each request's
``num_computed_tokens`` catches up to its ``num_tokens``, a chunk at a time while prefilling,
one token a step while decoding; both may share a step.

Ownership: the scheduler owns Request objects from ``add_request`` until they finish. It
takes blocks for them from the KVCacheManager in ``schedule`` and gives all of them back
when a request finishes (``update_from_output``, ``finish_request``, ``abort_request``) or is
preempted.
"""

from __future__ import annotations

import time
from collections import deque

from tinyserve.config import SchedulerConfig
from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.outputs import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerUpdate,
)
from tinyserve.request import Request, RequestStatus
from tinyserve.spec_decode.cost import StepCostModel
from tinyserve.spec_decode.proposer import NgramProposer

# The fewest prompt tokens a step takes under the decode-step bound: prompts always advance.
MIN_PROMPT_CHUNK = 32


class Scheduler:
    """Iteration-level scheduling under ``max_num_batched_tokens`` / ``max_num_seqs``.

    Each step: running requests first, in admission order; when one cannot get a block, the
    most recently admitted running request is preempted by recompute (blocks freed, back to
    the front of ``waiting``). Then, if nothing was preempted, waiting requests are admitted
    FCFS, with their prefix-cache hits, until one does not fit. ``policy='static'`` admits only
    when nothing is running, so a batch (gang) runs until all of it finishes.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        proposer: NgramProposer | None = None,
    ):
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        # Speculative decoding (spec_decode/proposer.py): drafts for decoding requests.
        self.proposer = proposer
        # What a step of n scheduled tokens costs here (the speculation policy's model, when
        # speculating), for max_decode_step_ms.
        self.step_cost = proposer.cost if proposer is not None else StepCostModel()
        self._step_started = 0.0  # perf_counter at the last schedule()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Every unfinished request, waiting or running.
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Prompt tokens computed (a recompute after preemption counts again), tokens sampled.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Ids that left since the last schedule(): reported in the next SchedulerOutput.
        self._finished_request_ids: list[str] = []
        # Failed in schedule() (can never fit the KV cache): returned by the next update.
        self._failed_in_schedule: list[Request] = []

    # -- queue state -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts and allocate their blocks.

        ``ScheduledRequest.block_ids`` is each request's whole block table; the request's
        ``num_computed_tokens`` is advanced only in ``update_from_output``.
        """
        budget = self.scheduler_config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        self._step_started = time.perf_counter()
        if self.proposer is not None:
            self.proposer.begin_step(self.running, budget)
        prompt_budget = self._prompt_budget(budget)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            prefilling = request.num_tokens - request.num_computed_tokens > 1  # or recomputing
            if prefilling:
                num_new = min(num_new, prompt_budget)
            if num_new <= 0:
                index += 1
                continue
            drafts = self._drafts(request, num_new, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(drafts))
            if block_ids is None and drafts:  # drafts never cost another request its blocks
                drafts = []
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if block_ids is None:
                break  # the request was itself the last one: nothing after it runs
            num_new += len(drafts)
            groups = self.kv_cache_manager.group_block_ids(request.request_id)
            scheduled.append(ScheduledRequest(request, num_new, block_ids, drafts, groups))
            budget -= num_new
            prompt_budget -= num_new if prefilling else 0
            index += 1

        if not preempted and self._may_admit():
            self._admit_waiting(min(budget, prompt_budget), scheduled)

        finished, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(
            scheduled=scheduled, preempted_request_ids=preempted, finished_request_ids=finished
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> SchedulerUpdate:
        """Advance the scheduled requests, append sampled tokens, run the stop checks.

        With speculative decoding a request may get several tokens; those past a stop are
        dropped (the update's ``new_token_ids`` say what was kept). Returns the requests
        that got a new token or finished this step, plus any that
        ``schedule()`` failed (too long for the whole KV cache), so the engine must call this
        after every ``schedule()``, even an empty one. Requests that finished or were aborted
        since ``schedule()`` are skipped.
        """
        changed = self._failed_in_schedule
        self._failed_in_schedule = []
        kept_ids: dict[str, list[int]] = {}
        ran = False  # a failed step's requests are all finished before this: nothing ran
        for item in scheduler_output.scheduled:
            request = item.request
            if self.requests.get(request.request_id) is not request or request.is_finished:
                continue
            ran = True
            done = request.num_computed_tokens
            self.prompt_tokens_total += max(
                0, min(done + item.num_new_tokens, request.num_prompt_tokens) - done
            )
            request.num_computed_tokens += item.num_new_tokens
            request.prompt_logprobs.extend(
                runner_output.prompt_logprobs.get(request.request_id, ())
            )
            token_ids = runner_output.sampled_token_ids.get(request.request_id)
            if not token_ids:
                continue
            if request.max_tokens == 0:  # scoring the prompt: done once it is computed
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                kept_ids[request.request_id] = []
                changed.append(request)
                continue
            if item.spec_token_ids:
                self._verified(request, item, len(token_ids) - 1)
            kept = self._append(request, token_ids)
            # A stop inside a speculative run: the tokens after it never were (a copy only then).
            kept_ids[request.request_id] = token_ids if kept == len(token_ids) else token_ids[:kept]
            if item.spec_token_ids and not request.is_finished:
                self.kv_cache_manager.trim(request)
            changed.append(request)
        if ran:  # the step's cost (spec_decode/cost.py): schedule() to here
            elapsed = time.perf_counter() - self._step_started
            self.step_cost.observe(scheduler_output.num_batched_tokens, elapsed)
        return SchedulerUpdate(changed, kept_ids)

    def _prompt_budget(self, budget: int) -> int:
        """Prompt tokens this step may take: all of ``budget``, but while some request
        decodes and ``max_decode_step_ms`` is set, only as many as keep the step's estimated
        time within it beside the decoding rows (at least MIN_PROMPT_CHUNK). Speculative
        drafts, planned against the whole budget, are not subtracted: with speculation on a
        step may exceed the bound by its draft rows."""
        bound = self.scheduler_config.max_decode_step_ms
        if bound is None:
            return budget
        decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        if decoding == 0:
            return budget
        rows = self.step_cost.max_rows_within(bound / 1000.0, budget)
        if rows is None:  # nothing measured yet
            return budget
        return max(MIN_PROMPT_CHUNK, rows - decoding)

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Speculative drafts for a request that decodes one token this step, or []: not
        for the last token of a prompt chunk (its drafts would run as prompt rows, whose
        kernel path differs from decode rows' with int8 decode activations)."""
        if self.proposer is None or num_new != 1 or request.num_output_tokens == 0:
            return []
        return self.proposer.drafts(request, budget, len(self.running))

    def _verified(self, request: Request, item: ScheduledRequest, num_accepted: int) -> None:
        """Rejected drafts' K/V is not kept: the computed count moves back over them."""
        num_drafted = len(item.spec_token_ids)
        request.num_computed_tokens -= num_drafted - num_accepted
        self.proposer.record(request.request_id, num_drafted, num_accepted)

    def _append(self, request: Request, token_ids: list[int]) -> int:
        """Append the step's tokens one at a time with the stop checks after each: nothing
        past a stop (or a token the grammar rejects) is kept. Returns how many were kept."""
        for kept, token_id in enumerate(token_ids, start=1):
            request.append_output_token(token_id)
            self.generation_tokens_total += 1
            if request.grammar is not None and not request.grammar.accept_tokens([token_id]):
                self._grammar_failed(request, token_id)
                self._finish(request, RequestStatus.FINISHED_ERROR)
                return kept
            status = check_stop(request, token_id)
            if status is not None:
                self._finish(request, status)
                return kept
        return len(token_ids)

    @staticmethod
    def _grammar_failed(request: Request, token_id: int) -> None:
        """Why the grammar took no more. The library may refuse a token its own mask allowed
        when the grammar outgrows a parser limit (over 2,000 Earley items in a row: a Lark
        rule of thousands of alternatives): the request's fault, a 400 naming its field."""
        why = request.grammar.error()
        if not why:
            request.error = f"the grammar rejected token {token_id}"
            return
        field = request.sampling_params.structured_outputs.field
        first_line = why.strip().splitlines()[0]
        request.error = f"{field}: the grammar is too complex for the parser: {first_line}"
        if first_line.startswith("NoExtension"):  # the lexer found no token that could follow
            request.error = (f"{field}: the grammar allows nothing after this point (a part no "
                             "value satisfies, e.g. a $ref that refers only to itself)")  # fmt: skip
        elif "ff_tokens" in first_line:  # the forced tokens never end: no finite value fits
            request.error = (f"{field}: the grammar forces tokens without end (no finite value "
                             "satisfies it, e.g. a required property whose schema refers back "
                             f"to its object): {first_line}")  # fmt: skip
        request.error_param = field

    # -- leaving early -----------------------------------------------------------------------

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request wherever it is (stop strings, errors, aborts); frees all its blocks.
        Returns False for an unknown (or already finished) id."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status)
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # -- internals ---------------------------------------------------------------------------

    def _may_admit(self) -> bool:
        return self.scheduler_config.policy != "static" or not self.running

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests FCFS (no skipping). Returns the budget left."""
        kv = self.kv_cache_manager
        max_num_seqs = self.scheduler_config.max_num_seqs
        max_chunk = self.scheduler_config.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[0]
            if kv.blocks_to_hold(request.num_tokens, max_chunk) > kv.num_total_blocks:
                # Would wait forever at the head of the queue: fail it instead.
                request.error = (
                    f"request needs {request.num_tokens} tokens of KV cache; only "
                    f"{kv.num_total_blocks * kv.block_size} exist"
                )
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self._failed_in_schedule.append(request)
                continue
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            if request.needs_prompt_logprobs:  # a cached position has no logits
                computed_blocks, num_hit_tokens = [], 0
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not self.scheduler_config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            request.num_computed_tokens = num_hit_tokens
            block_ids = kv.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.running.append(request)
            kv.record_prefix_lookup(request, len(computed_blocks))
            if request.num_preemptions == 0:  # first admission (a recompute hits its own blocks)
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            groups = kv.group_block_ids(request.request_id)
            scheduled.append(ScheduledRequest(request, num_new, block_ids, [], groups))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: the caller has taken ``request`` out of ``running``."""
        self.kv_cache_manager.cache_computed(request)  # (its recompute hits them)
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Take ``request`` out of wherever it is and give back all its blocks."""
        # Only the queue it is in: scanning a long waiting queue for every finished request
        # would make draining N queued requests O(N^2).
        running = request.status == RequestStatus.RUNNING
        _remove_identical(self.running if running else self.waiting, request)
        request.status = status
        self.kv_cache_manager.cache_computed(request)
        self.kv_cache_manager.free(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)


def _remove_identical(queue: list[Request] | deque[Request], request: Request) -> None:
    # By identity: Request is a dataclass, so == would compare every field.
    for i, item in enumerate(queue):
        if item is request:
            del queue[i]
            return


def check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """Stop checks after ``token_id`` was appended. Stop strings are the detokenizer's job."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED  # the grammar is complete (its EOS included)
    if (
        request.num_output_tokens >= request.max_tokens
        or request.num_tokens >= request.max_model_len
    ):
        return RequestStatus.FINISHED_LENGTH
    return None

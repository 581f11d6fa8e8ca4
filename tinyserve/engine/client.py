"""The seams around the engine, as typed protocols, and the errors that cross them. No torch.

* ``EngineClient``: what the HTTP layer (entrypoints/) may use. ``AsyncEngine`` implements
  it; nothing in entrypoints/ reaches behind it.
* ``SyncEngine``: what ``AsyncEngine``'s engine thread drives. ``LLMEngine`` implements it,
  and so does the tests' fake engine (tests/support/fake_engine.py), which is how the
  failure paths of the async front are tested without a model.

The HTTP layer maps exactly these errors to statuses: ``ValueError`` (bad input) -> 400,
``QueueFullError`` -> 429, ``EngineDeadError`` -> 503, ``RequestFailedError`` -> 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tinyserve.outputs import StepOutput
from tinyserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served any more."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the group cannot run another step."""


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queued_requests``; the client should retry later."""


class RequestFailedError(RuntimeError):
    """An internal failure of one request (``finish_reason == "error"``)."""


class RequestRejectedError(RequestFailedError):
    """A request that failed by its own fault mid-answer (its grammar outgrew a parser limit):
    a 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Speculative decoding's counters (spec_decode/proposer.py SpecDecodeStats), or None.
    spec_decode: object | None = None
    # Steps run so far (EngineCore.num_steps): the live engine view's snapshots carry the same.
    num_steps: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What the front needs to know about the loaded model, fixed at start-up."""

    model_name: str
    model_path: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    max_num_seqs: int
    tensor_parallel_size: int = 1


@dataclass
class RequestTiming:
    """Per-request timing (``time.monotonic()`` seconds), for metrics and the finish log."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


class RequestStatsListener(Protocol):
    """Receives timing events on the event-loop thread (the metrics module implements it)."""

    def observe_ttft(self, seconds: float) -> None: ...

    def observe_inter_token_latency(self, seconds: float) -> None: ...

    def observe_finished(self, timing: RequestTiming) -> None: ...


@runtime_checkable
class SyncEngine(Protocol):
    """The synchronous engine one thread steps (``LLMEngine``, or a fake in the tests)."""

    tokenizer: Any
    info: EngineInfo

    def validate_request(self, prompts: list[list[int]], params: SamplingParams) -> None: ...

    def add_request(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated: bool = False,
    ) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def compile_grammar(self, params: SamplingParams) -> Future | None: ...

    def warm_up(self) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...

    def watch(self, on: bool) -> None:
        """Start / stop recording each step for the live engine view (off: no extra work)."""

    def snapshot(self, take_steps: bool = True) -> dict:
        """The live engine view's snapshot (engine/engine_view.py has the format)."""

    def health_problem(self) -> str | None: ...

    def close(self) -> None: ...


class OutputStream(Protocol):
    """One request's outputs (every choice, tagged by ``StepOutput.index``)."""

    def __aiter__(self) -> AsyncIterator[StepOutput]: ...

    def abort(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP layer sees it (``AsyncEngine``)."""

    tokenizer: Any
    info: EngineInfo

    @property
    def is_healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    async def prepare(self, params: SamplingParams) -> None: ...

    def add_request(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> OutputStream: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

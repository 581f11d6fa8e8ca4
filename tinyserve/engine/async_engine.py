"""AsyncEngine: the asyncio front of the synchronous LLMEngine, with ONE engine thread.

Threads and ownership:

* The event-loop thread calls ``add_request`` / ``generate`` / ``abort``. It never touches the
  scheduler or the model: it validates (``SyncEngine.validate_request`` is read-only), then puts
  an add/abort command on a thread-safe inbox and sets the wake-up event.
* The engine thread is the only caller of ``LLMEngine.add_request / abort / step / stats``. It
  drains the inbox at every step boundary, runs ``step()`` while there is work and sleeps on
  the event when idle. Each step's outputs go back to the loop in one
  ``loop.call_soon_threadsafe`` call, into each request's own ``asyncio.Queue``.
* A consumer that stops early (client disconnect, cancelled task) aborts its request; the
  engine thread applies the abort before the next step, which frees the request's blocks.
* An exception escaping ``step()`` kills the engine thread: every pending request gets an
  ``EngineDeadError`` and ``is_healthy`` turns False; new requests are refused.
* The live engine view (``view_feed``, view_feed.py): unwatched, the engine thread only
  reads a watcher count after each step; watched, it builds snapshots between steps.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tinyserve.engine.client import (
    EngineDeadError,
    EngineStats,
    QueueFullError,
    RequestFailedError,
    RequestStatsListener,
    RequestTiming,
    SyncEngine,
)
from tinyserve.engine.output_processor import as_prompts
from tinyserve.engine.structured_output import fresh_error
from tinyserve.engine.view_feed import ViewFeed
from tinyserve.outputs import StepOutput
from tinyserve.sampling_params import SamplingParams
from tinyserve.utils.threads import start_thread

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestFailedError"]


@dataclass
class _RequestState:
    """Loop-side bookkeeping of one request (all its choices)."""

    queue: asyncio.Queue
    num_seqs: int  # prompts x n: the sequences it adds to the engine
    timing: RequestTiming
    last_token_time: dict[int, float] = field(default_factory=dict)
    output_tokens: dict[int, int] = field(default_factory=dict)


ENGINE_STACK_BYTES = 64 << 20
_END = object()  # queue sentinel: every sample of the request has finished


class RequestStream:
    """Async iterator over one request's StepOutputs (every choice, tagged by ``index``).

    Ends after the output marked ``request_finished``. Stopping early (``aclose``, cancellation,
    breaking out of ``async for`` followed by ``abort``) aborts the request in the engine.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, state: _RequestState) -> None:
        self.request_id = request_id
        self._engine = engine
        self._state = state
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._state.queue.get()
        except BaseException:  # cancelled while waiting: the client is gone
            self.abort()
            raise
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished. Idempotent, never raises."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


class AsyncEngine:
    """Owns a SyncEngine (an LLMEngine) and the one thread that steps it; implements
    ``engine.client.EngineClient``. See the module docstring."""

    def __init__(
        self,
        engine: SyncEngine,
        max_queued_requests: int = 256,
        stats_listener: RequestStatsListener | None = None,
    ) -> None:
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.stats_listener = stats_listener
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.info.max_num_seqs
        self._inbox: collections.deque[tuple] = collections.deque()  # append/popleft are atomic
        self._wakeup = threading.Event()
        self._stop, self._stop_reason = False, "the engine was shut down"
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[str, _RequestState] = {}  # loop thread only
        self._num_seqs_in_flight = 0  # loop thread only: sum of n over _requests
        self._dead: BaseException | None = None
        self._stats: EngineStats = engine.stats()
        # The live engine view's watchers (GET /v1/engine/events): view_feed.py.
        self.view_feed = ViewFeed(engine, self._post, self._call_in_loop)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self.engine.warm_up()
        # A 64 MiB stack (address space; pages are used as it grows): the engine thread runs
        # the grammar library's matchers, which recurse over the grammar (structured/sandbox.py).
        self._thread = start_thread(self._run, "tinyserve-engine", ENGINE_STACK_BYTES)

    def shutdown(self, timeout: float = 10.0, reason: str = "the engine was shut down") -> None:
        """Stop the engine thread after its current step. Pending requests get EngineDeadError
        (``reason``, unless the engine already died of something else)."""
        self._stop_reason = reason  # before _stop: the engine thread reads it once stopping
        self._stop = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        alive = self._dead is None and self._thread is not None and self._thread.is_alive()
        return alive and self._engine_problem() is None

    @property
    def dead_reason(self) -> str | None:
        if self._dead is None:
            return self._engine_problem()
        return f"{type(self._dead).__name__}: {self._dead}"

    def _engine_problem(self) -> str | None:
        """What the engine itself reports (a dead tensor-parallel worker), or None."""
        return self.engine.health_problem()

    # -- the loop-thread API ------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._requests)

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step boundary (a snapshot; safe from any thread)."""
        return self._stats

    async def prepare(self, params: SamplingParams) -> None:
        """Await what must happen before a request is added, off the loop and the engine
        thread: compiling a constrained request's grammar (ValueError for a bad spec)."""
        future = self.engine.compile_grammar(params)
        if future is not None:
            wrapped = asyncio.wrap_future(future)
            await asyncio.wait([wrapped])
            if (error := wrapped.exception()) is not None:  # read, never re-raised
                raise fresh_error(error)
            params.compiled_grammar = wrapped.result()  # kept: the cache may evict it

    def add_request(
        self, request_id: str, prompts: list[list[int]] | list[int], params: SamplingParams
    ) -> RequestStream:
        """Validate and enqueue a request (one prompt's token ids, or a list of prompts, each
        sampled ``params.n`` times); raises at once, before anything streams: ValueError for
        bad input, QueueFullError, EngineDeadError."""
        if self._loop is None:
            raise EngineDeadError("the engine is not started")
        if not self.is_healthy:
            raise EngineDeadError(f"the engine has stopped ({self.dead_reason or 'shut down'})")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompts = as_prompts(prompts)
        self.engine.validate_request(prompts, params)
        num_seqs = len(prompts) * params.n
        # Up to max_num_seqs sequences run; beyond that at most max_queued_requests wait. A
        # request larger than both together would be refused forever: a 400, not a 429.
        if num_seqs > self.max_num_seqs + self.max_queued_requests:
            raise ValueError(
                f"n: the request asks for {num_seqs} sequences ({len(prompts)} prompts x n = "
                f"{params.n}); this server takes at most "
                f"{self.max_num_seqs + self.max_queued_requests} at once (--max-num-seqs "
                f"{self.max_num_seqs} + --max-queued-requests {self.max_queued_requests})"
            )
        waiting = max(0, self._num_seqs_in_flight + num_seqs - self.max_num_seqs)
        if waiting > self.max_queued_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_queued_requests} requests); retry later"
            )
        now = time.monotonic()
        num_prompt_tokens = sum(len(p) for p in prompts)
        state = _RequestState(
            queue=asyncio.Queue(),
            num_seqs=num_seqs,
            timing=RequestTiming(request_id, now, num_prompt_tokens=num_prompt_tokens),
        )
        self._requests[request_id] = state
        self._num_seqs_in_flight += num_seqs
        self._inbox.append(("add", request_id, prompts, params, now))
        self._wakeup.set()
        return RequestStream(self, request_id, state)

    async def generate(
        self, request_id: str, prompts: list[list[int]] | list[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Stream a request's outputs. Errors in the input raise on the first ``__anext__``;
        a consumer that stops early (GeneratorExit / CancelledError) aborts the request."""
        stream = self.add_request(request_id, prompts, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request from the loop thread; its blocks are freed at the next step boundary."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._num_seqs_in_flight -= state.num_seqs
        self._finish_timing(state, "abort")
        state.queue.put_nowait(_END)
        self._inbox.append(("abort", request_id))
        self._wakeup.set()

    # -- loop-side delivery ---------------------------------------------------------------------

    def _deliver(self, now: float, outputs: list[StepOutput]) -> None:
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:  # aborted while the step ran
                continue
            self._record(state, out, now)
            state.queue.put_nowait(out)
            if out.request_finished:
                del self._requests[out.request_id]
                self._num_seqs_in_flight -= state.num_seqs
                self._finish_timing(state, out.finish_reason)
                state.queue.put_nowait(_END)

    def _record(self, state: _RequestState, out: StepOutput, now: float) -> None:
        timing = state.timing
        timing.num_prompt_tokens = out.num_prompt_tokens or timing.num_prompt_tokens
        if not out.new_token_ids:
            return
        state.output_tokens[out.index] = out.num_output_tokens
        listener = self.stats_listener
        if timing.first_token_time is None:
            timing.first_token_time = now
            if listener is not None:
                listener.observe_ttft(now - timing.arrival_time)
        last = state.last_token_time.get(out.index)
        if last is not None and listener is not None:
            listener.observe_inter_token_latency(now - last)
        state.last_token_time[out.index] = now

    def _finish_timing(self, state: _RequestState, reason: str | None) -> None:
        timing = state.timing
        timing.finished_time = time.monotonic()
        timing.finish_reason = reason
        timing.num_output_tokens = sum(state.output_tokens.values())
        ttft = timing.ttft
        logger.info(
            "request %s finished (%s): prompt %d tokens, output %d tokens, TTFT %s, total %.3fs",
            timing.request_id,
            reason,
            timing.num_prompt_tokens,
            timing.num_output_tokens,
            "-" if ttft is None else f"{ttft:.3f}s",
            timing.e2e or 0.0,
        )
        if self.stats_listener is not None:
            self.stats_listener.observe_finished(timing)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._num_seqs_in_flight -= state.num_seqs
            self._finish_timing(state, "error")
            state.queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        self.view_feed.end()
        for state in self._requests.values():
            state.queue.put_nowait(error)
        self._requests.clear()
        self._num_seqs_in_flight = 0

    # -- the engine thread ------------------------------------------------------------------------

    def _call_in_loop(self, fn: Callable, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us (shutdown)
            pass

    def _post(self, cmd: tuple) -> None:
        self._inbox.append(cmd)
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        engine = self.engine
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] in ("watch", "snapshot"):
                self.view_feed.on_command(cmd)
            elif cmd[0] == "add":
                _, rid, prompt, params, arrival = cmd
                try:
                    engine.add_request(rid, prompt, params, arrival_time=arrival, validated=True)
                except ValueError as e:  # e.g. a duplicate id
                    self._call_in_loop(self._fail_request, rid, RequestFailedError(str(e)))
            else:
                engine.abort(cmd[1])

    def _run(self) -> None:
        engine = self.engine
        # With worker processes, wake up now and then to notice one dying while idle.
        poll = 0.5 if engine.info.tensor_parallel_size > 1 else None
        try:
            while not self._stop:
                self._wakeup.clear()
                self._drain_inbox()
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    if self.view_feed.num_watchers:
                        self.view_feed.on_idle()
                    self._wakeup.wait(poll)  # idle: sleep until add/abort/shutdown sets it
                    # While busy, step() checks the workers itself; idle, we do.
                    if (problem := self._engine_problem()) is not None:
                        raise RuntimeError(problem)
                    continue
                outputs = engine.step()
                now = time.monotonic()
                self._stats = engine.stats()
                if outputs:
                    self._call_in_loop(self._deliver, now, outputs)
                if self.view_feed.num_watchers:  # the live view: nothing at all unwatched
                    self.view_feed.after_step()
        except BaseException as e:  # noqa: BLE001 - any escape kills the engine; report it
            logger.exception("engine thread died; failing every pending request")
            self._dead = e
            self._call_in_loop(self._fail_all, EngineDeadError(f"the engine has stopped: {e}"))
            self._close_engine()
            return
        self._dead = self._dead or EngineDeadError(self._stop_reason)
        self._call_in_loop(self._fail_all, EngineDeadError(self._stop_reason))
        self._close_engine()

    def _close_engine(self) -> None:
        """Release what the engine holds outside this process (tensor-parallel workers)."""
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("closing the engine failed")

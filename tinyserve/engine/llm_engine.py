"""LLMEngine: an EngineCore (scheduler + executor) and an OutputProcessor (text, stop strings,
n > 1 fan-out, usage). ``step()`` is core step -> process outputs -> finish stop strings.

Not thread-safe: exactly one thread calls add_request / abort / step (the AsyncEngine's
engine thread, or the offline LLM's caller). Implements ``engine.client.SyncEngine``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.client import EngineInfo, EngineStats
from tinyserve.engine.core import EngineCore
from tinyserve.engine.output_processor import OutputProcessor, as_prompts
from tinyserve.engine.structured_output import StructuredOutputManager
from tinyserve.outputs import StepOutput
from tinyserve.request import RequestStatus
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker.executor import Executor

logger = logging.getLogger(__name__)

_LOAD = object()  # tokenizer argument: load the executor's source's tokenizer


class LLMEngine:
    """``executor`` / ``tokenizer``: pass already built ones (tests share one model's weights
    between engines); by default both are loaded from ``args``."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        executor: Executor | None = None,
        tokenizer=_LOAD,
        **kwargs,
    ) -> None:
        self.args = args = dataclasses.replace(args or EngineArgs(), **kwargs)
        self.config = args.create_configs()
        self.executor = executor if executor is not None else Executor(self.config)
        try:
            if tokenizer is _LOAD:
                from tinyserve.models.loader import load_tokenizer

                tokenizer = load_tokenizer(self.executor.source) if args.load_tokenizer else None
        except BaseException:
            self.executor.close()
            raise
        self.tokenizer = tokenizer
        config = self.executor.model_config
        eos = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self.structured = StructuredOutputManager(tokenizer, config.vocab_size, self.eos_token_ids)
        self.core = EngineCore(self.executor, self.config, self.structured)
        self.max_model_len = self.executor.max_model_len
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        source = self.executor.source
        self.info = EngineInfo(
            model_name=source.name,
            model_path=str(source.path),
            vocab_size=config.vocab_size,
            max_model_len=self.max_model_len,
            kv_capacity_tokens=self.executor.kv_capacity_tokens,
            max_num_seqs=args.max_num_seqs,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        logger.info(
            "engine ready in %.1fs: %s",
            time.monotonic() - self.executor.t0,
            self.executor.describe(),
        )

    # -- what callers read ---------------------------------------------------------------------

    @property
    def model_config(self):
        return self.executor.model_config

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def scheduler(self):
        return self.core.scheduler

    def health_problem(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker died), or None."""
        return self.executor.health_problem()

    def close(self) -> None:
        """Release the tensor-parallel workers, if any. Idempotent."""
        self.executor.close()

    # -- requests ------------------------------------------------------------------------------

    def validate_request(
        self, prompts: list[int] | list[list[int]], params: SamplingParams
    ) -> None:
        """Raise ValueError (message names the field) for anything the engine cannot serve.
        Read-only: the async front runs it on the event loop."""
        prompts = as_prompts(prompts)
        for prompt in prompts:
            self._validate_token_ids(prompt)
        params.validate_for_model(self.vocab_size)
        for prompt in prompts:
            self._validate_length(len(prompt), params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this engine has none")
        self.structured.validate(params)

    def _validate_token_ids(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is outside [0, {self.vocab_size})")

    def _validate_length(self, n: int, params: SamplingParams) -> None:
        if n > self.max_model_len or (n == self.max_model_len and params.max_tokens != 0):
            raise ValueError(
                f"prompt: {n} tokens leave no room for output in the context window of "
                f"{self.max_model_len} tokens"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds the context window of {self.max_model_len} tokens"
            )

    def add_request(
        self,
        request_id: str,
        prompts: list[int] | list[list[int]],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated: bool = False,
    ) -> None:
        """Add one request: a prompt (token ids) or several, each sampled ``params.n`` times.
        All or nothing: invalid input raises ValueError and leaves no trace.
        ``validated=True``: the caller already ran validate_request (the async front does, on
        the event loop), so the engine thread does not walk the prompts a second time."""
        prompts = as_prompts(prompts)
        if not validated:
            self.validate_request(prompts, params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        grammar = self.structured.compiled(params)  # before any state: all or nothing
        children = self.output_processor.add_request(request_id, prompts, params, now)
        self.structured.attach(grammar, children)
        self.core.add_requests(children)

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its choices) wherever it is; its blocks go back at once."""
        live = self.output_processor.abort(request_id)
        self.core.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        return bool(live)

    def warm_up(self) -> None:
        """Prepare what the first request of a kind would otherwise wait for (the grammar
        backend, built in the background)."""
        self.structured.warm_up()

    def compile_grammar(self, params: SamplingParams):
        """Start compiling a constrained request's grammar in the compile pool (thread-safe):
        a Future, or None when the request is unconstrained."""
        return self.structured.submit(params)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        view = self.core.view
        t0 = time.perf_counter() if view.watching else 0.0
        core_output = self.core.step()
        processed = self.output_processor.process(core_output.requests, core_output.runner_output)
        self.core.finish_requests(processed.stop_string_ids, RequestStatus.FINISHED_STOPPED)
        self.core.finish_requests(processed.failed_ids, RequestStatus.FINISHED_ERROR)
        if view.watching:
            view.end_step((time.perf_counter() - t0) * 1000.0)
        return processed.outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    # -- the live engine view (engine/engine_view.py) ------------------------------------------

    def watch(self, on: bool) -> None:
        self.core.view.watch(on)

    def snapshot(self, take_steps: bool = True) -> dict:
        return self.core.snapshot(take_steps)

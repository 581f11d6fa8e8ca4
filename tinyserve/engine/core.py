"""EngineCore: the scheduler and an executor. ``step()`` is schedule -> execute -> update.

Not thread-safe: one thread drives it (through ``LLMEngine``). Health checks and recovery
from a failed forward live in ``_check_health`` and ``_execute``, around the step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyserve.engine.arg_utils import EngineConfig
from tinyserve.engine.client import EngineStats, WorkerDiedError
from tinyserve.engine.engine_view import EngineView
from tinyserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.engine.scheduler import Scheduler
from tinyserve.engine.structured_output import StructuredOutputManager
from tinyserve.outputs import ModelRunnerOutput, SchedulerOutput, SchedulerUpdate
from tinyserve.request import Request, RequestStatus
from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.proposer import NgramProposer

if TYPE_CHECKING:  # the core stays torch-free: LLMEngine builds the executor and hands it in
    from tinyserve.config import CacheConfig
    from tinyserve.worker.executor import Executor

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """One step: the requests that got a token or finished, and what the runner sampled."""

    requests: list[Request] = field(default_factory=list)
    runner_output: ModelRunnerOutput = field(default_factory=ModelRunnerOutput)


def _core_output(
    failed: list[Request], update: SchedulerUpdate, runner_output: ModelRunnerOutput
) -> EngineCoreOutput:
    """Handed on, not rewritten: the tokens the scheduler kept, with the runner's logprobs."""
    kept = dataclasses.replace(runner_output, sampled_token_ids=update.new_token_ids)
    return EngineCoreOutput(failed + update.requests, kept)


def _kv_cache_manager(executor: Executor, cache: CacheConfig) -> KVCacheManager:
    if executor.kv_groups is None:
        manager = KVCacheManager(executor.num_blocks, cache.block_size,
                                 enable_prefix_caching=cache.enable_prefix_caching,
                                 sliding_window=executor.model_config.uniform_window)  # fmt: skip
    else:
        manager = HybridKVCacheManager(executor.num_blocks, cache.block_size, executor.kv_groups,
                                       enable_prefix_caching=cache.enable_prefix_caching)  # fmt: skip
    # int8 decode rows (--decode-activations int8): an output token's K/V is not what a later
    # prompt row computes for it, so sharing its blocks answered a hit and a miss differently.
    if executor.load.decode_activations == "int8":
        for m in getattr(manager, "groups", [manager]):
            m.cache_outputs = False
    return manager


class EngineCore:
    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.executor = executor
        self.structured = structured
        # The context window is known once the executor has sized the KV cache.
        self.scheduler_config = dataclasses.replace(
            config.scheduler, max_model_len=executor.max_model_len
        )
        # Blocks left of the window are released where every layer has the same window
        # (Mistral, Phi-3-mini); a model mixing windowed and full layers (Gemma 3) has a
        # table per layer group over one pool, the windowed groups' released as for those.
        self.kv_cache_manager = _kv_cache_manager(executor, config.cache)
        spec = config.speculative
        # On torch's attention (a dense checkpoint under --dtype bfloat16, or where --dtype
        # auto measured torch's bf16 the fastest) decode rows and a verified run take
        # different kernels (0.016 apart in a logprob there), and torch's GEMM (a layer the
        # kernels cannot take) blocks by the row count: speculation's default ("auto") stays
        # off, so that greedy answers cannot change; --speculative-config still turns it on.
        why = executor.torch_numerics if spec is not None and spec.by_default else None
        if why is not None:
            logger.info("speculative decoding off by default: %s, where a verified draft's "
                        "logits may differ from a decoded token's; --speculative-config turns "
                        "it on", why)  # fmt: skip
            spec = None
        # With speculation off only requests with a prediction draft (theirs).
        self.proposer = NgramProposer(spec or SpeculativeConfig(), ngram=spec is not None,
                                      fast_forward=config.grammar_fast_forward)  # fmt: skip
        self.speculative = spec is not None
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.proposer)
        self.num_steps = 0  # steps run: the live view's and /metrics' common clock
        self.view = EngineView(self.scheduler, self.kv_cache_manager)

    def add_requests(self, requests: list[Request]) -> None:
        for req in requests:
            self.scheduler.add_request(req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            self.scheduler.finish_request(rid, status)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutput:
        self._check_health()
        scheduler_output = self.scheduler.schedule()
        self.num_steps += 1
        if self.view.records is not None:  # watched (engine_view.py); else no extra work
            self.view.begin_step(self.num_steps, scheduler_output)
        runner_output, failed = self._execute(scheduler_output)
        update = self.scheduler.update_from_output(scheduler_output, runner_output)
        return _core_output(failed, update, runner_output)

    def _check_health(self) -> None:
        if (problem := self.executor.health_problem()) is not None:
            raise WorkerDiedError(problem)

    def _execute(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, list[Request]]:
        """Fill the grammars' masks and run the step. Either raising fails only this step's
        requests (returned, as FINISHED_ERROR), not the engine — except with tensor parallel,
        where the ranks may be out of step and the group cannot go on."""
        try:
            if self.structured is not None:
                self.structured.fill_bitmask(sched)
            return self.executor.execute(sched), []
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the engine
            if self.executor.distributed:
                raise
            logger.exception("step failed; failing its %d requests", len(sched.scheduled))
            failed = [item.request for item in sched.scheduled]
            for req in failed:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
                req.error = f"internal error: {type(e).__name__}: {e}"
            # Blocks hashed for this step may never have been written: drop every hash.
            self.kv_cache_manager.reset_prefix_cache()
            return ModelRunnerOutput(), failed

    def stats(self) -> EngineStats:
        kv, sched = self.kv_cache_manager, self.scheduler
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prompt_tokens_total=sched.prompt_tokens_total,
            generation_tokens_total=sched.generation_tokens_total,
            spec_decode=self.proposer.stats if self.speculative else None,
            num_steps=self.num_steps,
        )

    def snapshot(self, take_steps: bool = True) -> dict:
        """The live engine view's snapshot (engine_view.py): a plain dict, engine thread only."""
        spec = self.proposer.stats if self.speculative else None
        return self.view.snapshot(self.num_steps, take_steps, spec)

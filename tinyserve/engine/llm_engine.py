"""LLMEngine: the synchronous heart. ``step()`` reads as schedule -> execute -> update.

Not thread-safe: exactly one thread calls add_request / abort / step (the AsyncEngine's
engine thread, or the offline LLM's caller).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from dataclasses import dataclass

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.detokenizer import IncrementalDetokenizer
from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.engine.scheduler import Scheduler
from tinyserve.outputs import ModelRunnerOutput, SchedulerOutput, StepOutput
from tinyserve.request import Request, RequestStatus
from tinyserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


def _child_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index`` of an n>1 request draws from seed + index, wrapped into int64 (a seed
    near 2**63 - 1 is valid input; its children's seeds must be too)."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


def worker_spec(args: EngineArgs, dtype=None):
    """What a tensor-parallel worker rank needs from the engine's arguments."""
    from tinyserve.worker.tp_worker import WorkerSpec

    return WorkerSpec(
        model=args.model,
        dtype=str(dtype).replace("torch.", "") if dtype is not None else args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_kernels=args.cpu_kernels,
        quantization=args.quantization,
        decode_activations=args.decode_activations,
    )


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs) -> None:
        from tinyserve.distributed.parallel_state import TPGroup
        from tinyserve.worker.autotune import resolve_engine_dtype
        from tinyserve.worker.device import resolve_device

        args = dataclasses.replace(args or EngineArgs(), **kwargs)
        if args.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {args.tensor_parallel_size}")
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_engine_dtype(
            args.dtype, self.device, args.model, args.cpu_kernels, args.quantization
        )
        t0 = time.monotonic()
        self.tp_driver = (
            self._start_tensor_parallel(args, self.dtype) if args.tensor_parallel_size > 1 else None
        )
        tp = self.tp_driver.group if self.tp_driver else TPGroup(device=self.device)
        if self.tp_driver is not None:
            atexit.register(self.close)
        try:
            self._build(args, tp, t0)
        except BaseException:
            self.close()  # the workers wait for the block count: release them
            raise

    def _build(self, args: EngineArgs, tp, t0: float) -> None:
        from tinyserve.models.loader import load_model, load_tokenizer
        from tinyserve.worker.kv_cache import bytes_per_block, num_blocks_for
        from tinyserve.worker.model_runner import ModelRunner

        self.model, self.source = load_model(
            args.model,
            self.dtype,
            tp.device,
            max_position=args.max_model_len,
            tp=tp,
            cpu_kernels=args.cpu_kernels,
            quantization=args.quantization,
            decode_activations=args.decode_activations,
            fused_step=args.fused_step,
        )
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(self.source) if args.load_tokenizer else None
        cache_config = CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory=args.kv_cache_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        num_blocks = num_blocks_for(self.model_config, cache_config, self.dtype, tp.size)
        capacity = num_blocks * args.block_size
        max_model_len = self._resolve_max_model_len(args.max_model_len, capacity)
        self.max_model_len = max_model_len
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=args.scheduling_policy,
            enable_chunked_prefill=args.enable_chunked_prefill,
        )
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, cache_config, self.kv_cache_manager)
        tp.broadcast(num_blocks)  # the other ranks allocate the same number of blocks
        self.runner = ModelRunner(self.model, num_blocks, args.block_size, tp.device)
        tp.barrier()
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self.kv_capacity_tokens = capacity
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Parent id -> ids of its live child requests (a child knows its parent: parent_id).
        self._children: dict[str, list[str]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_scheduler_output: SchedulerOutput | None = None
        kv_bytes = num_blocks * bytes_per_block(
            self.model_config, args.block_size, self.dtype, tp.size
        )
        logger.info(
            "engine ready in %.1fs: %s on %s (%s), KV cache %d blocks x %d = %d tokens (%.0f MiB), "
            "max_model_len %d",
            time.monotonic() - t0,
            self.source.name,
            self.device,
            str(self.dtype).replace("torch.", ""),
            num_blocks,
            args.block_size,
            capacity,
            kv_bytes / 2**20,
            max_model_len,
        )

    @staticmethod
    def _start_tensor_parallel(args: EngineArgs, dtype):
        from tinyserve.distributed.parallel_state import check_tp_divisible
        from tinyserve.models.loader import load_model_config, resolve_model_source
        from tinyserve.worker.device import resolve_device
        from tinyserve.worker.tp_worker import start_tensor_parallel

        # A size that does not divide the heads fails here, before any process starts.
        config, _ = load_model_config(resolve_model_source(args.model))
        check_tp_divisible(config, args.tensor_parallel_size)
        return start_tensor_parallel(worker_spec(args, dtype), resolve_device(args.device))

    def health_problem(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker died), or None."""
        return self.tp_driver.health_problem() if self.tp_driver is not None else None

    def close(self) -> None:
        """Release the tensor-parallel workers (they exit) and the process group. Idempotent;
        a no-op without tensor parallel."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown(timeout=10.0)

    def _resolve_max_model_len(self, requested: int | None, capacity: int) -> int:
        model_max = self.model_config.max_position_embeddings
        if requested is not None:
            if requested > model_max:
                raise ValueError(
                    f"max_model_len ({requested}) is larger than the model's context "
                    f"({model_max} positions)"
                )
            if requested > capacity:
                raise ValueError(
                    f"max_model_len ({requested}) does not fit the KV cache ({capacity} tokens): "
                    "raise --kv-cache-memory / --num-blocks or lower --max-model-len"
                )
            return requested
        return min(model_max, capacity)

    # -- requests ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (message names the field) for anything the engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is outside [0, {self.vocab_size})")
        params.validate_for_model(self.vocab_size)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room for output in the context window of "
                f"{self.max_model_len} tokens"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds the context window of {self.max_model_len} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this engine has none")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated: bool = False,
    ) -> None:
        """``validated=True``: the caller already ran validate_request (the async front does,
        on the event loop), so the engine thread does not walk the prompt a second time."""
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not validated:
            self.validate_request(prompt_token_ids, params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [rid for rid in ids if rid in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in the engine")
        # Build every child first, add them after: a request is added whole or not at all.
        children = []
        for i, rid in enumerate(ids):
            child_params = params
            if params.n > 1:
                child_params = dataclasses.replace(params, n=1, seed=_child_seed(params.seed, i))
            req = Request(
                request_id=rid,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                arrival_time=now,
                parent_id=request_id,
                index=i,
            )
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, child_params)
            children.append((req, detok))
        for req, detok in children:
            if detok is not None:
                self._detokenizers[req.request_id] = detok
            self.scheduler.add_request(req)
        self._children[request_id] = ids

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its n samples) wherever it is; its blocks go back at once."""
        ids = self._children.pop(request_id, None)
        if ids is None:
            return False
        for rid in ids:
            self.scheduler.abort_request(rid)
            self._detokenizers.pop(rid, None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        if (problem := self.health_problem()) is not None:
            from tinyserve.worker.tp_worker import WorkerDiedError

            raise WorkerDiedError(problem)
        sched = self.scheduler.schedule()
        self.last_scheduler_output = sched
        outputs: list[StepOutput] = []
        try:
            runner_out = self.runner.execute(sched)
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the engine
            if self.tp_driver is not None:
                raise  # the ranks may be out of step: the group cannot go on
            logger.exception("step failed; failing its %d requests", len(sched.scheduled))
            runner_out = ModelRunnerOutput()
            for item in sched.scheduled:
                self.scheduler.finish_request(item.request.request_id, RequestStatus.FINISHED_ERROR)
                item.request.error = f"internal error: {type(e).__name__}: {e}"
            # Blocks hashed for this step may never have been written: drop every hash.
            self.kv_cache_manager.reset_prefix_cache()
            outputs.extend(self._error_output(item.request) for item in sched.scheduled)
        for item in sched.scheduled:  # prompt tokens computed this step (recomputes count again)
            req = item.request
            if not req.is_finished:
                end = min(req.num_computed_tokens + item.num_new_tokens, req.num_prompt_tokens)
                self.prompt_tokens_total += max(0, end - req.num_computed_tokens)
        changed = self.scheduler.update_from_output(sched, runner_out)
        self.generation_tokens_total += len(runner_out.sampled_token_ids)
        for req in changed:
            if req.status == RequestStatus.FINISHED_ERROR:
                outputs.append(self._error_output(req))
                continue
            outputs.append(self._make_output(req, runner_out))
        return outputs

    def _make_output(self, req: Request, runner_out: ModelRunnerOutput) -> StepOutput:
        rid = req.request_id
        token = runner_out.sampled_token_ids.get(rid)
        new_ids = [token] if token is not None else []
        text_delta = ""
        detok = self._detokenizers.get(rid)
        if detok is not None:
            text_delta, stop_str = detok.update(new_ids, finished=req.is_finished)
            if stop_str is not None and not req.is_finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop_str
            elif stop_str is not None:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        lp = runner_out.logprobs.get(rid)
        out = StepOutput(
            request_id=req.parent_id or rid,
            index=req.index,
            new_token_ids=new_ids,
            text_delta=text_delta,
            finish_reason=req.status.finish_reason if req.is_finished else None,
            logprobs=[lp] if lp is not None else [],
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason,
        )
        if req.is_finished:
            self._forget(req)
        return out

    def _error_output(self, req: Request) -> StepOutput:
        self._forget(req)
        return StepOutput(
            request_id=req.parent_id or req.request_id,
            index=req.index,
            new_token_ids=[],
            text_delta="",
            finish_reason="error",
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            error=req.error or "internal error",
        )

    def _forget(self, req: Request) -> None:
        """Drop a finished child's per-request state; the parent goes with its last child."""
        self._detokenizers.pop(req.request_id, None)
        live = self._children.get(req.parent_id)
        if live is not None and req.request_id in live:
            live.remove(req.request_id)
            if not live:
                del self._children[req.parent_id]

    # -- observability -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

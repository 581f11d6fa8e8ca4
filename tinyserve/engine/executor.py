"""Executor: the model side of the engine — device and dtype, model loading, KV-cache sizing,
tensor-parallel start-up and workers, and the model runner that executes a step.

``EngineCore`` receives one. Tests build a real one over a tiny model (and may hand it an
already loaded model, so one set of weights serves many engines).
"""

from __future__ import annotations

import atexit
import logging
import time

from tinyserve.config import CacheConfig, ModelConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


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
        kv_cache_dtype=args.kv_cache_dtype,
    )


def resolve_max_model_len(config: ModelConfig, requested: int | None, capacity: int) -> int:
    """The context window: the request's (checked) or the model's, capped by the KV cache."""
    model_max = config.max_position_embeddings
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


class Executor:
    """Owns the model, its KV cache and (with tensor parallel) the worker processes.

    ``loaded=(model, source)`` skips loading (the model must match ``args``' dtype/device).
    """

    def __init__(self, args: EngineArgs, loaded: tuple | None = None) -> None:
        from tinyserve.distributed.parallel_state import TPGroup
        from tinyserve.worker.autotune import resolve_engine_dtype
        from tinyserve.worker.device import resolve_device

        if args.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {args.tensor_parallel_size}")
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_engine_dtype(
            args.dtype, self.device, args.model, args.cpu_kernels, args.quantization,
            args.kernel_activations,
        )  # fmt: skip
        self.t0 = time.monotonic()
        self.tp_driver = _start_tensor_parallel(args, self.dtype) if self.distributed else None
        tp = self.tp_driver.group if self.tp_driver else TPGroup(device=self.device)
        if self.tp_driver is not None:
            atexit.register(self.close)
        try:
            self._build(args, tp, loaded)
        except BaseException:
            self.close()  # the workers wait for the block count: release them
            raise

    @property
    def distributed(self) -> bool:
        return self.args.tensor_parallel_size > 1

    def _build(self, args: EngineArgs, tp, loaded: tuple | None) -> None:
        from tinyserve.models.loader import load_model
        from tinyserve.worker.kv_cache import (
            bytes_per_block,
            num_blocks_for,
            resolve_kv_cache_dtype,
        )
        from tinyserve.worker.model_runner import ModelRunner

        if loaded is None:
            loaded = load_model(
                args.model,
                self.dtype,
                tp.device,
                max_position=args.max_model_len,
                tp=tp,
                cpu_kernels=args.cpu_kernels,
                quantization=args.quantization,
                decode_activations=args.decode_activations,
                fused_step=args.fused_step,
                kernel_activations=args.kernel_activations,
            )
        self.model, self.source = loaded
        self.model_config: ModelConfig = self.model.config
        cache_config = CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory=self._kv_budget(args, tp),
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.model)
        self.num_blocks = num_blocks_for(self.model_config, cache_config, self.kv_dtype, tp.size)
        self.block_size = args.block_size
        self.kv_capacity_tokens = self.num_blocks * args.block_size
        self.max_model_len = resolve_max_model_len(
            self.model_config, args.max_model_len, self.kv_capacity_tokens
        )
        tp.broadcast(self.num_blocks)  # the other ranks allocate the same number of blocks
        self.runner = ModelRunner(
            self.model, self.num_blocks, args.block_size, tp.device,
            decode_graphs=decode_graphs_mode(tp.device, tp.size, args.enforce_eager),
            max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
            kv_dtype=self.kv_dtype,
        )  # fmt: skip
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.capture()
        tp.barrier()
        self.kv_cache_bytes = self.num_blocks * bytes_per_block(
            self.model_config, args.block_size, self.kv_dtype, tp.size
        )

    def _kv_budget(self, args: EngineArgs, tp) -> int:
        """--kv-cache-memory, else 1 GiB (CPU, MPS) or, on CUDA, what a profiling forward of
        the largest step leaves of --gpu-memory-utilization (worker/memory.py; also the
        warm-up). With --num-blocks given the budget is unused."""
        from tinyserve.worker import memory

        given = args.kv_cache_bytes
        if tp.device.type != "cuda":
            return given if given is not None else memory.DEFAULT_KV_CACHE_BYTES
        try:
            budget = memory.cuda_kv_budget(
                self.model, tp.device, args.block_size, args.max_num_batched_tokens,
                args.max_num_seqs, args.gpu_memory_utilization,
            )  # fmt: skip
        except ValueError:
            if given is None and args.num_blocks is None:
                raise
            budget = memory.DEFAULT_KV_CACHE_BYTES  # unused: the flags size the cache
        return given if given is not None else budget

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def health_problem(self) -> str | None:
        """Why the executor cannot step any more (a tensor-parallel worker died), or None."""
        return self.tp_driver.health_problem() if self.tp_driver is not None else None

    def close(self) -> None:
        """Release the tensor-parallel workers (they exit) and the process group, in at most
        ~10 s even after a failed step left a rank inside a collective. Idempotent; a no-op
        without tensor parallel."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown(timeout=10.0)

    def describe(self) -> str:
        """The start-up log line's model part."""
        return (
            f"{self.source.name} on {self.device} ({str(self.dtype).replace('torch.', '')}), "
            f"KV cache {self.num_blocks} blocks x {self.block_size} = {self.kv_capacity_tokens} "
            f"tokens ({self.kv_cache_bytes / 2**20:.0f} MiB), max_model_len {self.max_model_len}"
        )


def decode_graphs_mode(device, tp_size: int, enforce_eager: bool) -> str:
    """CUDA graphs for pure-decode steps on CUDA without tensor parallel, unless
    --enforce-eager (worker/decode_graphs.py); elsewhere the eager path. (Tests replace this
    to run the fixed-buffer path on a CPU, uncaptured.)"""
    if device.type == "cuda" and tp_size == 1 and not enforce_eager:
        return "capture"
    return "off"


def _start_tensor_parallel(args: EngineArgs, dtype):
    from tinyserve.distributed.parallel_state import check_tp_divisible
    from tinyserve.models.loader import load_model_config, resolve_model_source
    from tinyserve.worker.device import resolve_device
    from tinyserve.worker.tp_worker import start_tensor_parallel

    # A size that does not divide the heads fails here, before any process starts.
    config, _ = load_model_config(resolve_model_source(args.model))
    check_tp_divisible(config, args.tensor_parallel_size)
    return start_tensor_parallel(worker_spec(args, dtype), resolve_device(args.device))

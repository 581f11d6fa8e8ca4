"""Executor: the model side of the engine — device and dtype, model loading, KV-cache sizing,
tensor-parallel start-up and workers, and the model runner that executes a step.

``EngineCore`` receives one. It is built from the engine's configs (``EngineArgs.
create_configs()``: anything with ``load``, ``cache``, ``parallel`` and ``scheduler``);
tests build a real one over a tiny model (and may hand it an already loaded model, so one
set of weights serves many engines).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from typing import Protocol

import torch

from tinyserve.config import (
    CacheConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    window_live_blocks,
)
from tinyserve.distributed.parallel_state import TPGroup, check_tp_divisible
from tinyserve.layers.linear import on_torch
from tinyserve.models.loader import (
    load_model_config,
    load_shard,
    numerics_path,
    resolve_model_source,
)
from tinyserve.outputs import ModelRunnerOutput, SchedulerOutput
from tinyserve.utils.kv_groups import kv_groups
from tinyserve.worker import memory
from tinyserve.worker.autotune import resolve_engine_dtype
from tinyserve.worker.device import resolve_device
from tinyserve.worker.kv_cache import bytes_per_block, num_blocks_for, resolve_kv_cache_dtype
from tinyserve.worker.model_runner import ModelRunner
from tinyserve.worker.tp_worker import TPDriver, start_tensor_parallel

logger = logging.getLogger(__name__)


class ExecutorConfig(Protocol):
    """What the executor reads of the engine's configs (engine/arg_utils.py EngineConfig)."""

    load: LoadConfig
    cache: CacheConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig


def resolve_max_model_len(
    config: ModelConfig,
    requested: int | None,
    capacity: int,
    max_chunk: int = 0,
    block_size: int = 16,
) -> int:
    """The context window: the request's (checked) or the model's, capped by the KV cache
    (``capacity`` tokens) unless every layer has the same window and the most blocks one
    request holds at once in steps of ``max_chunk`` tokens (config.window_live_blocks) fit:
    its blocks left of the window are released as it moves on, so it may outgrow the pool."""
    model_max, what = config.max_position_embeddings, "context"
    window = config.uniform_window
    if (
        window
        and max_chunk
        and window_live_blocks(window, max_chunk, block_size) * block_size <= capacity
    ):
        capacity = model_max
    if requested is not None:
        if requested > model_max:
            raise ValueError(
                f"max_model_len ({requested}) is larger than the model's {what} "
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

    ``loaded=(model, source)`` skips loading (the model must match the configs' dtype/device).
    """

    def __init__(self, config: ExecutorConfig, loaded: tuple | None = None) -> None:
        load, self.parallel = config.load, config.parallel
        self.device = resolve_device(load.device)
        # bf16 weights chosen by auto: one process only (the ranks are told the dtype alone)
        self.dtype, quantization = resolve_engine_dtype(
            load.dtype, self.device, load.model, load.cpu_kernels, load.quantization,
            load.kernel_activations, bf16_weights=not self.distributed,
        )  # fmt: skip
        # What every rank loads with: the resolved dtype, so the workers need not calibrate.
        dtype = str(self.dtype).replace("torch.", "")
        self.load = dataclasses.replace(load, dtype=dtype, quantization=quantization)
        self.t0 = time.monotonic()
        self.tp_driver = self._start_tensor_parallel(config.cache) if self.distributed else None
        tp = self.tp_driver.group if self.tp_driver else TPGroup(device=self.device)
        if self.tp_driver is not None:
            atexit.register(self.close)
        try:
            tp.broadcast(self.load.dtype)  # the other ranks load with it (tp_worker.worker_main)
            self._build(config, tp, loaded)
        except BaseException:
            self.close()  # the workers wait for the block count: release them
            raise

    @property
    def distributed(self) -> bool:
        return self.parallel.tensor_parallel_size > 1

    def _build(self, config: ExecutorConfig, tp: TPGroup, loaded: tuple | None) -> None:
        load, sched = self.load, config.scheduler
        self.model, self.source = loaded or load_shard(load, self.dtype, tp.device, tp)
        self.model_config: ModelConfig = self.model.config
        cache = dataclasses.replace(config.cache, kv_cache_memory=self._kv_budget(config, tp))
        self.kv_dtype = resolve_kv_cache_dtype(load.kv_cache_dtype, self.model)
        # A hybrid model's block is a page of one layer group (utils/kv_groups.py).
        self.num_blocks = num_blocks_for(self.model_config, cache, self.kv_dtype, tp.size)
        self.kv_groups = kv_groups(self.model_config)
        self.block_size = cache.block_size
        self.kv_capacity_tokens = self.num_blocks * cache.block_size
        if self.kv_groups is not None:  # the longest request the groups' tables fit
            chunk = sched.max_num_batched_tokens if sched.enable_chunked_prefill else 1 << 40
            self.kv_capacity_tokens = self.kv_groups.capacity_tokens(
                self.num_blocks, chunk, cache.block_size
            )
        self.max_model_len = resolve_max_model_len(
            self.model_config, load.max_model_len, self.kv_capacity_tokens,
            sched.max_num_batched_tokens if sched.enable_chunked_prefill else 0, self.block_size,
        )  # fmt: skip
        tp.broadcast(self.num_blocks)  # the other ranks allocate the same number of blocks
        self.runner = ModelRunner(
            self.model, self.num_blocks, cache.block_size, tp.device,
            decode_graphs=decode_graphs_mode(tp.device, tp.size, load.enforce_eager),
            max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len,
            kv_dtype=self.kv_dtype,
        )  # fmt: skip
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.capture()
        tp.barrier()
        self.rank_paths = tp.gather(numerics_path(self.model))  # what each rank computes with
        if any(path != self.rank_paths[0] for path in self.rank_paths):
            raise RuntimeError(f"tensor-parallel ranks run different numerics: {self.rank_paths}")
        self.kv_cache_bytes = self.num_blocks * bytes_per_block(
            self.model_config, cache.block_size, self.kv_dtype, tp.size
        )

    def _kv_budget(self, config: ExecutorConfig, tp: TPGroup) -> int:
        """--kv-cache-memory, else 1 GiB (CPU, MPS) or, on CUDA, what a profiling forward of
        the largest step leaves of --gpu-memory-utilization (worker/memory.py; also the
        warm-up). With --num-blocks given the budget is unused."""
        cache, sched = config.cache, config.scheduler
        given = cache.kv_cache_memory
        if tp.device.type != "cuda":
            return given if given is not None else memory.DEFAULT_KV_CACHE_BYTES
        try:
            budget = memory.cuda_kv_budget(
                self.model, tp.device, cache.block_size, sched.max_num_batched_tokens,
                sched.max_num_seqs, cache.gpu_memory_utilization,
            )  # fmt: skip
        except ValueError:
            if given is None and cache.num_blocks is None:
                raise
            budget = memory.DEFAULT_KV_CACHE_BYTES  # unused: the flags size the cache
        return given if given is not None else budget

    def _start_tensor_parallel(self, cache: CacheConfig) -> TPDriver:
        # A size that does not divide the heads fails here, before any process starts.
        config, _ = load_model_config(resolve_model_source(self.load.model))
        check_tp_divisible(config, self.parallel.tensor_parallel_size)
        return start_tensor_parallel(
            self.load, cache, self.parallel.tensor_parallel_size, self.device
        )

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

    @property
    def attention_backend(self) -> str:
        """The model's attention method: "kernel", "triton" or "torch"."""
        return self.runner.model.attention_backend

    @property
    def torch_numerics(self) -> str | None:
        """Why a token's logits may depend on its batch on this CPU, or None: attention on
        torch, or a linear layer on torch's GEMM (one the kernels cannot take: an input
        width not a multiple of 32). Not asked on a GPU."""
        if self.attention_backend == "torch":
            return "attention runs on torch here"
        if self.device.type != "cpu":
            return None
        dense = sum(map(on_torch, self.runner.model.linear_layers().values()))
        return f"{dense} linear layers run on torch's GEMM here" if dense else None

    def describe(self) -> str:
        """The start-up log line's model part."""
        return (
            f"{self.source.name} on {self.device} ({str(self.dtype).replace('torch.', '')}), "
            f"KV cache {self.num_blocks} blocks x {self.block_size}{self._pool()} "
            f"({self.kv_cache_bytes / 2**20:.0f} MiB), max_model_len {self.max_model_len}"
        )

    def _pool(self) -> str:
        g = self.kv_groups
        if g is None:
            return f" = {self.kv_capacity_tokens} tokens"
        windows = sum(w is not None for w in g.windows)
        layers = f"{g.size} layer" + "s" * (g.size > 1)
        return (f" tokens, pages of {layers} shared by {g.num_groups} layer groups "
                f"({windows} with window {self.model_config.sliding_window}): one request "
                f"up to {self.kv_capacity_tokens} tokens")  # fmt: skip


def decode_graphs_mode(device: torch.device, tp_size: int, enforce_eager: bool) -> str:
    """CUDA graphs for pure-decode steps on CUDA without tensor parallel, unless
    --enforce-eager (worker/decode_graphs.py); elsewhere the eager path. (Tests replace this
    to run the fixed-buffer path on a CPU, uncaptured.)"""
    if device.type == "cuda" and tp_size == 1 and not enforce_eager:
        return "capture"
    return "off"

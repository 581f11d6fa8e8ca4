"""Starting the tensor-parallel ranks, and the loop the non-driver ranks run.

Rank 0 is the engine's own process: it runs the scheduler and drives the other ranks through
its ModelRunner (one broadcast of the flat batch per step). Ranks 1..N-1 are either spawned
here with torch.multiprocessing (one host, ``tcp://127.0.0.1:<free port>`` rendezvous) or
started by ``torchrun`` (any number of hosts: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in the environment); either way they end up in :func:`worker_main`.

Start-up order, the same on every rank: join the group -> the driver broadcasts its
resolved dtype -> load this rank's shard -> the driver broadcasts the KV block count ->
allocate this rank's KV cache -> barrier -> steps. The dtype comes from the driver because
``--dtype auto`` on a CPU is measured (worker/autotune.py): ranks started together by
torchrun each measured it, each disturbed by the other, so nothing was trusted or cached
(90 s to start two ranks, at every start) and the ranks could choose differently.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from tinyserve.config import CacheConfig, LoadConfig
from tinyserve.distributed.parallel_state import TPGroup, cpu_threads_per_rank, init_tp_group
from tinyserve.kernels.build import set_kernel_threads
from tinyserve.models.loader import load_shard, numerics_path
from tinyserve.worker.device import resolve_device, resolve_dtype
from tinyserve.worker.kv_cache import resolve_kv_cache_dtype
from tinyserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _use_threads(n: int) -> None:
    """This rank's share of the cores, for torch's pool and for the CPU kernels."""
    torch.set_num_threads(n)
    set_kernel_threads(n)


def torchrun_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when started by torchrun (or another launcher that sets them)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One CUDA device per rank on a host (LOCAL_RANK under torchrun); CPU is shared."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


@dataclass
class TPDriver:
    """What rank 0 keeps: the group and, when it spawned them, the worker processes."""

    group: TPGroup
    processes: list = field(default_factory=list)
    closed: bool = False

    def health_problem(self) -> str | None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                return (
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited "
                    f"with code {p.exitcode}"
                )
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the other ranks and release the group in about ``timeout`` seconds at most,
        even when a failed step left them inside a collective (where a plain broadcast or
        join would wait for the group's 300 s timeout). Idempotent."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + timeout
        # The workers wait for a step (or, mid-start-up, the block count): None ends them.
        # Out of step after a failed step they never take it, so the wait is bounded.
        stopped = self.health_problem() is None and _bounded(
            self.group.broadcast, None, wait=0.3 * timeout
        )
        if not stopped:
            logger.warning("tensor-parallel workers did not take the stop: ending them")
        self._reap(deadline if stopped else time.monotonic())
        if not _bounded(self.group.destroy, wait=max(0.5, deadline - time.monotonic())):
            logger.warning("could not destroy the tensor-parallel process group in time")

    def _reap(self, deadline: float) -> None:
        """Let the spawned workers exit until ``deadline`` (less 2.5 s), then terminate,
        then kill, those still alive, a second each."""
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic() - 2.5))
        for stop in ("terminate", "kill"):
            alive = [p for p in self.processes if p.is_alive()]
            for p in alive:
                getattr(p, stop)()
            for p in alive:
                p.join(1.0)


def _bounded(fn, *args, wait: float) -> bool:
    """Run ``fn(*args)`` in a daemon thread and wait at most ``wait`` seconds: True when it
    returned (an exception counts as returned, and is logged), False when it is still stuck."""

    def target() -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a broken group: the workers are reaped anyway
            logger.warning("tensor-parallel shutdown: %s failed", fn.__name__, exc_info=True)

    thread = threading.Thread(target=target, name="tinyserve-tp-shutdown", daemon=True)
    thread.start()
    thread.join(wait)
    return not thread.is_alive()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(
    load: LoadConfig, cache: CacheConfig, size: int, device: torch.device
) -> TPDriver:
    """On rank 0: start (or, under torchrun, join) the other ranks, each given the driver's
    own ``load`` and ``cache`` configs; returns once all joined."""
    env = torchrun_rank()
    threads = cpu_threads_per_rank(size) if device.type == "cpu" else None
    if threads:
        _use_threads(threads)
    if env is not None:
        rank, world = env
        if world != size:
            raise ValueError(
                f"tensor_parallel_size is {size} but torchrun started WORLD_SIZE={world} ranks"
            )
        if rank != 0:
            raise RuntimeError("only rank 0 builds an engine; other ranks run worker_main()")
        return TPDriver(init_tp_group(0, size, rank_device(device, 0), "env://"))
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, size):
        p = ctx.Process(
            target=worker_main,
            args=(rank, size, init_method, load, cache, threads),
            name=f"tinyserve-tp{rank}",
            daemon=True,  # never outlive the engine process
        )
        p.start()
        processes.append(p)
    logger.info("tensor parallel: started %d worker processes (%s)", size - 1, init_method)
    return TPDriver(init_tp_group(0, size, rank_device(device, 0), init_method), processes)


def worker_main(
    rank: int,
    size: int,
    init_method: str,
    load: LoadConfig,
    cache: CacheConfig,
    threads: int | None = None,
) -> None:
    """A non-driver rank: load the shard, allocate the KV shard, run the driver's steps."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING)
    if threads:
        _use_threads(threads)
    base = resolve_device(load.device)
    device = rank_device(base, rank)
    group = init_tp_group(rank, size, device, init_method)
    try:
        dtype_name = group.broadcast()  # the driver's resolved dtype (see the module's doc)
        if dtype_name is None:  # the driver failed to start
            return
        model, _ = load_shard(load, resolve_dtype(dtype_name, base), device, group)
        num_blocks = group.broadcast()
        if num_blocks is None:  # the driver failed to start
            return
        kv_dtype = resolve_kv_cache_dtype(load.kv_cache_dtype, model)
        runner = ModelRunner(model, num_blocks, cache.block_size, device, kv_dtype=kv_dtype)
        group.barrier()
        group.gather(numerics_path(model))  # the driver checks it is its own
        runner.serve_driver()
    finally:
        group.destroy()


def run_torchrun_worker(load: LoadConfig, cache: CacheConfig, size: int) -> bool:
    """Under torchrun, ranks > 0 of ``serve`` / ``generate`` become workers: returns True
    after serving (the command then exits), False on rank 0 (which goes on to build the
    engine)."""
    env = torchrun_rank()
    if env is None or env[0] == 0 or size == 1:
        return False
    rank, world = env
    if world != size:
        raise SystemExit(f"--tensor-parallel-size {size} but WORLD_SIZE is {world}")
    # torchrun sets OMP_NUM_THREADS=1 unless the user chose; keep what it set. The dtype
    # comes from the driver.
    worker_main(rank, world, "env://", load, cache, None)
    return True

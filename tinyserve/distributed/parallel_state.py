"""The tensor-parallel group: who this process is, how many there are, and the two
collectives the engine uses (all-reduce of activations, broadcast of the step's inputs).

A ``TPGroup`` is passed to whatever needs it (the model, the model runner); nothing here is
module-global beyond what torch.distributed itself keeps per process.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch

from tinyserve.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class TPGroup:
    """Rank ``rank`` of ``size``. With ``size == 1`` every collective is a no-op."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_all_reduces: int = 0  # counted, so tests can check "two per layer"

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
            self.num_all_reduces += 1
        return x

    def broadcast(self, obj: object = None) -> object:
        """Rank 0 sends ``obj`` (picklable); every rank returns it."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        return box[0]

    def gather(self, obj: object) -> list | None:
        """Every rank sends ``obj`` (picklable); rank 0 returns them in rank order, the
        others None."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def destroy(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


def check_tp_divisible(config: ModelConfig, size: int) -> None:
    """Megatron sharding splits heads and the MLP width evenly: say which count does not divide."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in counts.items():
        if value % size != 0:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {name} ({value}); "
                f"choose a size that divides {', '.join(f'{k}={v}' for k, v in counts.items())}"
            )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tp_group(
    rank: int,
    size: int,
    device: torch.device,
    init_method: str = "env://",
    timeout_s: float = 300.0,
) -> TPGroup:
    """Join the process group (all ranks call this). ``init_method`` is ``tcp://host:port`` for
    workers the engine spawned, or ``env://`` (MASTER_ADDR/MASTER_PORT) under torchrun."""
    if size == 1:
        return TPGroup(0, 1, device)
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(device),
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    logger.debug("tensor-parallel rank %d/%d joined (%s)", rank, size, backend_for(device))
    return TPGroup(rank, size, device)


def cpu_threads_per_rank(size: int) -> int:
    """Split the CPU cores between the ranks on one host, so they do not oversubscribe it."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // size)

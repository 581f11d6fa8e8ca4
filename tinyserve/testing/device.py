"""The device the device-selected tests run on: ``TINYSERVE_TEST_DEVICE=cpu|cuda|cuda:N|mps``
(default cpu). Those tests (marked ``device``: model parity, batched = alone, prefix cache,
preemption, the sampler) run on it and skip, saying why, where it is absent; the rest of the
suite stays on the CPU. ``scripts/gpu_check.sh`` runs them with ``TINYSERVE_TEST_DEVICE=cuda``."""

from __future__ import annotations

import os

import torch

ENV = "TINYSERVE_TEST_DEVICE"


def device_under_test() -> str:
    name = os.environ.get(ENV, "cpu").strip() or "cpu"
    kind = name.split(":", 1)[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{ENV}={name!r}: use cpu, cuda, cuda:N or mps")
    return name


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot run here, or None."""
    kind = name.split(":", 1)[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            return f"{ENV}={name}: CUDA is not available on this machine"
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            return f"{ENV}={name}: only {torch.cuda.device_count()} CUDA device(s)"
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"{ENV}={name}: MPS is not available on this machine"
    return None

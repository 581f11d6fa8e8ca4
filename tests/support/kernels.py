"""Helpers for the kernel tests: random GGUF blocks, a built gemm's typed entry point, a
one-rank TP group."""

from __future__ import annotations

import ctypes

import numpy as np
from gguf.constants import GGMLQuantizationType

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


def random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF bytes for an [n, k] tensor with random scales and codes."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    if qtype == Q4_1:
        d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
        m = rng.uniform(-0.2, 0.0, (n, nb, 1)).astype(np.float16).view(np.uint8)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        return np.concatenate([d, m, qs], axis=-1).reshape(n, nb * 20)
    d = rng.uniform(0.001, 0.02, (n, nb, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, qs], axis=-1).reshape(n, nb * 34)


def typed(lib: ctypes.CDLL, name: str):
    """``lib``'s entry point ``name``, typed like gemm.py's."""
    fn = getattr(lib, name)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes, fn.restype = [i32, p, p, p, p, i64, p, i64, i64, i64, i32, i32], ctypes.c_int
    return fn


def tp1():
    from tinyserve.distributed.parallel_state import TPGroup

    return TPGroup()


def logits_gap(reference, model, tokens=tuple(range(3, 40)), steps: int = 20) -> float:
    """The largest logit difference of ``model`` from ``reference`` through a prefill of
    ``tokens`` and ``steps`` decode steps, relative to the reference's logit range."""
    from tinyserve.testing.paged_runner import PagedRunner

    a = PagedRunner(reference, 4, num_blocks=32).prefill_then_decode(list(tokens), steps)
    b = PagedRunner(model, 4, num_blocks=32).prefill_then_decode(list(tokens), steps)
    return float((a - b).abs().max() / (a.max() - a.min()))


def held_weight(layer):
    """The float32 weight a loaded layer computes with: its parameter, or — where the kernels
    hold the only copy (the loader frees its own) — the rows of the kernel's."""
    import torch

    from tinyserve.kernels.rows import kernel_rows

    kernel = getattr(layer, "rows_from", None) or getattr(
        getattr(layer, "method", None), "kernel", None
    )
    if layer.weight.numel() or kernel is None:
        return layer.weight.detach()
    return kernel_rows(kernel, torch.arange(kernel.shape[0]))

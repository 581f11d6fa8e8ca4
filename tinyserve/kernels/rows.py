"""Rows of a weight in gemm.c's layout (``gemm.KernelWeight``), as float32: a tied LM head's
kernel copy is the embedding table too, so the lookup reads its rows there and the table is
not held a second time (a Llama-3.2-1B's bf16 table: 0.53 GB; SmolLM2's float32 table beside
its Q8_0 blocks: 113 MB). ops.c's ``kernel_rows`` (a decode step's one row in ~microseconds,
where the torch ops below take ~40 us) and ``kernel_rows_reference``, what it must equal."""

from __future__ import annotations

import ctypes

import torch

from tinyserve.kernels import ops
from tinyserve.kernels.gemm import _KIND_IDS, BF16, F32, Q4_1, Q8_0, KernelWeight

KINDS = (BF16, F32, Q4_1, Q8_0)  # the kinds whose rows are read


def kernel_rows(w: KernelWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of the [N, K] weight as float32 [*ids.shape, K], as
    F.embedding gives a table's (an id outside [0, N): IndexError). See the reference."""
    lib = ops.library()
    if lib is None:
        return kernel_rows_reference(w, ids)
    if w.kind not in KINDS:
        raise ValueError(f"kernel_rows: no rows of {w.kind} weights")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, w.shape[1], dtype=torch.float32)
    ptr = [None if t is None else ctypes.c_void_p(t.data_ptr()) for t in (w.d, w.m)]
    rc = lib.kernel_rows(_KIND_IDS[w.kind], w.qs.data_ptr(), *ptr, w.shape[0], w.shape[1],
                         w.qs.shape[-1], flat.data_ptr(), flat.numel(), out.data_ptr())  # fmt: skip
    if rc:
        raise IndexError(f"kernel_rows: an id outside [0, {w.shape[0]})")
    return out


def kernel_rows_reference(w: KernelWeight, ids: torch.Tensor) -> torch.Tensor:
    """The values the loader's own copy held: bf16 and float32 as they are, Q8_0 ``d * q``,
    Q4_1 ``d * q + m`` (float32, two roundings: GGUF's dequantiser, PackedWeight.dequantize)."""
    if w.kind not in KINDS:
        raise ValueError(f"kernel_rows: no rows of {w.kind} weights")
    if ids.numel() and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise IndexError(f"kernel_rows: an id outside [0, {w.shape[0]})")
    shape, ids = ids.shape, ids.reshape(-1)
    return _reference_rows(w, ids).reshape(*shape, w.shape[1])


def _reference_rows(w: KernelWeight, ids: torch.Tensor) -> torch.Tensor:
    k = w.shape[1]
    gw = w.qs.shape[-1]
    g, lane = ids // gw, ids % gw
    if w.kind == F32:  # [G, K, W]
        return w.qs[g, :, lane]
    if w.kind == BF16:  # int32 words [G, K/32, 16, W]: weight p in the low half, p + 16 high
        halves = w.qs[g, :, :, lane].view(torch.int16).view(-1, k // 32, 16, 2)
        return halves.transpose(2, 3).reshape(-1, k).view(torch.bfloat16).float()
    d = w.d[g, :, lane][..., None]  # [T, K/32, 1]
    if w.kind == Q8_0:  # int8 [G, K/32, 32, W]
        return (w.qs[g, :, :, lane].float() * d).reshape(-1, k)
    b = w.qs[g, :, :, lane]  # Q4_1: uint8 [G, K/32, 16, W]: weight p low nibble, p + 16 high
    q = torch.cat([b & 15, b >> 4], dim=-1).float()
    return (q * d + w.m[g, :, lane][..., None]).reshape(-1, k)

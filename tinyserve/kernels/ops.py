"""Fused per-layer elementwise ops (ops.c): residual add + RMSNorm, and SiLU-and-mul, for
float32 CPU tensors. One pass each, rows computed alone (batch-invariant)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve.kernels.build import kernel_threads, load


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = load("ops")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.rms_norm.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, i32]
        lib.head_norm.argtypes = [p, p, p, i64, i32, i32, i32, ctypes.c_float, i32]
        lib.head_norm.restype = None
        lib.silu_and_mul.argtypes = [p, p, i64, i64, i32]
        for f in (lib.rope_and_cache, lib.rope_and_cache_bf16):
            f.argtypes, f.restype = [p, p, p, p, p, p, i64, i32, i32, i32, i32], None
        lib.rms_norm.restype = lib.silu_and_mul.restype = None
        lib.logprob_rows.argtypes = [p, i64, i64, p, i32, p, p, p, p, i32]
        lib.logprob_rows.restype = None
        lib.kernel_rows.argtypes = [i32, p, p, p, i64, i64, i32, p, i64, p]
        lib.kernel_rows.restype = i32
    return lib


LOGPROB_MAX_K = 32  # ops.c's


def logprob_rows(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of float32 ``logits`` [rows, V] and its target id (``targets`` int64 [rows]):
    the target's log-softmax value, its rank (1 + how many logits exceed it) and the top
    ``k`` ids and log-softmax values (k <= 32; ties: the lower id first), in two passes over
    each row (ops.c). -> (logprob [rows], rank [rows] int32, top ids [rows, k] int32, top
    logprobs [rows, k])."""
    lib = library()
    assert lib is not None and logits.dtype == torch.float32
    logits, targets = logits.contiguous(), targets.to(torch.int64).contiguous()
    rows, V = logits.shape
    if not 0 <= k <= min(LOGPROB_MAX_K, V):  # past V the top-k slots would hold garbage
        raise ValueError(f"logprob_rows: k {k} must be in [0, {min(LOGPROB_MAX_K, V)}]")
    lp = torch.empty(rows, dtype=torch.float32)
    rank = torch.empty(rows, dtype=torch.int32)
    top_ids = torch.empty(rows, k, dtype=torch.int32)
    top_lp = torch.empty(rows, k, dtype=torch.float32)
    lib.logprob_rows(logits.data_ptr(), rows, V, targets.data_ptr(), k, lp.data_ptr(),
                     rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr(),
                     kernel_threads())  # fmt: skip
    return lp, rank, top_ids, top_lp


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x`` ([rows, H]); with ``residual``, of ``x + residual``, which is also
    written back into ``residual`` (in place)."""
    rows, h = x.shape
    out = torch.empty_like(x)
    res = None if residual is None else residual.data_ptr()
    library().rms_norm(x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), rows, h, eps,
                       kernel_threads())  # fmt: skip
    return out


def head_norm(
    qkv: torch.Tensor,  # [num_tokens, (H + 2 KVH) * D], q and k heads normalised in place
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> None:
    """RMSNorm over each head of q (``q_weight``) and of k (``k_weight``) inside ``qkv``."""
    library().head_norm(qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), qkv.shape[0],
                        num_heads, num_kv_heads, q_weight.shape[0], eps, kernel_threads())  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_i = gate_up.shape
    out = torch.empty(rows, two_i // 2, dtype=torch.float32)
    library().silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, two_i // 2, kernel_threads())
    return out


def rope_and_cache(
    qkv: torch.Tensor,  # [num_tokens, (H + 2 KVH) * D], rotated in place
    cos: torch.Tensor,  # [num_tokens, D / 2] contiguous
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], float32 or bfloat16
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """RoPE on q and k inside ``qkv`` and the step's K/V written to the cache slots (a bf16
    cache gets them rounded to nearest even, as ``Tensor.to(torch.bfloat16)`` rounds)."""
    head_dim = k_cache.shape[-1]
    lib = library()
    fn = lib.rope_and_cache_bf16 if k_cache.dtype == torch.bfloat16 else lib.rope_and_cache
    fn(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim,
        kernel_threads(),
    )  # fmt: skip

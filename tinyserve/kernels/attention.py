"""Paged attention through the block table (attention.c, AVX2 + FMA, float32).

Reads each sequence's K/V where they lie in the paged cache — no gathered copy of the
context, no padded mask — in chunks of 64 keys combined in order (flash-decoding, so one
decode row uses every thread); the cut depends only on the row's position, so a row's output
does not depend on the other rows of the step (batch invariance). The torch
path (layers/attention.py) is used where this kernel cannot run: no AVX2, head_dim not a
multiple of 8, or non-float32 caches.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve.kernels.build import kernel_threads, load


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = load("attention")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.paged_attention.argtypes = [p, i64, p, p, i32, i32, i32, i32, p, p, p, i64, p, i64,
                                        ctypes.c_float, p, i32]  # fmt: skip
        lib.paged_attention.restype = ctypes.c_int
    return lib


def fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel can serve these head shapes (float32 CPU caches assumed: the
    loader only asks when the model runs in fp32 on the CPU)."""
    return library() is not None and head_dim % 8 == 0 and num_heads % num_kv_heads == 0


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: any token stride, heads contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int64 [num_seqs]
    seq_of_token: torch.Tensor,  # int64 [num_tokens]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if num_tokens == 0:
        return out
    rc = library().paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_size,
        num_heads, num_kv_heads, head_dim, query_start_loc.data_ptr(), seq_lens.data_ptr(),
        seq_of_token.data_ptr(), num_tokens, block_tables.data_ptr(), block_tables.shape[1],
        scale, out.data_ptr(), kernel_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged attention: could not allocate its scratch memory")
    return out

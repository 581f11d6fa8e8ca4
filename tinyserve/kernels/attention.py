"""Paged attention through the block table (attention.c, AVX2 + FMA, float32 arithmetic on a
float32 or bf16 cache; for a model whose matmuls round activations to bf16, q.k and p.v as
bf16 products: on AMX tiles, attention_amx.h, or with AVX-512 BF16 dot products,
attention_dp.h).

Reads each sequence's K/V where they lie in the paged cache — no gathered copy of the
context, no padded mask — in chunks of 64 keys combined in order (flash-decoding, so one
decode row uses every thread); the cut depends only on the row's position, so a row's output
does not depend on the other rows of the step (batch invariance). With a sliding window W a
query at position p reads keys p - W + 1 .. p only (its chunks from the window's start). The torch
path (layers/attention.py) is used where this kernel cannot run: no AVX2, head_dim not a
multiple of 8, or a model that does not run in float32.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve.kernels.build import kernel_threads, load


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (an attention.c build) with its entry points' signatures declared."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for f in (
        lib.paged_attention,
        lib.paged_attention_bf16,
        lib.paged_attention_tiles,
        lib.paged_attention_bf16_tiles,
    ):
        f.argtypes = [p, i64, p, p, i32, i32, i32, i32, p, p, p, i64, p, i64,
                      ctypes.c_float, i64, p, i32]  # fmt: skip
        f.restype = ctypes.c_int
    for f in (lib.attention_amx, lib.attention_bf16_products):
        f.argtypes, f.restype = [], ctypes.c_int
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = load("attention")
    return None if lib is None else typed(lib)


def fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel can serve these head shapes (float32 CPU caches assumed: the
    loader only asks when the model runs in fp32 on the CPU)."""
    return library() is not None and head_dim % 8 == 0 and num_heads % num_kv_heads == 0


def uses_tiles(head_dim: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether ``lib`` (default this CPU's build) computes heads of ``head_dim`` on AMX tiles
    (or their emulation): bf16 q, k, v and p, float32 sums (attention_amx.h's contract)."""
    lib = lib or library()
    return lib is not None and bool(lib.attention_amx()) and head_dim % 32 == 0


def uses_bf16_products(head_dim: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether ``lib``'s _tiles entry points compute heads of ``head_dim`` as bf16 products
    (bf16 q, k, v and p, float32 sums): on AMX tiles (uses_tiles) or, on a CPU with AVX-512
    BF16 and no tiles, as VDPBF16PS dot products (attention_dp.h); else they are float32."""
    lib = lib or library()
    return lib is not None and bool(lib.attention_bf16_products()) and head_dim % 32 == 0


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: any token stride, heads contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], fp32 or bf16
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int64 [num_seqs]
    seq_of_token: torch.Tensor,  # int64 [num_tokens]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    scale: float,
    lib: ctypes.CDLL | None = None,  # another build (typed(); e.g. another ISA level)
    tiles: bool = False,  # bf16 products where the build has them (uses_bf16_products)
    window: int | None = None,  # a sliding window: each query sees its last ``window`` keys
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if num_tokens == 0:
        return out
    lib = lib or library()
    name = "paged_attention_bf16" if k_cache.dtype == torch.bfloat16 else "paged_attention"
    fn = getattr(lib, name + ("_tiles" if tiles else ""))
    rc = fn(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_size,
        num_heads, num_kv_heads, head_dim, query_start_loc.data_ptr(), seq_lens.data_ptr(),
        seq_of_token.data_ptr(), num_tokens, block_tables.data_ptr(), block_tables.shape[1],
        scale, window or 0, out.data_ptr(), kernel_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged attention: could not allocate its scratch memory")
    return out

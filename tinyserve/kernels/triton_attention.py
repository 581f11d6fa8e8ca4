"""Paged decode attention in Triton: one query token per sequence, K/V read through the
block table, no mask and no padded gather (issue 16, item 3).

The torch path pads a step's decode rows into one rectangle, gathers every sequence's blocks
into it and hands SDPA an additive mask whose width is the longest context of the step: the
shapes change with the data, so a decode step could not be captured in a CUDA graph, and
each row pays for the longest row. This kernel has one program per (sequence, KV head): it
holds that head's group of query heads (GQA), walks the sequence's context in tiles of
``BLOCK_N`` positions, finds each position's slot through the block table, and keeps an
online softmax (running max, sum and weighted V) in float32. The launch grid depends only
on the batch size and the context lengths are read on the device, so the same launch
replays in a graph for any lengths.

On CUDA it is compiled by Triton (which ships with CUDA PyTorch). On a CPU the same kernel
runs under Triton's interpreter (numpy), which is how the tests check it against
``reference_paged_attention`` where no GPU is present; that is for checking only, never a
serving path.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys

import torch

triton = tl = None  # imported on first use (_import_triton)


def available(device: torch.device | str) -> bool:
    """Triton can run this kernel on ``device``: compiled on CUDA; on a CPU under its
    interpreter, which needs a process without CUDA in which Triton was first imported in
    interpreter mode (see ``_import_triton``)."""
    kind = torch.device(device).type
    if importlib.util.find_spec("triton") is None or kind not in ("cuda", "cpu"):
        return False
    if kind == "cuda":
        return _runs_on_cuda()
    if torch.cuda.is_available():
        return False
    _import_triton()
    return type(tl.sum).__name__ == "InterpretedFunction"  # its library built to interpret


@functools.cache
def _runs_on_cuda() -> bool:
    """Run the kernel once on a tiny input against torch: Triton builds its launcher on first
    use with the system C compiler and Python's headers and needs the driver's libcuda, so a
    runtime without them (a slim container) gets the torch path, with the reason logged,
    instead of a failure at the first decode step."""
    try:
        _import_triton()
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(s, generator=g).cuda() for s in ((1, 2, 16), (1, 16, 1, 16),
                                                                  (1, 16, 1, 16)))  # fmt: skip
        seq_lens = torch.tensor([5], dtype=torch.int32, device=q.device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
        out = paged_decode_attention(q, k, v, seq_lens, table, 0.25)
        ref = torch.softmax(q[0] @ k[0, :5, 0].T * 0.25, -1) @ v[0, :5, 0]
        err = (out[0] - ref).abs().max().item()
        if err > 1e-3:
            raise RuntimeError(f"differs from torch by {err:.2g} on a 5-token check")
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        logging.getLogger(__name__).warning(
            "Triton decode attention off on CUDA (torch attention instead): %s", e)
        return False


def _import_triton() -> None:
    """Import Triton; in a process without CUDA, in interpreter mode if it is not imported
    yet. Triton decides at import whether its own library functions (``tl.sum``,
    ``tl.zeros``, ...) are compiled or interpreted, and torch._dynamo imports it early, so a
    CPU process that wants the interpreter sets ``TRITON_INTERPRET=1`` before it imports
    torch (tests/conftest.py does)."""
    global triton, tl
    if triton is not None:
        return
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl


def fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernel handles: whole GQA groups and a head size Triton can tile."""
    return num_heads % num_kv_heads == 0 and 8 <= head_dim <= 256


def _decode_kernel(
    Q, K, V, Out, SeqLens, Tables,
    scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
    KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(SeqLens + seq)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    heads = kvh * G + g  # query heads i with i // G == kvh (SDPA's enable_gqa order)
    q_ptr = Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    # Keys seq_len - window .. seq_len - 1 (no sliding window: window = 2**30, so from 0).
    lo = tl.maximum(seq_len - window, 0)
    for start in range((lo // BLOCK_N) * BLOCK_N, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = (pos < seq_len) & (pos >= lo)
        block = tl.load(Tables + seq * stride_tb + pos // BS, mask=p_ok, other=0)
        slot = block.to(tl.int64) * BS + pos % BS
        kv_off = (slot * KVH + kvh)[:, None] * D + d[None, :]
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, BLOCK_N]
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    o_ptr = Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@functools.cache
def _kernel(interpret: bool):
    """The kernel compiled for CUDA, or under Triton's interpreter for CPU tensors."""
    _import_triton()
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_decode_kernel)
    return triton.jit(_decode_kernel)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim] (one query token per sequence)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # int32 [num_seqs], each >= 1 (the query's own K/V included)
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim], written in place
    block_n: int = 32,
    window: int | None = None,  # a sliding window: the last ``window`` positions only
) -> torch.Tensor:
    """Each sequence's one query attends over its whole context (positions < seq_len), or
    its last ``window`` positions, read through its block table. The step's K/V must
    already be in the cache."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous")
    if q.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q's head_dim and block_tables' rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    _kernel(q.device.type == "cpu")[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, seq_lens, block_tables,
        scale, window or (1 << 30),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        KVH=num_kv_heads, G=group, G_PAD=_pow2(group),
        D=head_dim, D_PAD=_pow2(head_dim), BS=block_size, BLOCK_N=block_n,
    )  # fmt: skip
    return out

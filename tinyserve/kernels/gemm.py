"""Matmuls of any row count from packed weights (gemm.c, AVX2 or AVX-512): a GGUF's Q4_1 / Q8_0
blocks, int8 with per-channel scales, or plain float32.

A :class:`PackedWeight` holds a weight in the checkpoint's own layout (one row of blocks per
output: what loading, slicing and stacking work on, and what qgemm.c reads); gemm.c reads
its :attr:`PackedWeight.kernel` form, the same codes regrouped so that one vector lane
serves one output of a group of 8 (AVX2) or 16 (AVX-512) (:class:`KernelWeight`), built once
per weight.

Two reasons to own this matmul rather than call torch's GEMM:

* **Bytes per weight.** A decode step reads every weight once; Q4_1 is 0.75 bytes per weight
  (4-bit codes plus a float32 scale and minimum per 32), int8 ~1, fp32 4. The kernel
  dequantises in registers, so a few-row matmul costs what reading the blocks costs.
* **One numeric path whatever the batch.** Each output element is summed in the same order
  for 1 row or 500 (see gemm.c), so a request's logits do not depend on how many other rows
  share its step. torch's GEMM picks different blockings for different row counts.

The weights are exactly the checkpoint's (fp16 scales widened without rounding); only the
summation order differs from dequantise-then-matmul.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from tinyserve.kernels.build import kernel_threads, load

Q4_1, Q8_0, F32, BF16 = "q4_1", "q8_0", "f32", "bf16"
_KIND_IDS = {Q4_1: 0, Q8_0: 1, F32: 2, BF16: 3}
BF16_ACT = 16  # or-ed into a kind id: gemm.c's bf16-activation path (gemm_bf16.h)
_GGML_TYPES = {3: Q4_1, 8: Q8_0}  # GGML type ids
_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


def _bind(name: str, restype) -> ctypes.CDLL | None:
    """Kernel ``name`` (gemm.c / qgemm.c: the same entry-point signature) loaded and typed."""
    lib = load(name)
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn = getattr(lib, name)
        fn.argtypes = [i32, p, p, p, p, i64, p, i64, i64, i64, i32, i32]
        fn.restype = restype
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = _bind("gemm", ctypes.c_int)
    return None if lib is None else bind_score(lib)


SCORE_MAX_K = 32  # gemm_score.h's (logprob.h's LOGPROB_MAX_K)


def bind_score(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A gemm.c build's ``gemm_score`` typed (:func:`score_rows`)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gemm_score.argtypes = [i32, p, p, p, p, i64, i64, i64, i32, p, i32, p, p, p, p, i32]
    lib.gemm_score.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def bf16_available() -> bool:
    """gemm.c built with its bf16-activation tiles (a CPU with AVX512-BF16)."""
    lib = library()
    return lib is not None and bool(lib.gemm_bf16())


def amx_active() -> bool:
    """gemm.c's bf16 path runs on AMX tiles here (gemm_amx.h): the build for ISA level
    ``amx``, chosen where the CPU lists amx_bf16 and Linux granted the tile state."""
    lib = library()
    return lib is not None and bool(lib.gemm_amx())  # library() is never an emulated build


def bf16_engine() -> str:
    """Which unit multiplies the bf16 activations here, and why (for the start-up log)."""
    from tinyserve.utils.cpu import AMX_FLAGS, amx_permitted, cpu_flags

    if amx_active():
        return "AMX tiles (TDPBF16PS)"
    if not AMX_FLAGS <= cpu_flags():
        why = "this CPU has no AMX-BF16"
    elif not amx_permitted():
        why = "Linux refused the AMX tile state (arch_prctl)"
    else:
        why = "TINYSERVE_CPU_ISA chose a lower level"
    return f"AVX512-BF16 vdpbf16ps ({why})"


def block_kind(qtype: int) -> str | None:
    """The kernels' weight kind for a GGML type id (Q4_1, Q8_0), or None: dequantised to float."""
    return _GGML_TYPES.get(qtype)


def group_width() -> int:
    """Outputs per group in the kernel layout of the gemm.c built here: its vector's lanes."""
    lib = library()
    return lib.gemm_group_width() if lib is not None else 8


@functools.cache
def q8_library() -> ctypes.CDLL | None:
    """qgemm.c: the same weights times activations quantised to 8 bits per block."""
    return _bind("qgemm", ctypes.c_int)


def q8_available() -> bool:
    return q8_library() is not None


@dataclass
class PackedWeight:
    """A [N, K] weight as the kernel reads it: ``qs`` codes (or the float32 rows), ``d``
    scales and ``m`` minima (Q4_1) widened to float32, one row of K/32 blocks per output."""

    kind: str
    qs: torch.Tensor  # uint8 [N, K/32, 16] (Q4_1), int8 [N, K] (Q8_0), float32 / bfloat16 [N, K]
    d: torch.Tensor | None  # float32 [N, K/32] (Q4_1, Q8_0)
    m: torch.Tensor | None  # float32 [N, K/32] (Q4_1)
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def take_rows(self, index: torch.Tensor) -> PackedWeight:
        """Rows reordered / selected (e.g. undoing llama.cpp's q/k row permutation)."""

        def pick(t):
            return None if t is None else t[index].contiguous()

        return PackedWeight(
            self.kind, pick(self.qs), pick(self.d), pick(self.m), (len(index), self.shape[1])
        )

    @cached_property
    def kernel(self) -> KernelWeight:
        """This weight in gemm.c's layout (built on first use, then kept)."""
        return KernelWeight.of(self)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (the reference the tests compare against)."""
        n, k = self.shape
        if self.kind in (F32, BF16):
            return self.qs.float()
        if self.kind == Q8_0:
            return (self.qs.float().view(n, k // 32, 32) * self.d[..., None]).view(n, k)
        lo, hi = self.qs & 0x0F, self.qs >> 4
        q = torch.cat([lo, hi], dim=-1).float()  # [N, K/32, 32]
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)


def _grouped(t: torch.Tensor, n: int, gw: int) -> torch.Tensor:
    """[N, ...] -> [G, gw, ...]: rows in groups of gw, the last padded with zeros."""
    pad = -n % gw
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, gw, *t.shape[1:])


@dataclass
class KernelWeight:
    """A weight in gemm.c's layout: outputs in G = ceil(N/W) groups of W (zero padded; W = 8
    for AVX2, 16 for AVX-512: :func:`group_width`), the group's W outputs innermost, so that
    one vector lane computes one output.

    Q4_1: ``qs`` uint8 [G, K/32, 16, W] (byte p of each output's block), ``d``/``m`` [G, K/32, W];
    Q8_0: ``qs`` int8 [G, K/32, 32, W], ``d`` [G, K/32, W]; F32: ``qs`` float32 [G, K, W];
    BF16: ``qs`` int32 [G, K/32, 16, W] (pairs: weight p's bits low, weight p + 16's high)."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    shape: tuple[int, int]

    @staticmethod
    def of(w: PackedWeight, width: int | None = None) -> KernelWeight:
        """``w`` regrouped for a gemm.c of group ``width`` (default: the one built here)."""
        n, k = w.shape
        gw = width or group_width()

        def scales(t):  # [N, K/32] -> [G, K/32, W]
            return None if t is None else _grouped(t, n, gw).permute(0, 2, 1).contiguous()

        if w.kind == Q4_1:  # [N, K/32, 16] -> [G, K/32, 16, W]
            qs = _grouped(w.qs, n, gw).permute(0, 2, 3, 1)
        elif w.kind == BF16:  # [N, K] -> [G, K/32, 16, W] words: weight p | weight p + 16 << 16
            # little-endian: weight p at the lower address is the word's low half
            halves = w.qs.view(torch.int16).reshape(n, k // 32, 2, 16).transpose(2, 3)
            words = halves.contiguous().view(torch.int32)[..., 0]  # [N, K/32, 16]
            qs = _grouped(words, n, gw).permute(0, 2, 3, 1)
        elif w.kind == Q8_0:  # [N, K] -> [G, K/32, 32, W]
            qs = _grouped(w.qs.reshape(n, k // 32, 32), n, gw).permute(0, 2, 3, 1)
        else:  # [N, K] -> [G, K, W]
            qs = _grouped(w.qs, n, gw).permute(0, 2, 1)
        qs = qs.contiguous()  # bf16 pairs are read in place by aligned loads (gemm_bf16.h)
        assert w.kind != BF16 or qs.data_ptr() % 64 == 0, "torch aligns CPU tensors to 64 B"
        return KernelWeight(w.kind, qs, scales(w.d), scales(w.m), w.shape)


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one kind along the output rows (fused q/k/v, gate/up)."""
    kind, k = parts[0].kind, parts[0].shape[1]
    if any(p.kind != kind or p.shape[1] != k for p in parts):
        raise ValueError("cat_rows: parts differ in kind or width")

    def cat(name):
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    n = sum(p.shape[0] for p in parts)
    return PackedWeight(kind, cat("qs"), cat("d"), cat("m"), (n, k))


def from_gguf(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> PackedWeight | None:
    """A GGUF tensor's bytes ([N, bytes per row]) as a PackedWeight, or None for other types."""
    kind = block_kind(qtype)
    n, k = shape
    if kind is None or k % 32 != 0:
        return None
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, _BLOCK_BYTES[kind])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == Q4_1:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(blocks[..., 4:20].copy())
        return PackedWeight(kind, qs, d, m, shape)
    qs = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8).reshape(n, k))
    return PackedWeight(kind, qs, d, None, shape)


def from_dense(w: torch.Tensor) -> PackedWeight | None:
    """A float weight as float32 rows (the batch-invariant dense path); None if K % 32."""
    n, k = w.shape
    if k % 32 != 0:
        return None
    return PackedWeight(F32, w.detach().float().contiguous(), None, None, (n, k))


def from_dense_bf16(w: torch.Tensor) -> PackedWeight | None:
    """A float weight as bf16 rows (rounded to nearest even; a bf16 checkpoint's exactly),
    for the bf16-activation kernels (gemm_bf16.h, gemm_amx.h); None if K % 32."""
    n, k = w.shape
    if k % 32 != 0:
        return None
    return PackedWeight(BF16, w.detach().to(torch.bfloat16).contiguous(), None, None, (n, k))


def quantize_int8(w: torch.Tensor) -> PackedWeight | None:
    """Weight-only int8 with one scale per output channel: q = round(w / s), s = max|w| / 127.
    Stored as Q8_0 blocks whose scales are all the channel's scale. None if K % 32."""
    n, k = w.shape
    if k % 32 != 0:
        return None
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
    qs = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    d = scale[:, None].expand(n, k // 32).contiguous()
    return PackedWeight(Q8_0, qs, d, None, (n, k))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _output(m_rows: int, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(m_rows, n, dtype=torch.float32)
    if tuple(out.shape) != (m_rows, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{m_rows}, {n}] tensor")
    return out


def _run(fn, what: str, x: torch.Tensor, w, num_threads, out, flags: int = 0) -> torch.Tensor:
    x = x.contiguous()
    m_rows, k = x.shape
    n = w.shape[0]
    if k != w.shape[1] or x.dtype != torch.float32:
        raise ValueError(f"{what}: x {tuple(x.shape)} {x.dtype} vs weight {w.shape}")
    y = _output(m_rows, n, out)
    if m_rows == 0:
        return y
    rc = fn(_KIND_IDS[w.kind] | flags, _ptr(w.qs), _ptr(w.d), _ptr(w.m), x.data_ptr(), k,
            y.data_ptr(), n, n, k, m_rows, num_threads or kernel_threads())  # fmt: skip
    if rc == -2:
        only = w.kind == BF16 and not flags & BF16_ACT
        why = "served with bf16 activations only" if only else "no bf16-activation kernel here"
        raise ValueError(f"{what}: {w.kind} weights: {why}")
    if rc:
        raise MemoryError(f"{what}: no scratch memory for {m_rows} x {k} activations")
    return y


def matmul(
    x: torch.Tensor,
    w: PackedWeight | KernelWeight,
    num_threads: int | None = None,
    out: torch.Tensor | None = None,
    bf16: bool = False,
) -> torch.Tensor:
    """``x @ W.T`` for float32 ``x`` [M, K]: [M, N] float32 (into ``out`` if given). With
    ``bf16`` (Q4_1 / Q8_0 weights, :func:`bf16_available`): ``bf16(x) @ W.T``, x rounded to
    bf16 and multiplied on vdpbf16ps, the weights exact (gemm_bf16.h)."""
    lib = library()
    assert lib is not None, "CPU kernels are not available"
    kw = w.kernel if isinstance(w, PackedWeight) else w
    return _run(lib.gemm, "matmul", x, kw, num_threads, out, BF16_ACT if bf16 else 0)


def score_rows(
    x: torch.Tensor,
    w: PackedWeight | KernelWeight,
    targets: torch.Tensor,
    k: int,
    bf16: bool = False,
    num_threads: int | None = None,
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x`` [M, K] and its target id: the log-softmax value of the target under
    the logits ``x @ W.T`` (as :func:`matmul` computes them), its rank and the top ``k`` ids
    and log-softmax values (k <= 32; ties: the lower id first), without the logits ever
    written out (gemm_score.h). -> (logprob [M], rank [M] int32, top ids [M, k] int32, top
    logprobs [M, k]): what kernels.ops.logprob_rows gives on ``matmul``'s output. ``lib``:
    another build (:func:`bind_score`; tests), ``w`` then a KernelWeight of its width."""
    lib = lib or library()
    assert lib is not None, "CPU kernels are not available"
    kw = w.kernel if isinstance(w, PackedWeight) else w
    x, targets = x.contiguous(), targets.to(torch.int64).contiguous()
    m_rows, kdim = x.shape
    n = kw.shape[0]
    if kdim != kw.shape[1] or x.dtype != torch.float32 or tuple(targets.shape) != (m_rows,):
        raise ValueError(f"score_rows: x {tuple(x.shape)} {x.dtype}, targets "
                         f"{tuple(targets.shape)}, weight {kw.shape}")  # fmt: skip
    in_range = m_rows == 0 or 0 <= int(targets.min()) <= int(targets.max()) < n
    if not 0 <= k <= min(SCORE_MAX_K, n) or not in_range:
        raise ValueError(
            f"score_rows: k {k} must be in [0, {min(SCORE_MAX_K, n)}], targets in [0, {n})"
        )
    lp, rank = torch.empty(m_rows), torch.empty(m_rows, dtype=torch.int32)  # float32 / int32
    top_ids, top_lp = torch.empty(m_rows, k, dtype=torch.int32), torch.empty(m_rows, k)
    flags = _KIND_IDS[kw.kind] | (BF16_ACT if bf16 else 0)
    outs = (lp.data_ptr(), rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr())
    rc = lib.gemm_score(flags, _ptr(kw.qs), _ptr(kw.d), _ptr(kw.m), x.data_ptr(), kdim, n, kdim,
                        m_rows, targets.data_ptr(), k, *outs, num_threads or kernel_threads())  # fmt: skip
    if rc == -2:
        raise ValueError(f"score_rows: no bf16-activation kernel for {kw.kind} weights on this CPU")
    if rc == -1:
        raise MemoryError(f"score_rows: no scratch memory for {m_rows} rows")
    assert rc == 0, rc  # -3 (k out of range) is refused above
    return lp, rank, top_ids, top_lp


def matmul_q8(
    x: torch.Tensor,
    w: PackedWeight,
    num_threads: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` with ``x`` quantised to int8 per row and block of 32 (qgemm.c), for Q4_1 /
    Q8_0 weights: the integer dot products llama.cpp uses, exact but for the rounding of x
    (bound: :func:`q8_error_bound`)."""
    lib = q8_library()
    assert lib is not None, "CPU kernels are not available"
    if w.kind not in (Q4_1, Q8_0):
        raise ValueError(f"matmul_q8: weight kind {w.kind} has no integer kernel")
    return _run(lib.qgemm, "matmul_q8", x, w, num_threads, out)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of qgemm.c's activation rounding: per row and block of 32,
    dx = max|x| / 127 and qx = round_half_even(x * (1 / dx)) (float32 ops, as the kernel
    does them). Returns (qx as float32 [M, K], dx [M, K/32])."""
    m_rows, k = x.shape
    xb = x.float().reshape(m_rows, k // 32, 32)
    dx = xb.abs().amax(dim=-1) / torch.tensor(127.0)
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(xb * inv[..., None])
    return qx.reshape(m_rows, k), dx


def q8_error_bound(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """[M, N] bound on |matmul_q8 - x @ W.T| from rounding x: each element moves by at most
    dx / 2 of its block, so the error is <= sum_b dx_b / 2 * sum_{k in b} |W[n, k]|."""
    n, k = w.shape
    _, dx = quantize_activations(x)
    wabs = w.dequantize().abs().reshape(n, k // 32, 32).sum(-1)  # [N, K/32]
    return (dx.double() / 2) @ wabs.double().T

"""Small-batch matmuls straight from GGUF Q4_1 / Q8_0 blocks (gguf_gemv.c, AVX2 + FMA).

A decode step at batch 1 reads every weight once; in fp32 that is 4 bytes per weight and
memory bandwidth sets the step time. Q4_1 is 0.75 bytes per weight here (4-bit codes plus a
float32 scale and minimum per 32), so reading it and dequantising in registers is several
times cheaper. The weights are exactly the GGUF ones; the fp32 copy stays for prefill and
large batches, where the matmul is compute-bound and torch's GEMM wins.

The C source is compiled once with the system C compiler into the cache folder and loaded
with ctypes (which releases the GIL during the call). Without a compiler, on a CPU without
AVX2/FMA, or with ``TINYSERVE_GGUF_KERNELS=0``, :func:`available` is False and callers keep
the fp32 path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("gguf_gemv.c")
Q4_1, Q8_0 = "q4_1", "q8_0"
_GGML_TYPES = {3: Q4_1, 8: Q8_0}  # GGML type ids
_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(so_path: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    so_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=so_path.parent) as tmp:
        out = Path(tmp) / so_path.name
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC",
               "-o", str(out), str(_SOURCE)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        out.replace(so_path)  # atomic: concurrent builders never see half a file


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (reason logged once) when they cannot be used here."""
    if os.environ.get("TINYSERVE_GGUF_KERNELS", "1") == "0":
        return None
    if not {"avx2", "fma"} <= _cpu_flags():
        logger.info("GGUF kernels off: this CPU lacks AVX2/FMA")
        return None
    from tinyserve.models.default_model import cache_dir

    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    so_path = cache_dir() / "kernels" / f"gguf_gemv-{digest}.so"
    try:
        if not so_path.exists():
            _build(so_path)
        lib = ctypes.CDLL(str(so_path))
    except (OSError, RuntimeError) as e:
        logger.warning("GGUF kernels off (fp32 matmuls instead): %s", e)
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gemv_q4_1.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i32, i32]
    lib.gemv_q8_0.argtypes = [p, p, p, i64, p, i64, i64, i64, i32, i32]
    lib.gemv_q4_1.restype = lib.gemv_q8_0.restype = None
    return lib


def available() -> bool:
    return library() is not None


@dataclass
class QuantWeight:
    """A [N, K] weight in GGUF blocks: ``qs`` codes, ``d`` scales (and ``m`` minima for
    Q4_1) widened to float32, one row of K/32 blocks per output."""

    kind: str
    qs: torch.Tensor  # uint8 [N, K/32, 16] (Q4_1) or int8 [N, K] (Q8_0)
    d: torch.Tensor  # float32 [N, K/32]
    m: torch.Tensor | None  # float32 [N, K/32] (Q4_1)
    shape: tuple[int, int]

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows reordered / selected (e.g. undoing llama.cpp's q/k row permutation)."""
        m = None if self.m is None else self.m[index].contiguous()
        return QuantWeight(
            self.kind,
            self.qs[index].contiguous(),
            self.d[index].contiguous(),
            m,
            (len(index), self.shape[1]),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (reference for the tests)."""
        n, k = self.shape
        if self.kind == Q8_0:
            return (self.qs.float().view(n, k // 32, 32) * self.d[..., None]).view(n, k)
        lo, hi = self.qs & 0x0F, self.qs >> 4
        q = torch.cat([lo, hi], dim=-1).float()  # [N, K/32, 32]
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights of one kind along the output rows (fused q/k/v, gate/up)."""
    kind, k = parts[0].kind, parts[0].shape[1]
    if any(p.kind != kind or p.shape[1] != k for p in parts):
        raise ValueError("cat_rows: parts differ in kind or width")
    m = None if kind == Q8_0 else torch.cat([p.m for p in parts])
    n = sum(p.shape[0] for p in parts)
    return QuantWeight(
        kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m, (n, k)
    )


def from_gguf(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantWeight | None:
    """A GGUF tensor's bytes ([N, bytes per row]) as a QuantWeight, or None for other types."""
    kind = _GGML_TYPES.get(qtype)
    n, k = shape
    if kind is None or k % 32 != 0:
        return None
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, _BLOCK_BYTES[kind])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == Q4_1:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(blocks[..., 4:20].copy())
        return QuantWeight(kind, qs, d, m, shape)
    qs = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8).reshape(n, k))
    return QuantWeight(kind, qs, d, None, shape)


@functools.cache
def _default_threads() -> int:
    """The kernel's OpenMP threads: $TINYSERVE_KERNEL_THREADS, else one per core."""
    return int(os.environ.get("TINYSERVE_KERNEL_THREADS", 0)) or os.cpu_count() or 1


def matmul(x: torch.Tensor, w: QuantWeight, num_threads: int | None = None) -> torch.Tensor:
    """``x @ W.T`` for float32 ``x`` [M, K]: [M, N] float32."""
    lib = library()
    assert lib is not None, "GGUF kernels are not available"
    x = x.contiguous()
    m_rows, k = x.shape
    n = w.shape[0]
    if k != w.shape[1] or x.dtype != torch.float32:
        raise ValueError(f"matmul: x {tuple(x.shape)} {x.dtype} vs weight {w.shape}")
    y = torch.empty(m_rows, n, dtype=torch.float32)
    threads = num_threads or _default_threads()
    if w.kind == Q4_1:
        sx = torch.empty(m_rows, k // 32, dtype=torch.float32)
        lib.gemv_q4_1(w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), x.data_ptr(), k,
                      sx.data_ptr(), y.data_ptr(), n, n, k, m_rows, threads)  # fmt: skip
    else:
        lib.gemv_q8_0(w.qs.data_ptr(), w.d.data_ptr(), x.data_ptr(), k, y.data_ptr(), n,
                      n, k, m_rows, threads)  # fmt: skip
    return y

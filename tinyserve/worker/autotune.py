"""``--dtype auto`` on a CPU, decided by measuring, not by reading /proc/cpuinfo alone.

The candidates are the two ways tinyserve can run a model on a CPU:

* ``float32`` + the CPU kernels (tinyserve/kernels): the checkpoint's own blocks (a GGUF's
  Q4_1/Q8_0) or its float32 weight, batch-invariant;
* ``bfloat16`` through torch's GEMM (oneDNN): fast only where the CPU computes bf16
  natively (AVX512-BF16, AMX), emulated and slow elsewhere.

Each is timed on the model's largest matmul shape at a decode row count (1), a batched
decode (16) and a prefill chunk (128), a few repetitions over weights larger than the
last-level cache (decode is bound by reading them). The winner minimises the worst ratio to
the best candidate over the three shapes; the batch-invariant kernel path keeps the choice
unless bf16 beats it by more than 10% (the price we accept for logits that do not move with
the batch). Results are cached per CPU model, ISA flags, torch version, kernel source and
shape in ``<cache>/calibration.json``, so later starts cost nothing. ≤ ~2 s cold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyserve.utils.cache import cache_dir
from tinyserve.utils.cpu import cpu_flags, cpu_model_name

logger = logging.getLogger(__name__)

ROWS = (1, 16, 128)
KERNEL_PREFERENCE = 1.10  # bf16 must be this much faster to displace the invariant path
_LLC_BYTES = 64 << 20  # decode weights are streamed from memory: use more than any L3


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    reason: str
    timings_ms: dict  # candidate -> {rows: ms}


def _key(kind: str, n: int, k: int) -> str:
    from pathlib import Path

    import tinyserve.kernels as kernels

    folder = Path(kernels.__file__).parent
    kernel_src = (folder / "gemm.c").read_bytes() + (folder / "simd.h").read_bytes()
    flags = " ".join(sorted(cpu_flags()))
    h = hashlib.sha256(kernel_src + flags.encode()).hexdigest()[:12]
    return f"{cpu_model_name()}|{torch.__version__}|{h}|{kind}|{n}x{k}"


def _time(fn, reps: int) -> float:
    fn()  # warm-up (first-touch, oneDNN primitive creation)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _measure(kind: str, n: int, k: int) -> dict[str, dict[int, float]]:
    from tinyserve.kernels import gemm

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(n, k, generator=gen) * 0.02
    timings: dict[str, dict[int, float]] = {}
    if gemm.available():
        if kind == gemm.Q4_1:
            import numpy as np

            rng = np.random.default_rng(0)
            nb = k // 32
            raw = np.concatenate(
                [
                    rng.uniform(0.001, 0.01, (n, nb, 2)).astype(np.float16).view(np.uint8),
                    rng.integers(0, 256, (n, nb, 16), dtype=np.uint8),
                ],
                axis=-1,
            ).reshape(n, nb * 20)
            packed = gemm.from_gguf(raw, 3, (n, k))
        elif kind == gemm.Q8_0:
            packed = gemm.quantize_int8(base)
        else:
            packed = gemm.from_dense(base)
        every_row = torch.arange(n)
        # gemm.c's layout of each copy (take_rows copies codes, scales and minima: all
        # streamed), built before the timing.
        copies = [packed.kernel] + [
            packed.take_rows(every_row).kernel
            for _ in range(max(0, _LLC_BYTES // packed.nbytes - 1))
        ]
        timings["float32+kernels"] = _sweep(lambda x, w: gemm.matmul(x, w), copies, k)
    bf16 = base.to(torch.bfloat16)
    copies = [bf16] + [bf16.clone() for _ in range(_LLC_BYTES // bf16.nbytes - 1)]
    timings["bfloat16"] = _sweep(lambda x, w: F.linear(x, w), copies, k, torch.bfloat16)
    return timings


def _sweep(matmul, weights, k: int, dtype=torch.float32) -> dict[int, float]:
    out = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            ws = weights if rows == 1 else weights[:2]  # batched shapes are compute-bound

            def run(ws=ws, x=x):
                for w in ws:
                    matmul(x, w)

            out[rows] = _time(run, reps=3) / len(ws)
    return out


def choose(timings: dict[str, dict[int, float]]) -> tuple[str, str]:
    """(candidate, why) from per-row-count timings (ms per matmul)."""
    best = {r: min(t[r] for t in timings.values()) for r in ROWS}
    worst_ratio = {c: max(t[r] / best[r] for r in ROWS) for c, t in timings.items()}
    pick = min(worst_ratio, key=worst_ratio.get)
    kernel = "float32+kernels"
    if pick != kernel and kernel in timings:
        if worst_ratio[kernel] <= KERNEL_PREFERENCE * worst_ratio[pick]:
            pick = kernel
    shown = "; ".join(
        f"{c}: " + ", ".join(f"{t[r]:.2f} ms @{r}" for r in ROWS) for c, t in timings.items()
    )
    return pick, f"{pick} is within {worst_ratio[pick]:.2f}x of the best at every shape ({shown})"


def choose_cpu_dtype(kind: str, n: int, k: int) -> Choice:
    """The dtype ``--dtype auto`` resolves to on this CPU for a model whose largest matmul is
    [n, k] with weights of ``kind`` (q4_1, q8_0 or f32), measured once per CPU and cached."""
    path = cache_dir() / "calibration.json"
    key = _key(kind, n, k)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if entry is None:
        t0 = time.monotonic()
        timings = _measure(kind, n, k)
        pick, why = choose({c: {int(r): v for r, v in t.items()} for c, t in timings.items()})
        entry = {"pick": pick, "why": why, "timings_ms": timings,
                 "seconds": round(time.monotonic() - t0, 2)}  # fmt: skip
        cache[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError as e:
            logger.warning("could not save the dtype calibration: %s", e)
        why = f"measured in {entry['seconds']} s: {entry['why']}"
    else:
        why = f"cached calibration for this CPU: {entry['why']}"
    dtype = torch.bfloat16 if entry["pick"] == "bfloat16" else torch.float32
    return Choice(dtype, why, entry["timings_ms"])


def resolve_engine_dtype(dtype, device: torch.device, model, cpu_kernels: bool, quantization):
    """The engine's (and every tensor-parallel rank's) dtype: ``auto`` on a CPU with the
    kernels is calibrated (logged with the reason); anything else as worker/device.py says."""
    from tinyserve.worker.device import resolve_dtype

    if dtype not in (None, "auto") or device.type != "cpu" or not cpu_kernels:
        return resolve_dtype(dtype, device)
    from tinyserve.kernels import gemm
    from tinyserve.models.loader import largest_matmul

    if not gemm.available():
        return resolve_dtype(dtype, device)
    kind, n, k = largest_matmul(model, quantization)
    choice = choose_cpu_dtype(kind, n, k)
    logger.info("--dtype auto -> %s: %s", str(choice.dtype).replace("torch.", ""), choice.reason)
    return choice.dtype

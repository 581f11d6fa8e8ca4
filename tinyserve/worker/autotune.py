"""``--dtype auto`` on a CPU, decided by measuring, not by reading /proc/cpuinfo alone.

The candidates are the two ways tinyserve can run a model on a CPU:

* ``float32`` + the CPU kernels (tinyserve/kernels): the checkpoint's own blocks (a GGUF's
  Q4_1/Q8_0) or its float32 weight, batch-invariant;
* ``bfloat16`` through torch's GEMM (oneDNN): fast only where the CPU computes bf16
  natively (AVX512-BF16, AMX), emulated and slow elsewhere.

Each is timed on one decoder layer's matmuls (q/k/v, o, gate/up, down: every call the layer
makes, so each call's own cost counts: at one row torch's bf16 GEMM pays ~0.2 ms a call on a
Zen 5, more than reading its weights takes, which timing the largest matmul alone hid and
made ``auto`` pick bf16 at 5x the cost per token) at a decode row count (1), a batched decode
(16) and a prefill chunk (128), a few repetitions over weights larger than the last-level
cache (decode is bound by reading them). The winner minimises the worst ratio to
the best candidate over the three shapes; the batch-invariant kernel path keeps the choice
unless bf16 beats it by more than 10% (the price we accept for logits that do not move with
the batch). Results are cached per CPU model, ISA flags, torch version, kernel source and
shape in ``<cache>/calibration.json``, so later starts cost nothing. ≤ ~2 s cold.

Measured only where bf16 can win: a CPU without native bf16 (no AVX512-BF16 or AMX-BF16)
takes the kernels without timing anything (its bf16 is emulated). And only trusted on a quiet
machine: if other processes took more than ``BUSY_SHARE`` of our CPUs during the sweep
(/proc/stat against our own CPU time), it is measured once more, and if still disturbed the
kernels run this start and nothing is cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyserve.utils.cache import cache_dir
from tinyserve.utils.cpu import (
    cpu_flags,
    cpu_model_name,
    cpu_time_snapshot,
    others_cpu_seconds,
    usable_cpus,
)

logger = logging.getLogger(__name__)

ROWS = (1, 16, 128)
KERNEL_PREFERENCE = 1.10  # bf16 must be this much faster to displace the invariant path
_LLC_BYTES = 64 << 20  # decode weights are streamed from memory: use more than any L3
BUSY_SHARE = 0.15  # others took more of our CPUs than this during the sweep: not trusted


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    reason: str
    timings_ms: dict  # candidate -> {rows: ms}
    quantization: str | None = None  # "bf16": the kernels hold the dense weights in bf16


Shapes = tuple[tuple[str, int, int], ...]  # (weight kind, N, K) of each matmul of a layer


KERNELS, BF16_KERNELS, TORCH_BF16 = "float32+kernels", "bfloat16+kernels", "bfloat16"


def _key(shapes: Shapes, bf16_act: bool) -> str:
    from tinyserve.kernels.build import isa_level, source_bytes

    kernel_src = source_bytes("gemm")
    # the level the kernels are built for: TINYSERVE_CPU_ISA may lower it on the same CPU
    flags = f"{isa_level()} {'bf16-act ' if bf16_act else ''}" + " ".join(sorted(cpu_flags()))
    h = hashlib.sha256(kernel_src + flags.encode()).hexdigest()[:12]
    layer = ",".join(f"{kind}:{n}x{k}" for kind, n, k in shapes)
    return f"{cpu_model_name()}|{torch.__version__}|{h}|{layer}"


def _packed(kind: str, base: torch.Tensor):
    """A random weight of ``base``'s shape as the kernels would hold it (``kind`` blocks)."""
    from tinyserve.kernels import gemm

    n, k = base.shape
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
        return gemm.from_gguf(raw, 3, (n, k))
    if kind == gemm.BF16:
        return gemm.from_dense_bf16(base)
    return gemm.quantize_int8(base) if kind == gemm.Q8_0 else gemm.from_dense(base)


def _kernel_copies(kinds: list[str], bases: list[torch.Tensor]) -> list:
    """The layer in gemm.c's layout, and copies of it past the last-level cache (take_rows
    copies codes, scales and minima: all streamed), built before the timing."""
    layer = [_packed(kind, b) for kind, b in zip(kinds, bases, strict=True)]
    nbytes = sum(p.nbytes for p in layer)
    return [[p.kernel for p in layer]] + [
        [p.take_rows(torch.arange(p.shape[0])).kernel for p in layer]
        for _ in range(max(0, _LLC_BYTES // nbytes - 1))
    ]


def _measure(
    shapes: Shapes, bf16_act: bool = False, bf16_weights: bool = False
) -> dict[str, dict[int, float]]:
    """ms per decoder layer (every matmul of ``shapes``, each call's own cost included) per
    candidate and row count; with ``bf16_weights`` (a bf16 checkpoint's dense weights) also
    the kernels holding them in bf16."""
    from tinyserve.kernels import gemm

    gen = torch.Generator().manual_seed(0)
    bases = [torch.randn(n, k, generator=gen) * 0.02 for _, n, k in shapes]
    candidates = {}  # name -> (matmul, the layer's weights and their copies, dtype)
    if gemm.available():
        from tinyserve.layers.linear import bf16_activations

        def kernel_matmul(x, w):  # the activations the engine will give each weight kind
            return gemm.matmul(x, w, bf16=bf16_activations(w.kind, bf16_act))

        kinds = [kind for kind, _, _ in shapes]
        candidates[KERNELS] = (kernel_matmul, _kernel_copies(kinds, bases), torch.float32)
        if bf16_weights:
            copies = _kernel_copies([gemm.BF16] * len(kinds), bases)
            candidates[BF16_KERNELS] = (kernel_matmul, copies, torch.float32)
    bf16 = [b.to(torch.bfloat16) for b in bases]
    nbytes = sum(b.nbytes for b in bf16)
    copies = [bf16] + [[b.clone() for b in bf16] for _ in range(_LLC_BYTES // nbytes - 1)]
    candidates[TORCH_BF16] = (F.linear, copies, torch.bfloat16)
    return _sweep(candidates)


def _sweep(candidates: dict, reps: int = 5) -> dict[str, dict[int, float]]:
    """ms per layer, per candidate and row count: the fastest of ``reps`` runs, the candidates
    taking turns run by run, so that a neighbour's steady load hits them alike (a heavy
    one is caught by ``_calibrate``)."""
    out: dict[str, dict[int, float]] = {name: {} for name in candidates}
    with torch.inference_mode():
        for rows in ROWS:
            runs = {}
            for name, (matmul, layers, dtype) in candidates.items():
                xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in layers[0]}
                ls = layers if rows == 1 else layers[:2]  # batched shapes are compute-bound

                def run(matmul=matmul, ls=ls, xs=xs):
                    for layer in ls:
                        for w in layer:
                            matmul(xs[w.shape[1]], w)

                run()  # warm-up (first touch, oneDNN primitive creation)
                runs[name] = (run, len(ls))
            best = {name: float("inf") for name in runs}
            for _ in range(reps):
                for name, (run, _) in runs.items():
                    t = time.perf_counter()
                    run()
                    best[name] = min(best[name], time.perf_counter() - t)
            for name, (_, n_layers) in runs.items():
                out[name][rows] = 1000 * best[name] / n_layers
    return out


def choose(timings: dict[str, dict[int, float]]) -> tuple[str, str]:
    """(candidate, why) from per-row-count timings (ms per matmul): the smallest worst ratio
    to the best at each shape; torch's bf16 only if it beats the kernels' best candidate (both
    batch-invariant) by more than KERNEL_PREFERENCE."""
    best = {r: min(t[r] for t in timings.values()) for r in ROWS}
    worst_ratio = {c: max(t[r] / best[r] for r in ROWS) for c, t in timings.items()}
    pick = min(worst_ratio, key=worst_ratio.get)
    kernels = [c for c in (KERNELS, BF16_KERNELS) if c in timings]
    kernel = min(kernels, key=worst_ratio.get) if kernels else None
    if pick == TORCH_BF16 and kernel is not None:
        if worst_ratio[kernel] <= KERNEL_PREFERENCE * worst_ratio[pick]:
            pick = kernel
    shown = "; ".join(
        f"{c}: " + ", ".join(f"{t[r]:.2f} ms @{r}" for r in ROWS) for c, t in timings.items()
    )
    return pick, f"{pick} is within {worst_ratio[pick]:.2f}x of the best at every shape ({shown})"


def _calibrate(
    shapes: Shapes, bf16_act: bool, bf16_weights: bool = False
) -> tuple[dict | None, float, float]:
    """(timings, seconds, share of our CPUs that others took): timings is None when the
    machine stayed busy over two tries. Candidates taking turns hit alike by a steady load is
    not enough: a load that preempts the kernels' OpenMP workers makes every parallel region
    wait for a scheduler tick (here, a compiler at nice 19 in another session: the kernels'
    one-row layer 0.7 -> 31 ms, torch's bf16 not always hit), and a choice made so is cached
    for good: bf16 picked at 13x the cost per token on a CPU that emulates it."""
    t0 = time.monotonic()
    share = 0.0
    for _ in range(2):
        before, t = cpu_time_snapshot(), time.monotonic()
        # In a thread of its own that then exits: OpenMP (libgomp) keeps a worker team per
        # thread that ever ran a parallel region, and with more of its threads alive than
        # CPUs it stops spinning between regions. The calibration's team, left behind in the
        # main thread, made every kernel call of the engine thread wake its workers through
        # the kernel: served TPOT 7 -> 14 ms at one stream here. The team ends with the thread.
        with ThreadPoolExecutor(1, thread_name_prefix="tinyserve-calibration") as pool:
            timings = pool.submit(_measure, shapes, bf16_act, bf16_weights).result()
        others = others_cpu_seconds(before, cpu_time_snapshot())
        share = 0.0 if others is None else others / ((time.monotonic() - t) * usable_cpus())
        if share <= BUSY_SHARE:
            return timings, time.monotonic() - t0, share
    return None, time.monotonic() - t0, share


def choose_cpu_dtype(
    shapes: Shapes, kernel_activations: str = "auto", bf16_weights: bool = False
) -> Choice:
    """The dtype ``--dtype auto`` resolves to on this CPU for a model whose decoder layer
    makes the matmuls ``shapes`` ((kind, N, K): q4_1, q8_0 or f32 weights), measured once per
    CPU and cached; with ``bf16_weights`` (a bf16 checkpoint's dense weights, where the
    kernels have bf16 tiles) the kernels holding them in bf16 are a candidate too (chosen:
    float32 with ``quantization`` "bf16"). A CPU without native bf16 is not measured (torch's
    bf16 GEMM is emulated there, 5-10x slower than the kernels at every shape); a
    measurement the machine's other load disturbed is not trusted: the kernels this start,
    nothing cached."""
    from tinyserve.layers.linear import resolve_kernel_activations
    from tinyserve.worker.device import cpu_has_native_bf16

    if not cpu_has_native_bf16():
        why = "no native bf16 on this CPU (no avx512_bf16/amx_bf16 flag): bf16 would be emulated"
        return Choice(torch.float32, f"float32+kernels, not measured: {why}", {})
    path = cache_dir() / "calibration.json"
    shapes = tuple(tuple(s) for s in shapes)
    bf16_act = resolve_kernel_activations(kernel_activations) == "bfloat16"
    key = _key(shapes, bf16_act) + ("|bf16-weights" if bf16_weights else "")
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if entry is None:
        timings, seconds, share = _calibrate(shapes, bf16_act, bf16_weights)
        if timings is None:
            why = (
                f"float32+kernels, not cached: other processes took {share:.0%} of the CPUs "
                f"during the calibration ({seconds:.2f} s, two tries), so its timings are not "
                "trusted; the next start measures again"
            )
            logger.warning("dtype calibration disturbed: %s", why)
            return Choice(torch.float32, why, {})
        pick, why = choose({c: {int(r): v for r, v in t.items()} for c, t in timings.items()})
        entry = {"pick": pick, "why": why, "timings_ms": timings, "seconds": round(seconds, 2)}
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
    dtype = torch.bfloat16 if entry["pick"] == TORCH_BF16 else torch.float32
    quantization = "bf16" if entry["pick"] == BF16_KERNELS else None
    return Choice(dtype, why, entry["timings_ms"], quantization)


def resolve_engine_dtype(
    dtype, device: torch.device, model, cpu_kernels: bool, quantization, kernel_activations="auto",
    bf16_weights: bool = True,
) -> tuple[torch.dtype, str | None]:  # fmt: skip
    """The engine's (and every tensor-parallel rank's) dtype and quantization: ``auto`` on a
    CPU with the kernels is calibrated (logged with the reason), the kernels timed with the
    activations the engine will give them, and a bf16 checkpoint's dense weights also held in
    bf16 (``bf16_weights``: where the ranks can be told); anything else as worker/device.py
    says, ``quantization`` as given."""
    from tinyserve.worker.device import resolve_dtype

    if dtype not in (None, "auto") or device.type != "cpu" or not cpu_kernels:
        return resolve_dtype(dtype, device), quantization
    from tinyserve.kernels import gemm
    from tinyserve.models.loader import checkpoint_dtype, layer_matmuls

    if not gemm.available():
        return resolve_dtype(dtype, device), quantization
    shapes = layer_matmuls(model, quantization)
    if any(k % 32 for _, _, k in shapes):  # no kernel weight (gemm.from_dense) to time
        logger.info("--dtype auto -> float32: an input width is not a multiple of 32, so "
                    "the kernels take only the layers they can; not measured")  # fmt: skip
        return torch.float32, quantization
    if quantization not in (None, "none"):  # int8 / bf16 weights run on the kernels only
        logger.info(
            "--dtype auto -> float32: --quantization %s runs on the CPU kernels", quantization
        )
        return torch.float32, quantization
    from tinyserve.layers.linear import resolve_kernel_activations

    bf16_weights = (
        bf16_weights and quantization is None and gemm.bf16_available()
        and resolve_kernel_activations(kernel_activations) == "bfloat16"
        and all(kind == gemm.F32 for kind, _, _ in shapes)
        and checkpoint_dtype(model) == torch.bfloat16
    )  # fmt: skip
    choice = choose_cpu_dtype(shapes, kernel_activations, bf16_weights)
    took = str(choice.dtype).replace("torch.", "") + (
        " + bf16 weights" if choice.quantization else ""
    )
    logger.info("--dtype auto -> %s: %s", took, choice.reason)
    return choice.dtype, choice.quantization or quantization

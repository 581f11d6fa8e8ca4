#!/usr/bin/env python
"""The CPU kernels at few rows, this tree against a git revision, side by side in one run.

What a decode step (1 row) and a speculative verification step (1 + k rows of one
sequence) cost in the two kernels that dominate them, on SmolLM2-135M's shapes:

matmuls    the 121 products of one step: per layer qkv 960x576, o 576x576, gate_up
           3072x576 (Q4_1 blocks), down 576x1536, x 30 layers, plus the 49152x576 Q8_0 LM
           head; random blocks, the given row counts
attention  30 layers of paged attention, 9 query / 3 KV heads of 64, block size 16, one
           sequence whose last row sees --context keys, the given query rows

Both versions of gemm.c / attention.c (and simd.h) are compiled here with the kernels'
flags and timed alternately, min and median of --reps; outputs are compared bitwise (and, where
the revisions sum in different orders, by their largest difference relative to the output).
Each revision gets the weight layout its gemm.c reads (``gemm_layout()``: the grouped
layout, in groups of ``gemm_group_width()`` outputs; revisions without it read the
checkpoint's rows of blocks). ``--baseline-isa`` / ``--isa`` build either side for another
ISA level this CPU runs (e.g. ``--baseline-rev HEAD --baseline-isa avx2``: this tree's AVX2
kernels against its AVX-512 ones).

``--bf16`` times this tree's gemm with bf16 activations (gemm_bf16.h) against the baseline's
float ones (e.g. ``--baseline-rev HEAD --bf16 --rows 1,8,32,128``); ``--bf16-both`` gives
both sides bf16 activations (a change to the bf16 tiles).

python benchmarks/bench_kernels.py [--baseline-rev HEAD~2] [--baseline-isa avx2] [--isa LEVEL]
    [--bf16 | --bf16-both] [--rows 1,2,3,4,5,6,8] [--attention-rows 1,5,9] [--context 600]
    [--out benchmarks/results/kernels.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from machine import machine_info  # noqa: E402

from tinyserve.kernels import gemm  # noqa: E402
from tinyserve.kernels.build import built, isa_level  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KDIR = "tinyserve/kernels"
P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def build(src_dir: Path, name: str, level: str | None) -> ctypes.CDLL:
    """``src_dir``'s <name>.c for ISA ``level``, through the kernel cache (a revision whose
    sources equal this tree's, e.g. HEAD on a clean checkout, is the same library)."""
    return ctypes.CDLL(str(built(name, level, src_dir)))


def sources_at(rev: str, dest: Path) -> Path:
    """The kernels' sources at ``rev``: the three timed .c files and every header beside
    them then (gemm_bf16.h, gemm_amx.h, ... come and go between revisions)."""
    dest.mkdir(parents=True)
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KDIR}"], cwd=ROOT,
                            capture_output=True, text=True)  # fmt: skip
    if listed.returncode:
        raise RuntimeError(f"git ls-tree {rev}:{KDIR}: {listed.stderr.strip()}")
    headers = [n for n in listed.stdout.split() if n.endswith(".h")]
    for name in ("gemm.c", "qgemm.c", "attention.c", *headers):
        shown = subprocess.run(["git", "show", f"{rev}:{KDIR}/{name}"], cwd=ROOT,
                               capture_output=True, text=True)  # fmt: skip
        if shown.returncode:
            raise RuntimeError(f"git show {rev}:{KDIR}/{name}: {shown.stderr.strip()}")
        (dest / name).write_text(shown.stdout)
    return dest


def step_weights() -> list[gemm.PackedWeight]:
    g = torch.Generator().manual_seed(0)

    def q4_1(n, k):
        qs = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
        return gemm.PackedWeight(gemm.Q4_1, qs, torch.rand(n, k // 32, generator=g),
                                 torch.rand(n, k // 32, generator=g), (n, k))  # fmt: skip

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    ws = [q4_1(n, k) for _ in range(30) for n, k in shapes]
    qs = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g)
    ws.append(gemm.PackedWeight(gemm.Q8_0, qs, torch.rand(49152, 18, generator=g), None,
                                (49152, 576)))  # fmt: skip
    return ws


def layout_of(lib: ctypes.CDLL) -> int:
    """0: the checkpoint's rows of blocks (gemm.c before the grouped layout), else the width
    of gemm.c's groups of outputs (8 before AVX-512 kernels; PackedWeight.kernel)."""
    if not hasattr(lib, "gemm_layout"):
        return 0
    return lib.gemm_group_width() if hasattr(lib, "gemm_group_width") else 8


def time_matmuls(libs, ws, m: int, reps: int, entry: str = "gemm", flags=(0, 0)):
    """Times per library, whether the outputs are bitwise the same, and the largest
    difference relative to the output's largest magnitude. ``entry`` "qgemm": qgemm.c
    (int8 activations), which reads the checkpoint's rows of blocks. ``flags``: or-ed into
    each library's weight kind (gemm.BF16_ACT: the bf16-activation tiles)."""
    fns = [getattr(f, entry) for f in libs]
    for f in fns:
        f.argtypes, f.restype = [I32, P, P, P, P, I64, P, I64, I64, I64, I32, I32], None
    views = [[gemm.KernelWeight.of(w, layout_of(lib)) if entry == "gemm" and layout_of(lib)
              else w for w in ws] for lib in libs]  # fmt: skip
    g = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
    outs = [[torch.empty(m, w.shape[0]) for w in ws] for _ in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            for w, y in zip(views[i], outs[i], strict=True):
                n, k = w.shape
                m_ptr = None if w.m is None else w.m.data_ptr()
                f(gemm._KIND_IDS[w.kind] | flags[i], w.qs.data_ptr(), w.d.data_ptr(), m_ptr,
                  xs[k].data_ptr(), k, y.data_ptr(), n, n, k, m, 2)  # fmt: skip
            times[i].append((time.perf_counter() - t) * 1e3)
    pairs = [(a, b) for o in outs[1:] for a, b in zip(outs[0], o, strict=True)]
    same = all(torch.equal(a, b) for a, b in pairs)
    rel = max(((a - b).abs().max() / a.abs().max()).item() for a, b in pairs)
    return times, same, rel


def time_attention(fns, t_rows: int, context: int, reps: int):
    # Builds since sliding windows take the window (0: none) after the scale.
    windowed = [hasattr(f, "attention_window") for f in fns]
    fns = [f.paged_attention for f in fns]
    for f, w in zip(fns, windowed, strict=True):
        f.argtypes = [P, I64, P, P, I32, I32, I32, I32, P, P, P, I64, P, I64, ctypes.c_float,
                      *([I64] if w else []), P, I32]  # fmt: skip
        f.restype = ctypes.c_int
    g = torch.Generator().manual_seed(t_rows)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    nblk = context // bs + 2
    caches = [(torch.randn(2 * nblk, bs, kv_heads, dim, generator=g),
               torch.randn(2 * nblk, bs, kv_heads, dim, generator=g)) for _ in range(30)]  # fmt: skip
    table = torch.randperm(2 * nblk, generator=g)[:nblk].to(torch.int32)[None].contiguous()
    q = torch.randn(t_rows, heads, dim, generator=g)
    qsl, lens = torch.tensor([0, t_rows]), torch.tensor([context])
    sot = torch.zeros(t_rows, dtype=torch.int64)
    outs = [torch.empty(t_rows, heads, dim) for _ in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            for k, v in caches:
                f(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), bs, heads, kv_heads,
                  dim, qsl.data_ptr(), lens.data_ptr(), sot.data_ptr(), t_rows,
                  table.data_ptr(), table.shape[1], dim**-0.5, *([0] if windowed[i] else []),
                  outs[i].data_ptr(), 2)  # fmt: skip
            times[i].append((time.perf_counter() - t) * 1e3)
    diff = max((outs[0] - o).abs().max().item() for o in outs[1:])
    return times, diff


def summary(times: list[list[float]]) -> list[dict]:
    return [{"min_ms": round(min(t), 2), "median_ms": round(statistics.median(t), 2)}
            for t in times]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--baseline-rev", default="HEAD~2")
    p.add_argument("--baseline-isa", default=None, help="ISA level of the baseline build")
    p.add_argument("--isa", default=None, help="ISA level of this tree's build")
    p.add_argument("--rows", default="1,2,3,4,5,6,8")
    p.add_argument("--attention-rows", default="1,5,9")
    p.add_argument("--q8-rows", default="1,2", help="rows for qgemm.c ('' for none)")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="this tree's gemm with bf16 "
        "activations (AVX512-BF16), against the baseline's float32 ones",
    )
    p.add_argument(
        "--bf16-both",
        action="store_true",
        help="bf16 activations on both sides (a change to the bf16 tiles against the baseline's)",
    )
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--out", default="benchmarks/results/kernels.json")
    args = p.parse_args()
    if isa_level() is None:
        sys.exit("the CPU kernels need AVX2/FMA/F16C")
    with tempfile.TemporaryDirectory() as tmp:
        base = sources_at(args.baseline_rev, Path(tmp) / "baseline")
        here = ROOT / KDIR
        lv = (args.baseline_isa or isa_level(), args.isa or isa_level())
        gemms = [build(base, "gemm", lv[0]), build(here, "gemm", lv[1])]
        qgemms = [build(base, "qgemm", lv[0]), build(here, "qgemm", lv[1])]
        attns = [build(base, "attention", lv[0]), build(here, "attention", lv[1])]
        ws = step_weights()
        args.bf16 = args.bf16 or args.bf16_both
        if args.bf16_both and not gemms[0].gemm_bf16():
            sys.exit(
                "--bf16-both: the baseline's gemm has no bf16 tiles at ISA level " + str(lv[0])
            )
        if args.bf16 and not gemms[1].gemm_bf16():
            sys.exit("--bf16: this tree's gemm has no bf16 tiles at ISA level " + str(lv[1]))
        result = {"baseline_rev": args.baseline_rev, "baseline_isa": lv[0], "isa": lv[1],
                  "bf16_activations": args.bf16, "baseline_bf16_activations": args.bf16_both,
                  "machine": machine_info(),
                  "matmuls": [], "q8_matmuls": [], "attention": []}  # fmt: skip
        print(f"{'':10} {'rows':>4} {'baseline min/med ms':>20} {'this tree':>16} {'ratio':>6}")
        runs = [("matmuls", gemms, "gemm", r) for r in args.rows.split(",")]
        runs += [("q8_matmuls", qgemms, "qgemm", r) for r in args.q8_rows.split(",") if r]
        for what, libs, entry, rows in runs:
            m = int(rows)
            bf = gemm.BF16_ACT if entry == "gemm" else 0
            flags = (bf if args.bf16_both else 0, bf if args.bf16 else 0)
            times, same, rel = time_matmuls(libs, ws, m, args.reps, entry, flags)
            base_s, here_s = summary(times)
            result[what].append({"rows": m, "baseline": base_s, "this": here_s,
                                 "bitwise_same": same, "max_rel_diff": rel})  # fmt: skip
            print(f"{what:10} {m:4d} {base_s['min_ms']:9.1f}/{base_s['median_ms']:<9.1f} "
                  f"{here_s['min_ms']:7.1f}/{here_s['median_ms']:<7.1f} "
                  f"{base_s['min_ms'] / here_s['min_ms']:6.2f}"
                  f"{'' if same else f'  differ by {rel:.1e} of max'}")  # fmt: skip
        for t_rows in [int(r) for r in args.attention_rows.split(",")]:
            times, diff = time_attention(attns, t_rows, args.context, args.reps)
            base_s, here_s = summary(times)
            result["attention"].append({"rows": t_rows, "context": args.context,
                                        "baseline": base_s, "this": here_s,
                                        "max_abs_diff": diff})  # fmt: skip
            print(f"{'attention':10} {t_rows:4d} {base_s['min_ms']:9.1f}/{base_s['median_ms']:<9.1f} "
                  f"{here_s['min_ms']:7.1f}/{here_s['median_ms']:<7.1f} "
                  f"{base_s['min_ms'] / here_s['min_ms']:6.2f}  max |diff| {diff:.1e}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

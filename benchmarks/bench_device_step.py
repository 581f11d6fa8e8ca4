#!/usr/bin/env python
"""Decode-step anatomy on any device (CUDA first: scripts/gpu_check.sh runs it there):
step time in steady decode per batch size, and from torch.profiler per step: kernel launches
(cudaLaunchKernel / cuLaunchKernel), synchronising scalar reads (aten::_local_scalar_dense:
.item() / .tolist() / bool()), host<->device copies (cudaMemcpy*), and aten ops. On a CPU the
launch and copy counts are 0 and the aten op count is the number of torch dispatches.

CUDA graphs (issue 16, item 4) are not built yet: every step here is eager.

python benchmarks/bench_device_step.py --model DIR --device cuda --dtype bfloat16 \
    [--batch-sizes 1,8,64] [--steps 20] [--out results/device_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import steady_decode  # noqa: E402
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

import torch  # noqa: E402

from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.llm_engine import LLMEngine  # noqa: E402

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SCALAR_READ = "aten::_local_scalar_dense"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_events(engine: LLMEngine, steps: int, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    counts: Counter = Counter()
    for e in prof.events():
        name = e.name
        if name in LAUNCH:
            counts["launches"] += 1
        elif name == SCALAR_READ:
            counts["scalar_reads"] += 1
        elif name.startswith("cudaMemcpy"):
            counts["memcpy_calls"] += 1
        elif name.startswith("cudaStreamSynchronize") or name == "cudaDeviceSynchronize":
            counts["stream_syncs"] += 1
        elif name.startswith("aten::"):
            counts["aten_ops"] += 1
    return {f"{k}_per_step": v / steps for k, v in sorted(counts.items())}


def measure(engine: LLMEngine, batch: int, steps: int, device: torch.device) -> dict:
    steady_decode(engine, batch, 3 * steps + 16, warm_steps=3)  # timed + profiled steps
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t)
    row = {"batch": batch, "step_ms": 1000 * statistics.median(times),
           "tok_s": batch / statistics.median(times), "cuda_graphs": False}  # fmt: skip
    row.update(count_events(engine, min(steps, 5), device))
    for rid in list(engine.output_processor.parents):
        engine.abort(rid)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--out", default="benchmarks/results/device_step.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, dtype=args.dtype,
                                  max_num_seqs=max(batches), load_tokenizer=False,
                                  kv_cache_memory=args.kv_cache_memory))  # fmt: skip
    device = engine.executor.device
    rows = []
    for b in batches:
        rows.append(measure(engine, b, args.steps, device))
        print(json.dumps(rows[-1]), flush=True)
    result = {"machine": machine_info(), "device": str(device),
              "dtype": str(engine.executor.dtype), "rows": rows}  # fmt: skip
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

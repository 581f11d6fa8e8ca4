#!/usr/bin/env python
"""Decode-step anatomy on any device (CUDA first: scripts/gpu_check.sh runs it there):
step time in steady decode per batch size, and from torch.profiler per step: kernel launches
(cudaLaunchKernel / cuLaunchKernel), synchronising scalar reads (aten::_local_scalar_dense:
.item() / .tolist() / bool()), host<->device copies (cudaMemcpy*), and aten ops. On a CPU the
launch and copy counts are 0 and the aten op count is the number of torch dispatches.

Each mode is one engine, built and dropped in turn: ``graphs`` (CUDA graphs for decode, the
default on CUDA), ``eager`` (``--enforce-eager``: the same Triton decode attention, launched
op by op) and ``eager-sdpa`` (eager with the masked SDPA rectangle instead of the Triton
kernel: TINYSERVE_TRITON_ATTENTION=0). On a CPU only ``eager`` exists.

python benchmarks/bench_device_step.py --model DIR --device cuda --dtype bfloat16 \
    [--batch-sizes 1,8,64] [--steps 20] [--modes graphs,eager,eager-sdpa] \
    [--out results/device_step.json]
"""

from __future__ import annotations

import argparse
import gc
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
from tinyserve.worker.device import resolve_device  # noqa: E402

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
    graphs = engine.executor.runner.decode_graphs
    replays = graphs.num_replays if graphs is not None else 0
    row = {"batch": batch, "step_ms": 1000 * statistics.median(times),
           "tok_s": batch / statistics.median(times)}  # fmt: skip
    row.update(count_events(engine, min(steps, 5), device))
    # Every profiled step took the graph: a replay per step (not a silent eager fallback).
    row["graph_replays_per_step"] = (
        (graphs.num_replays - replays) / min(steps, 5) if graphs is not None else 0.0
    )
    for rid in list(engine.output_processor.parents):
        engine.abort(rid)
    return row


def _engine(args, mode: str, max_batch: int) -> LLMEngine:
    os.environ["TINYSERVE_TRITON_ATTENTION"] = "0" if mode == "eager-sdpa" else "1"
    return LLMEngine(EngineArgs(model=args.model, device=args.device, dtype=args.dtype,
                                max_num_seqs=max_batch, load_tokenizer=False,
                                speculative_config=None,  # plain decode steps
                                kv_cache_memory=args.kv_cache_memory,
                                enforce_eager=mode != "graphs"))  # fmt: skip


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
    ap.add_argument("--modes", default="graphs,eager,eager-sdpa")
    ap.add_argument("--out", default="benchmarks/results/device_step.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    rows, result = [], {"machine": machine_info(), "modes": {}}
    cuda = resolve_device(args.device).type == "cuda"
    for mode in modes:
        if not cuda and mode != "eager":
            continue  # graphs and the Triton choice exist on CUDA only
        engine = _engine(args, mode, max(batches))
        device = engine.executor.device
        graphs = engine.executor.runner.decode_graphs
        result["modes"][mode] = {
            "cuda_graphs": graphs is not None,
            "capture_s": graphs.capture_seconds if graphs is not None else None,
            "attention": engine.executor.model.attention_backend,
        }
        for b in batches:
            rows.append({"mode": mode, **measure(engine, b, args.steps, device)})
            print(json.dumps(rows[-1]), flush=True)
        result.update(device=str(device), dtype=str(engine.executor.dtype))
        if device.type == "cuda":
            result["gpu"] = torch.cuda.get_device_name(device)
        del engine, graphs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["rows"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

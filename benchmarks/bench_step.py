#!/usr/bin/env python
"""Decode-step anatomy by batch size, side by side with the matmul floor, in one run, for
the engine with the CPU kernels (the default: the GGUF's blocks, block-table attention,
fused elementwise ops), with them and --decode-activations int8 (decode rows' activations
rounded to int8 for integer dot products), and without them (--no-cpu-kernels: torch's fp32
GEMM and SDPA); and the kernels with the decoder layers looped in Python (--no-fused-step)
instead of one C call; on a CPU with AVX512-BF16 (where the default rounds the kernels'
activations to bf16), also --kernel-activations float32.

matmul floor   the bare fp32 matrix products of one decode step (every layer's qkv, o,
               gate_up, down, plus the LM head) on random activations: what a pure-PyTorch
               fp32 engine cannot go below
bf16 floor     the same in bf16 (what torch's bf16 GEMM costs on this CPU)
kernel floor   the same products through the model's linear layers (the CPU kernel on the
               packed weights: the GGUF's blocks); "int8-decode kernel" with int8 activations
step           one LLMEngine.step() in steady decode
model          the model's forward + LM head (logits of the sampled rows)
sampler        the batched sampler
overhead       step - model - sampler: scheduling, batch building, metadata, host copy,
               detokenizing — the engine's own cost

python benchmarks/bench_step.py [--batch-sizes 1,8,16,32] [--steps 30] [--out benchmarks/results/step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.llm_engine import LLMEngine  # noqa: E402
from tinyserve.kernels import gemm  # noqa: E402
from tinyserve.sampling_params import SamplingParams  # noqa: E402


def _median_ms(run, iters: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            run()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _shape(layer) -> tuple[int, int]:
    """A linear's [out, in]: from its kernel's weight where it has one (the float copy of
    an int8 / bf16 layer is freed at load)."""
    kernel = getattr(layer.method, "kernel", None)
    return tuple(kernel.shape) if kernel is not None else tuple(layer.weight.shape)


def matmul_floor_ms(model, batch: int, iters: int, dtype: torch.dtype) -> float:
    """The bare torch matrix products of one step in ``dtype`` (activations in the same
    dtype), on random weights of the model's shapes: what a pure-PyTorch engine cannot
    go below."""
    shapes = [_shape(layer) for layer in model.linear_layers().values()]
    weights = [torch.randn(*shape).to(dtype) * 0.02 for shape in shapes]
    xs = {k: torch.randn(batch, k).to(dtype) for _, k in shapes}

    def run():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    return _median_ms(run, iters)


def kernel_floor_ms(model, batch: int, iters: int) -> float:
    """The same products through the model's own linear layers and their methods (the CPU
    kernel on the packed weights), as decode rows (so --decode-activations int8 applies),
    on activations in the model's dtype (what its forward gives them)."""
    layers = list(model.linear_layers().values())
    xs = {k: torch.randn(batch, k, dtype=model.dtype) for k in (_shape(m)[1] for m in layers)}

    def run():
        for m in layers:
            m.method.apply(m, xs[m.weight.shape[1]], batch)

    return _median_ms(run, iters)


def steady_decode(engine: LLMEngine, batch: int, max_tokens: int, warm_steps: int = 2) -> None:
    """``batch`` greedy requests of 25-token prompts, stepped until every prompt is computed
    (and ``warm_steps`` more): every later step is a pure decode of ``batch`` rows."""
    for i in range(batch):
        prompt = [1] + [300 + (7 * i + j) % 5000 for j in range(24)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"b{batch}-{i}", prompt, params)
    sched = engine.core.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        engine.step()
    for _ in range(warm_steps):
        engine.step()


def step_anatomy(engine: LLMEngine, batch: int, steps: int) -> dict:
    runner = engine.executor.runner
    model = runner.model
    timers: dict[str, list[float]] = {"model": [], "sampler": []}
    originals = {"forward": model.forward, "compute_logits": model.compute_logits}
    sampler = runner.sampler

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timers[key].append(time.perf_counter() - t)
            return out

        return wrapper

    steady_decode(engine, batch, steps + 8)
    step_times = []
    model.forward = timed(originals["forward"], "model")
    model.compute_logits = timed(originals["compute_logits"], "model")
    runner.sampler = timed(sampler, "sampler")
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
    finally:
        model.forward, model.compute_logits = originals["forward"], originals["compute_logits"]
        runner.sampler = sampler
    for rid in list(engine.output_processor.parents):
        engine.abort(rid)
    step_ms = 1000 * statistics.median(step_times)
    # forward and LM head alternate in timers["model"]: pair them per step
    pairs = [a + b for a, b in zip(timers["model"][::2], timers["model"][1::2], strict=True)]
    model_ms = 1000 * statistics.median(pairs)
    sampler_ms = 1000 * statistics.median(timers["sampler"])
    overhead = step_ms - model_ms - sampler_ms
    return {
        "batch": batch,
        "step_ms": step_ms,
        "model_ms": model_ms,
        "sampler_ms": sampler_ms,
        "overhead_ms": overhead,
        "overhead_share": overhead / step_ms,
        "tok_s": batch / (step_ms / 1000),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,16,32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/step.json")
    ap.add_argument("--paths", default=None, help="comma-separated path names (default: all)")
    args = ap.parse_args(argv)
    # path name -> engine flags: the default, the int8-activation opt-in, torch's GEMM + SDPA.
    paths = {
        "kernels": {},
        "kernels+int8-decode": {"decode_activations": "int8"},
        "kernels, layer loop in Python": {"fused_step": False},
        "torch": {"cpu_kernels": False},
    }
    if gemm.bf16_available():  # the default rounds activations to bf16: float32's cost beside
        paths["kernels, float32 activations"] = {"kernel_activations": "float32"}
    if args.paths:  # the int8 floor needs its engine
        keep = {"kernels", "kernels+int8-decode", *args.paths.split(",")}
        paths = {k: v for k, v in paths.items() if k in keep}
    engines = {
        name: LLMEngine(
            EngineArgs(
                model=args.model,
                dtype=args.dtype,
                kv_cache_memory="512MiB",
                max_num_seqs=64,
                speculative_config=None,  # steady decode steps, no drafts
                **flags,
            )
        )  # fmt: skip
        for name, flags in paths.items()
    }
    engine = engines["kernels"]
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        floor = matmul_floor_ms(engine.executor.model, b, args.steps, torch.float32)
        bf16_floor = matmul_floor_ms(
            engine.executor.model, b, max(3, args.steps // 5), torch.bfloat16
        )
        kfloor = kernel_floor_ms(engine.executor.model, b, args.steps)
        int8_floor = kernel_floor_ms(engines["kernels+int8-decode"].executor.model, b, args.steps)
        for name, eng in engines.items():
            row = step_anatomy(eng, b, args.steps)
            row["path"] = name
            row["cpu_kernels"] = name != "torch"
            row["dtype"] = str(eng.executor.dtype)
            row["matmul_floor_ms"] = floor
            row["bf16_matmul_floor_ms"] = bf16_floor
            row["kernel_floor_ms"] = kfloor
            row["int8_decode_kernel_floor_ms"] = int8_floor
            row["floor_tok_s"] = b / (floor / 1000)
            row["fraction_of_floor"] = floor / row["step_ms"]
            rows.append(row)
            print(
                f"batch {b:>3} {name:<29}: step {row['step_ms']:.1f} ms "
                f"({row['tok_s']:.1f} tok/s), model {row['model_ms']:.1f} ms, sampler "
                f"{row['sampler_ms']:.1f} ms, engine overhead {row['overhead_ms']:.1f} ms "
                f"({100 * row['overhead_share']:.0f}%); floors: fp32 {floor:.1f} ms, bf16 "
                f"{bf16_floor:.1f} ms, kernel {kfloor:.1f} ms, int8-decode kernel "
                f"{int8_floor:.1f} ms",
                flush=True,
            )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dtype": str(engine.executor.dtype),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

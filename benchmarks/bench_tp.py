#!/usr/bin/env python
"""Tensor parallel vs one process, side by side on this machine.

Two models: SmolLM2-135M itself at TP=1 and TP=3 (9 heads, 3 KV heads: 3 is the only size
above 1 that divides them), and a random Llama of SmolLM2's shape but 8 heads / 4 KV heads
(head_dim 72) at TP=1 and TP=2. For each: decode step time at batch 1 and output tok/s at
batch 16 (greedy, ignore_eos, fp32), medians of ``--repeats`` interleaved runs; the
all-reduce count and bytes per token (2 x layers x hidden x 4 bytes); and the latency of a
bare gloo all-reduce of one token's hidden state between the ranks.

    python benchmarks/bench_tp.py            # -> benchmarks/results/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.checkpoints import smollm2_shaped  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def measure(model: str, tp: int, batch1_tokens: int, batch16_tokens: int) -> dict:
    from tinyserve.engine.arg_utils import EngineArgs
    from tinyserve.engine.llm_engine import LLMEngine
    from tinyserve.sampling_params import SamplingParams

    t0 = time.monotonic()
    engine = LLMEngine(
        EngineArgs(
            model=model,
            dtype="float32",
            device="cpu",
            tensor_parallel_size=tp,
            load_tokenizer=False,
            kv_cache_memory="256MiB",
            speculative_config=None,  # decode steps alike on both sides
        )
    )
    load_s = time.monotonic() - t0
    vocab = engine.vocab_size
    try:

        def run(num: int, max_tokens: int) -> tuple[list[float], int]:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            g = torch.Generator().manual_seed(num)
            for i in range(num):
                prompt = torch.randint(0, vocab, (24,), generator=g).tolist()
                engine.add_request(f"r{num}-{i}-{time.monotonic_ns()}", prompt, params)
            steps, tokens = [], 0
            while engine.has_unfinished():
                s0 = time.perf_counter()
                outs = engine.step()
                steps.append(time.perf_counter() - s0)
                tokens += sum(len(o.new_token_ids) for o in outs)
            return steps, tokens

        run(1, 4)  # warm-up
        before = engine.executor.runner.tp.num_all_reduces
        steps1, _ = run(1, batch1_tokens)
        reduces_per_step = (engine.executor.runner.tp.num_all_reduces - before) / len(steps1)
        steps16, tokens16 = run(16, batch16_tokens)
        decode16 = steps16[1:]  # the first step is the prefill of all 16
        return {
            "load_s": round(load_s, 2),
            "batch1_step_ms_median": round(1000 * statistics.median(steps1[1:]), 2),
            "batch16_decode_tok_s": round(16 * len(decode16) / sum(decode16), 1),
            "batch16_tokens": tokens16,
            "all_reduces_per_step": reduces_per_step,
        }
    finally:
        engine.close()


def _allreduce_rank(rank: int, size: int, init: str, hidden: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        res = {}
        for rows in (1, 16):
            x = torch.randn(rows, hidden)
            for _ in range(20):
                dist.all_reduce(x)
            times = []
            for _ in range(300):
                t = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t)
            res[rows] = round(1e6 * statistics.median(times), 1)
        # The per-step broadcast of the batch: a decode step of 16 requests, 8 blocks each.
        from tinyserve.worker.model_runner import StepInput

        step = StepInput(list(range(16)), [100] * 16, [1] * 16, [101] * 16, [list(range(8))] * 16)
        times = []
        for i in range(220):
            t = time.perf_counter()
            dist.broadcast_object_list([step if rank == 0 else None], src=0)
            if i >= 20:
                times.append(time.perf_counter() - t)
        res["broadcast_step_input_16"] = round(1e6 * statistics.median(times), 1)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def allreduce_latency_us(size: int, hidden: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ar.json")
        from tinyserve.testing.server import free_port

        init = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_allreduce_rank, args=(size, init, hidden, out), nprocs=size)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch1-tokens", type=int, default=48)
    p.add_argument("--batch16-tokens", type=int, default=24)
    p.add_argument("--out", default=str(RESULTS / "tp.json"))
    args = p.parse_args(argv)

    from tinyserve.models.default_model import ensure_default_model
    from tinyserve.utils.cache import cache_dir

    smol = str(ensure_default_model(progress=False))
    shaped = str(smollm2_shaped(cache_dir() / "models" / "bench-smollm2-shape-8-heads"))
    configs = [("SmolLM2-135M (GGUF, 9 heads / 3 KV)", smol, 3), ("SmolLM2-shaped random Llama (8 heads / 4 KV)", shaped, 2)]  # fmt: skip
    hidden, layers = 576, 30
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "dtype": "float32",
        "all_reduce_bytes_per_token": 2 * layers * hidden * 4,
        "machine": machine_info(),
        "models": [],
    }
    for name, path, tp in configs:
        runs: dict[int, list[dict]] = {1: [], tp: []}
        for r in range(args.repeats):
            for size in (1, tp) if r % 2 == 0 else (tp, 1):
                m = measure(path, size, args.batch1_tokens, args.batch16_tokens)
                print(f"{name} TP={size} run {r}: {m}", file=sys.stderr, flush=True)
                runs[size].append(m)
        entry = {"name": name, "tp": tp, "per_size": {}}
        for size, ms in runs.items():
            entry["per_size"][str(size)] = {
                "load_s": statistics.median(m["load_s"] for m in ms),
                "batch1_step_ms": statistics.median(m["batch1_step_ms_median"] for m in ms),
                "batch16_tok_s": statistics.median(m["batch16_decode_tok_s"] for m in ms),
                "all_reduces_per_step": ms[0]["all_reduces_per_step"],
                "runs": ms,
            }
        one, many = entry["per_size"]["1"], entry["per_size"][str(tp)]
        entry["batch1_speedup"] = round(one["batch1_step_ms"] / many["batch1_step_ms"], 3)
        entry["batch16_speedup"] = round(many["batch16_tok_s"] / one["batch16_tok_s"], 3)
        entry["bare_all_reduce_us"] = allreduce_latency_us(tp, hidden)
        result["models"].append(entry)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "models"}, indent=2))
    for e in result["models"]:
        print(e["name"], {k: v for k, v in e.items() if k not in ("per_size", "name")})
        for size, v in e["per_size"].items():
            print(f"  TP={size}", {k: x for k, x in v.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

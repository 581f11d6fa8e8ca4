#!/usr/bin/env python
"""What the live engine view (GET /v1/engine/events) costs the engine.

The same offline workload (N requests, greedy, fixed prompt and output lengths, unique
prompts per run) through one AsyncEngine, without a watcher (off) and with one (on: a
subscriber at --interval-ms that JSON-encodes every snapshot on the loop, as the SSE route
does), interleaved A/B (on first in odd repetitions). Per run: throughput, the mean and median
interval between step starts (the engine thread's whole iteration: step, stats, the view's
records and snapshots), and engine.step's own time. Then the unit cost of one snapshot (µs)
on the engine's pool with the workload's requests in flight.

python benchmarks/bench_engine_events.py                 # SmolLM2 (the default model)
python benchmarks/bench_engine_events.py --tiny --reps 3  # a tiny random Qwen2, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.async_engine import AsyncEngine  # noqa: E402
from tinyserve.sampling_params import SamplingParams  # noqa: E402


def make_engine(args):
    from tinyserve.engine.llm_engine import LLMEngine

    kw = dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(64, args.requests),
              speculative_config=None)  # fmt: skip
    if args.tiny:
        from tinyserve.testing.checkpoints import engine_qwen2

        path = engine_qwen2(Path(tempfile.mkdtemp(prefix="bench_events_")))
        kw.update(model=str(path), load_tokenizer=False, num_blocks=2048, block_size=4)
        kw.pop("kv_cache_memory")
    return LLMEngine(EngineArgs(**kw))


def timed_steps(engine) -> list[tuple[float, float]]:
    """Wrap engine.step: (start, end) perf_counter times of every call, appended."""
    step, seen = engine.step, []

    def timed():
        t0 = time.perf_counter()
        out = step()
        seen.append((t0, time.perf_counter()))
        return out

    engine.step = timed
    return seen


async def one_run(front, steps, args, run: int, watched: bool) -> dict:
    rng = random.Random(run)
    vocab = front.info.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]]
    prompts += [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
                for _ in range(args.requests - 1)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    snapshots = {"n": 0, "bytes": 0}
    watcher = front.view_feed.subscribe(args.interval_ms / 1000.0) if watched else None

    async def consume():
        while (snap := await watcher.get()) is not None:
            snapshots["n"] += 1
            snapshots["bytes"] += len(json.dumps(snap, separators=(",", ":")))

    consumer = asyncio.ensure_future(consume()) if watched else None
    await asyncio.sleep(0.05)  # let the connect snapshot go by
    del steps[:]

    async def request(i: int) -> int:
        n = 0
        async for out in front.generate(f"run{run}-{i}", prompts[i], params):
            n += len(out.new_token_ids)
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(request(i) for i in range(args.requests))))
    wall = time.perf_counter() - t0
    spans = list(steps)
    if watched:
        await asyncio.sleep(0.05)  # the idle snapshot
        watcher.close()
        consumer.cancel()
    intervals = [b[0] - a[0] for a, b in zip(spans, spans[1:], strict=False)]
    return {
        "run": run,
        "watched": watched,
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "steps": len(spans),
        "mean_interval_ms": 1000 * statistics.fmean(intervals),
        "median_interval_ms": 1000 * statistics.median(intervals),
        "mean_step_ms": 1000 * statistics.fmean(e - s for s, e in spans),
        "snapshots": snapshots["n"],
        "snapshot_bytes": snapshots["bytes"],
    }


def snapshot_cost(engine, args) -> dict:
    """µs per EngineCore.snapshot() with the workload's requests in flight (after 3 steps)."""
    rng = random.Random(12345)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        prompt = [rng.randrange(10, engine.info.vocab_size) for _ in range(args.prompt_tokens)]
        engine.add_request(f"cost{i}", prompt, params)
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        engine.snapshot(take_steps=False)
        times.append(time.perf_counter() - t0)
    snap = engine.snapshot(take_steps=False)
    # One step's record (begin_step + end_step) on a schedule of the in-flight requests.
    view, sched = engine.core.view, engine.core.scheduler.schedule()
    view.watch(True)
    record = []
    for _ in range(200):
        t0 = time.perf_counter()
        view.begin_step(0, sched)
        view.end_step(1.0)
        record.append(time.perf_counter() - t0)
    view.watch(False)
    for i in range(args.requests):
        engine.abort(f"cost{i}")
    return {
        "record_median_us": 1e6 * statistics.median(record),
        "median_us": 1e6 * statistics.median(times),
        "p90_us": 1e6 * sorted(times)[int(0.9 * len(times))],
        "num_blocks": snap["kv"]["total"],
        "blocks_used": snap["kv"]["used"],
        "requests": len(snap["requests"]),
        "json_bytes": len(json.dumps(snap, separators=(",", ":"))),
    }


def summarize(runs: list[dict]) -> dict:
    pairs = {}
    for r in runs:
        pairs.setdefault(r["run"] // 2, {})[r["watched"]] = r
    ratios = {"tok_s": [], "mean_interval_ms": [], "median_interval_ms": [], "mean_step_ms": []}
    for pair in pairs.values():
        if len(pair) == 2:
            for key, values in ratios.items():
                values.append(pair[True][key] / pair[False][key])
    return {f"median_ratio_on_off_{k}": statistics.median(v) for k, v in ratios.items() if v}


async def main_async(args) -> dict:
    engine = make_engine(args)
    steps = timed_steps(engine)
    front = AsyncEngine(engine, max_queued_requests=1024)
    front.start()
    await one_run(front, steps, args, -1, False)  # warm-up, not counted
    runs = []
    for rep in range(args.reps):
        for watched in (rep % 2 == 1, rep % 2 == 0):
            r = await one_run(front, steps, args, 2 * rep + int(watched), watched)
            runs.append(r)
            print(
                f"rep {rep} {'on ' if watched else 'off'}: {r['tok_s']:.1f} tok/s, "
                f"step interval mean {r['mean_interval_ms']:.2f} ms "
                f"median {r['median_interval_ms']:.2f} ms, {r['snapshots']} snapshots",
                flush=True,
            )
    front.shutdown()
    engine.step = type(engine).step.__get__(engine)
    return {"runs": runs, "summary": summarize(runs), "snapshot_cost": snapshot_cost(engine, args)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 instead of SmolLM2")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="A/B pairs")
    p.add_argument("--interval-ms", type=int, default=250)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"args": vars(args), "machine": machine_info(), **asyncio.run(main_async(args))}
    print(json.dumps({"summary": result["summary"], "snapshot_cost": result["snapshot_cost"]},
                     indent=1))  # fmt: skip
    day = datetime.date.today().isoformat()
    out = Path(args.out or Path(__file__).parent / "results" / f"engine_events_{day}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

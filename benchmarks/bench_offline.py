#!/usr/bin/env python
"""Offline tables on our engine (no HTTP), like the seed projects' READMEs:

modes     singleton without KV cache / singleton with KV cache / static batch / continuous
skew      static (gang) vs continuous batching on uniform .. extreme-uneven output lengths
prefix    prefix caching off vs on with a shared system prompt
sim       policy-only scheduler simulation (no model; a linear step-cost model)

python benchmarks/bench_offline.py --tables modes,skew,prefix,sim --out benchmarks/results/offline.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

os.environ.setdefault("TINYSERVE_NO_PROGRESS", "1")

from tinyserve.config import SchedulerConfig  # noqa: E402
from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from tinyserve.engine.scheduler import Scheduler  # noqa: E402
from tinyserve.outputs import ModelRunnerOutput  # noqa: E402
from tinyserve.request import Request  # noqa: E402
from tinyserve.sampling_params import SamplingParams  # noqa: E402

SKEWS = {  # output-length distributions (min, max) drawn per request
    "uniform": lambda rng: 64,
    "moderately_uneven": lambda rng: rng.randint(32, 96),
    "highly_uneven": lambda rng: rng.choice([16, 16, 16, 128]),
    "extreme_uneven": lambda rng: rng.choice([8] * 7 + [256]),
}


def _prompts(rng: random.Random, n: int, lo: int = 16, hi: int = 48) -> list[list[int]]:
    # Token ids from the ordinary-word range of the vocabulary; lengths vary.
    return [[1] + [rng.randint(300, 20000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(engine, prompts, max_tokens, submit_all=True) -> dict:
    """Run requests to completion; returns wall time, tokens, TTFT and completion times."""
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    ntok = 0
    for i, (p, mt) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        )
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - t0
            ntok += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - t0
    comp = sorted(done.values())
    return {
        "wall_s": wall,
        "new_tokens": ntok,
        "tok_s": ntok / wall,
        "mean_ttft_s": statistics.fmean(first.values()),
        "p99_completion_s": comp[min(len(comp) - 1, int(0.99 * (len(comp) - 1) + 0.5))],
        "mean_completion_s": statistics.fmean(comp),
    }


def make_engine(**kw):
    from tinyserve.engine.llm_engine import LLMEngine

    base = dict(model=os.environ.get("TINYSERVE_BENCH_MODEL"), dtype="auto", kv_cache_memory="1GiB")
    base.update(kw)
    return LLMEngine(EngineArgs(**base))


def table_modes(n: int, max_tokens: int, seed: int) -> list[dict]:
    import torch

    from tinyserve.layers.attention import AttentionMetadata

    rng = random.Random(seed)
    prompts = _prompts(rng, n)
    mts = [max_tokens] * n
    rows = []
    engine = make_engine(max_num_seqs=1)
    # Singleton without KV cache: every token recomputes the whole sequence (a fresh cache).
    model, runner = engine.executor.model, engine.executor.runner
    bs = engine.args.block_size
    t0 = time.perf_counter()
    ntok = 0
    with torch.inference_mode():
        for p in prompts:
            seq = list(p)
            for _ in range(max_tokens):
                L = len(seq)
                table = list(range((L + bs - 1) // bs))
                meta = AttentionMetadata.build([L], [L], [table], bs, engine.executor.device,
                                               sliding_window=model.config.sliding_window)
                h = model(torch.tensor(seq), torch.arange(L), runner.kv_caches, meta)
                seq.append(int(model.compute_logits(h[-1:]).argmax(-1)))
                ntok += 1
    wall = time.perf_counter() - t0
    rows.append(
        {"mode": "singleton, no KV cache", "wall_s": wall, "new_tokens": ntok, "tok_s": ntok / wall}
    )
    r = run_engine(engine, prompts, mts)
    rows.append({"mode": "singleton, KV cache", **r})
    del engine
    engine = make_engine(max_num_seqs=n, scheduling_policy="static")
    rows.append({"mode": f"static batch of {n}", **run_engine(engine, prompts, mts)})
    del engine
    engine = make_engine(max_num_seqs=n)
    rows.append({"mode": "continuous batching", **run_engine(engine, prompts, mts)})
    base = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / base
    return rows


def table_skew(n: int, max_num_seqs: int, seed: int) -> list[dict]:
    rows = []
    engines = {
        "static": make_engine(max_num_seqs=max_num_seqs, scheduling_policy="static"),
        "continuous": make_engine(max_num_seqs=max_num_seqs),
    }
    for skew, draw in SKEWS.items():
        rng = random.Random(seed)
        prompts = _prompts(rng, n)
        mts = [draw(rng) for _ in range(n)]
        for policy, engine in engines.items():
            r = run_engine(engine, prompts, mts)
            rows.append({"skew": skew, "policy": policy, **r})
    return rows


def table_prefix(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = [1] + [rng.randint(300, 20000) for _ in range(300)]
    prompts = [
        system + [rng.randint(300, 20000) for _ in range(rng.randint(8, 24))] for _ in range(n)
    ]
    rows = []
    for on in (False, True):
        engine = make_engine(max_num_seqs=8, enable_prefix_caching=on)
        before = engine.stats()
        r = run_engine(engine, prompts, [16] * n)
        after = engine.stats()
        kv = engine.core.kv_cache_manager
        total_prompt = sum(len(p) for p in prompts)
        computed = after.prompt_tokens_total - before.prompt_tokens_total
        rows.append(
            {
                "prefix_caching": on,
                "prompt_tokens": total_prompt,
                "prefill_tokens_computed": computed,
                "prefill_saved_frac": 1 - computed / total_prompt,
                "block_hit_rate": (kv.prefix_cache_block_hits / kv.prefix_cache_block_queries)
                if kv.prefix_cache_block_queries
                else 0.0,
                **r,
            }
        )
    return rows


def table_sim(
    n: int, seed: int, step_fixed_ms: float = 30.0, per_token_ms: float = 0.5
) -> list[dict]:
    """Scheduler + KV manager only; each step 'costs' fixed + per_token * batched tokens."""
    rows = []
    for skew, draw in SKEWS.items():
        for policy in ("static", "continuous"):
            rng = random.Random(seed)
            sc = SchedulerConfig(
                max_num_seqs=16, max_num_batched_tokens=512, max_model_len=2048, policy=policy
            )
            sched = Scheduler(sc, KVCacheManager(4096, 16))
            for i in range(n):
                p = [rng.randint(3, 1000) for _ in range(rng.randint(16, 48))]
                sched.add_request(
                    Request(f"s{i}", p, SamplingParams(max_tokens=draw(rng), ignore_eos=True))
                )
            clock, ttft, done, tokens, steps = 0.0, {}, [], 0, 0
            while sched.has_unfinished():
                out = sched.schedule()
                clock += step_fixed_ms + per_token_ms * out.num_batched_tokens
                res = ModelRunnerOutput(
                    sampled_token_ids={
                        s.request.request_id: [7] for s in out.scheduled if s.samples
                    }
                )
                for req in sched.update_from_output(out, res).requests:
                    ttft.setdefault(req.request_id, clock)
                    if req.is_finished:
                        done.append(clock)
                tokens += len(res.sampled_token_ids)
                steps += 1
            done.sort()
            rows.append(
                {
                    "skew": skew,
                    "policy": policy,
                    "steps": steps,
                    "sim_time_s": clock / 1000,
                    "tok_s": tokens / (clock / 1000),
                    "mean_ttft_s": statistics.fmean(ttft.values()) / 1000,
                    "p99_completion_s": done[int(0.99 * (len(done) - 1) + 0.5)] / 1000,
                }
            )
    return rows


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    keys = list(rows[0].keys())
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tables", default="modes,skew,prefix,sim")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/offline.json")
    args = ap.parse_args(argv)
    tables = args.tables.split(",")
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    if "sim" in tables:
        results["sim"] = table_sim(64, args.seed)
        _print("policy-only simulation (no model)", results["sim"])
    if "modes" in tables:
        results["modes"] = table_modes(args.num_prompts, args.max_tokens, args.seed)
        _print("inference modes", results["modes"])
    if "skew" in tables:
        results["skew"] = table_skew(args.num_prompts * 2, args.num_prompts, args.seed)
        _print("static vs continuous by output-length skew", results["skew"])
    if "prefix" in tables:
        results["prefix"] = table_prefix(args.num_prompts, args.seed)
        _print("prefix caching", results["prefix"])
    results["machine"] = machine_info()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

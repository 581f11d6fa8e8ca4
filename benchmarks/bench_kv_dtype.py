#!/usr/bin/env python
"""Decode steps with a float32 KV cache against --kv-cache-dtype bfloat16, side by side in
one run: for each batch size and context length, both engines get the same requests (each
its own random prompt of ``context`` tokens, so no two share cached blocks), prefill them,
then take decode steps alternately, one engine's step then the other's, so that the host's
noise falls on both. Reports median step ms, output tok/s and their ratio.

A decode row reads its whole context's K and V every step: at one row and ~600 tokens that
is ~28 MB in float32 beside ~96 MB of SmolLM2's weights, and it grows with the context and
the batch; bf16 halves it.

``--compare huge-pages``: both engines fp32, the first with its cache in 4 KiB pages
(TINYSERVE_HUGE_PAGES=0), the second in transparent huge pages (the default, worker/
kv_cache.py); ``--fragment`` shuffles each engine's free block queue first, as a long-running
server's pool is, so a sequence's blocks lie scattered (a fresh pool hands them out in order).
Each row of the JSON holds both engines under their labels and ``speedup``: the first's
step time over the second's.

``--compare attention-rev --baseline-rev REV``: both engines fp32 with this tree's kernels,
but the first's fused step calls attention.c as it was at REV (built from ``git show``): a
change to the attention kernel measured in whole decode steps, where the weights streamed
between two layers leave the layer's keys and values cold (a kernel microbenchmark keeps
them hot in L3).

python benchmarks/bench_kv_dtype.py [--batch-sizes 1,8,32] [--contexts 256,1000] [--steps 16]
    [--compare kv-dtype|huge-pages|attention-rev] [--baseline-rev HEAD] [--fragment]
    [--out benchmarks/results/kv_dtype.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.engine.arg_utils import EngineArgs  # noqa: E402
from tinyserve.engine.llm_engine import LLMEngine  # noqa: E402
from tinyserve.sampling_params import SamplingParams  # noqa: E402

# --compare -> the two engines' labels and what sets each apart (its EngineArgs, or
# $TINYSERVE_HUGE_PAGES while it allocates its cache).
ENGINES = {
    "kv-dtype": {"float32": ({"kv_cache_dtype": "auto"}, None),
                 "bfloat16": ({"kv_cache_dtype": "bfloat16"}, None)},
    "huge-pages": {"4k_pages": ({}, "0"), "huge_pages": ({}, "1")},
    "attention-rev": {"baseline_attention": ({}, None), "this_tree": ({}, None)},
}  # fmt: skip


def use_attention_at(engine: LLMEngine, rev: str) -> None:
    """Point ``engine``'s fused step at attention.c as it was at ``rev`` (float32 cache)."""
    import ctypes
    import tempfile

    import torch
    from bench_kernels import build, sources_at

    src = sources_at(rev, Path(tempfile.mkdtemp()) / "src")
    lib = build(src, "attention", None)
    if not hasattr(lib, "attention_window"):  # step.c now passes each layer's window
        sys.exit(f"--compare attention-rev: {rev}'s attention.c predates the window argument")
    fn = ctypes.cast(lib.paged_attention, ctypes.c_void_p).value
    plan = engine.executor.runner.model.model.step_plan
    if plan is None:
        sys.exit("--compare attention-rev needs the fused C step (the CPU kernels)")
    plan._cache_fns[torch.float32] = (plan._cache_fns[torch.float32][0], fn)
    plan._struct.paged_attention = fn


def engines(args) -> dict[str, LLMEngine]:
    common = dict(model=args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=64,
                  max_num_batched_tokens=2048, enable_prefix_caching=False,
                  load_tokenizer=False, speculative_config=None)  # fmt: skip
    engs = {}
    for label, (kw, huge) in ENGINES[args.compare].items():
        if huge is not None:
            os.environ["TINYSERVE_HUGE_PAGES"] = huge
        engs[label] = LLMEngine(EngineArgs(**common, **kw))
        os.environ.pop("TINYSERVE_HUGE_PAGES", None)
    if args.compare == "attention-rev":
        use_attention_at(engs["baseline_attention"], args.baseline_rev)
    if args.fragment:
        for e in engs.values():
            manager = e.core.kv_cache_manager
            ids = list(manager._free_queue)
            random.Random(0).shuffle(ids)
            manager._free_queue = OrderedDict.fromkeys(ids)
    return engs


def prefill(engine: LLMEngine, batch: int, context: int, steps: int, salt: int) -> None:
    rng = random.Random(salt)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"{salt}-{i}", [rng.randrange(100, 40000) for _ in range(context)], params
        )
    sched = engine.core.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        engine.step()
    engine.step()  # every request decoding from here


def measure(engs: dict[str, LLMEngine], batch: int, context: int, steps: int) -> dict:
    for n, e in enumerate(engs.values()):
        prefill(e, batch, context, steps, salt=1000 * batch + context + n)
    times: dict[str, list[float]] = {d: [] for d in engs}
    labels = list(engs)
    for s in range(steps):
        for d in labels if s % 2 == 0 else labels[::-1]:
            t = time.perf_counter()
            engs[d].step()
            times[d].append(time.perf_counter() - t)
    for e in engs.values():
        for rid in list(e.output_processor.parents):
            e.abort(rid)
        while e.has_unfinished():
            e.step()
    row = {"batch": batch, "context": context}
    for d, ts in times.items():
        ms = 1000 * statistics.median(ts)
        row[d] = {"step_ms": round(ms, 2), "min_ms": round(1000 * min(ts), 2),
                  "tok_s": round(batch / ms * 1000, 1)}  # fmt: skip
    row["speedup"] = round(row[labels[0]]["step_ms"] / row[labels[1]]["step_ms"], 3)
    return row


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--contexts", default="256,1000")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="3GiB")
    p.add_argument("--compare", choices=list(ENGINES), default="kv-dtype")
    p.add_argument("--baseline-rev", default="HEAD", help="attention-rev: the baseline's revision")
    p.add_argument("--fragment", action="store_true", help="shuffle the free block queues first")
    p.add_argument("--out", default="benchmarks/results/kv_dtype.json")
    args = p.parse_args()
    engs = engines(args)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            row = measure(engs, batch, context, args.steps)
            rows.append(row)
            (first, a), (second, b) = ((k, row[k]) for k in engs)
            print(f"batch {batch:3d} context {context:5d}: {first} {a['step_ms']:7.2f} ms "
                  f"({a['tok_s']:6.1f} tok/s)  {second} {b['step_ms']:7.2f} ms ({b['tok_s']:6.1f} "
                  f"tok/s)  x{row['speedup']:.2f}", flush=True)  # fmt: skip
    result = {"machine": machine_info(), "steps": args.steps, "compare": args.compare,
              "baseline_rev": args.baseline_rev if args.compare == "attention-rev" else None,
              "fragment": args.fragment, "rows": rows,
              "kv_blocks": {d: e.executor.num_blocks for d, e in engs.items()}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Offline baseline: transformers' own `generate` on the same weights, static batches.

single stream   batch 1, greedy, a fixed number of new tokens: decode tok/s
static batch B  the `mixed` workload's requests in batches of B (left-padded); each batch
                runs to its longest request's max_tokens; output tok/s counts only the
                tokens each request asked for

python benchmarks/bench_hf_baseline.py --model /path/to/hf-folder --batches 8,32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import make_workload  # noqa: E402
from machine import machine_info  # noqa: E402


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyserve.utils.cache import cache_dir

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=str(cache_dir() / "models" / "SmolLM2-135M-Instruct-hf-bf16"),
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/hf_baseline.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    reqs = make_workload("mixed", args.num_requests, seed=0)

    def encode(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return ids if isinstance(ids, list) else ids["input_ids"]

    prompts = [encode(r.messages) for r in reqs]
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": args.dtype, "rows": []}

    with torch.inference_mode():
        singles = []
        ids = torch.tensor([prompts[0]])
        for _ in range(args.repeats):
            t = time.perf_counter()
            model.generate(
                ids,
                max_new_tokens=args.single_tokens,
                min_new_tokens=args.single_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            singles.append(args.single_tokens / (time.perf_counter() - t))
        row = {"mode": "single stream", "tok_s": statistics.median(singles), "all": singles}
        results["rows"].append(row)
        print(f"single stream: {row['tok_s']:.1f} tok/s")
        for b in (int(x) for x in args.batches.split(",")):
            rates = []
            for _ in range(args.repeats):
                useful, t0 = 0, time.perf_counter()
                for i in range(0, len(prompts), b):
                    chunk = prompts[i : i + b]
                    mts = [r.max_tokens for r in reqs[i : i + b]]
                    enc = tok.pad({"input_ids": chunk}, return_tensors="pt")
                    model.generate(
                        **enc,
                        max_new_tokens=max(mts),
                        min_new_tokens=max(mts),
                        do_sample=False,
                        pad_token_id=tok.pad_token_id,
                    )
                    useful += sum(mts)
                rates.append(useful / (time.perf_counter() - t0))
            row = {"mode": f"static batch {b}", "tok_s": statistics.median(rates), "all": rates}
            results["rows"].append(row)
            print(f"static batch {b}: {row['tok_s']:.1f} useful output tok/s")
    results["machine"] = machine_info()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

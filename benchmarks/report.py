#!/usr/bin/env python
"""Render the markdown tables of benchmarks/README.md from benchmarks/results/*.json.

python benchmarks/report.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402


def _load(res: Path, name: str):
    p = res / name
    return json.loads(p.read_text()) if p.is_file() else None


def _ms(v) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


_NAMES = {"tinyserve": "tinyserve", "vllm-cpu": "vLLM-CPU", "llama.cpp": "llama.cpp"}


def _name(label: str) -> str:
    return _NAMES.get(label, label)


def _workloads(d: dict) -> list[str]:
    """The workloads of a peers.json, in plan order (older files hold one, in d['workload'])."""
    return d.get("workloads") or list(dict.fromkeys(r["workload"] for r in d["runs"]))


def peers_table(d: dict, workload: str) -> list[str]:
    machine = describe(d.get("machine"))
    out = [
        f"`{workload}` workload, medians of {d['repeats']} interleaved runs ({d['date']}"
        + (f"; {machine}" if machine else "")
        + ").",
        "",
        "| server | concurrency | output tok/s | runs (tok/s) | median TTFT ms | median TPOT ms | p99 e2e s | failed |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    rows = [r for r in d["runs"] if r["workload"] == workload]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["label"])):
        each = ", ".join(f"{x:.1f}" for x in r["all_output_tok_s"])
        p99 = r["e2e_s"]["p99"]
        out.append(
            f"| {r['label']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {each} | "
            f"{_ms(r['ttft_s']['median'])} | {_ms(r['tpot_s']['median'])} | "
            f"{'-' if p99 is None else f'{p99:.1f}'} | {r['failed']} |"
        )
    return out


def ratios(d: dict, hf: dict | None, workload: str) -> list[str]:
    runs = [r for r in d["runs"] if r["workload"] == workload]
    by = {(r["label"], r["concurrency"]): r for r in runs}
    peers = sorted({r["label"] for r in runs} - {"tinyserve"})
    out = ["| target | measured | ratio |", "|---|---|---:|"]
    for c in sorted({r["concurrency"] for r in runs}):
        for peer in peers:
            a, b = by.get(("tinyserve", c)), by.get((peer, c))
            if not (a and b):
                continue
            if b["output_tok_s"]:
                out.append(
                    f"| output tok/s at concurrency {c}, tinyserve / {_name(peer)} | "
                    f"{a['output_tok_s']:.1f} / {b['output_tok_s']:.1f} | {a['output_tok_s'] / b['output_tok_s']:.2f}x |"
                )
            ta, tb = a["ttft_s"]["median"], b["ttft_s"]["median"]
            if ta is not None and tb:
                out.append(
                    f"| median TTFT at concurrency {c}, tinyserve vs {_name(peer)} | "
                    f"{_ms(ta)} ms vs {_ms(tb)} ms | {ta / tb:.2f}x |"
                )
    if hf and workload == "mixed":
        rows = {r["mode"]: r["tok_s"] for r in hf["rows"]}
        a32, a1 = by.get(("tinyserve", 32)), by.get(("tinyserve", 1))
        if a32 and "static batch 8" in rows:
            out.append(
                f"| tinyserve at 32 concurrent / transformers static batch of 8 | "
                f"{a32['output_tok_s']:.1f} / {rows['static batch 8']:.1f} | "
                f"{a32['output_tok_s'] / rows['static batch 8']:.2f}x |"
            )
        if a1 and "single stream" in rows and a1["tpot_s"]["median"]:
            tps = 1 / a1["tpot_s"]["median"]
            out.append(
                f"| single-stream decode tok/s (1/TPOT), tinyserve / transformers generate | "
                f"{tps:.1f} / {rows['single stream']:.1f} | {tps / rows['single stream']:.2f}x |"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="benchmarks/results")
    res = Path(ap.parse_args().results)
    lines: list[str] = []
    peers, hf = _load(res, "peers.json"), _load(res, "hf_baseline.json")
    if peers:
        lines += ["### Serving, side by side", ""]
        for w in _workloads(peers):
            lines += peers_table(peers, w) + [""] + ratios(peers, hf, w) + [""]
    if hf:
        lines += [
            "### transformers `generate` baseline (same weights, fp32)",
            "",
            "| mode | output tok/s (median) | runs |",
            "|---|---:|---|",
        ]
        lines += [
            f"| {r['mode']} | {r['tok_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['all'])} |"
            for r in hf["rows"]
        ] + [""]
    step = _load(res, "step.json")
    if step:
        lines += [
            f"### Decode step anatomy ({step['dtype']}, {step['torch_threads']} threads)",
            "",
            "| batch | matmuls | step ms | tok/s | model ms | sampler ms | engine overhead | fp32 matmul floor ms | floor tok/s | step vs fp32 floor | kernel floor ms |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in step["rows"]:
            kernel = r.get("gguf_kernel", r.get("cpu_kernels"))
            how = r.get("path") or (
                "fp32 GEMM" if kernel is False else "kernels" if kernel else "fp32"
            )
            lines.append(
                f"| {r['batch']} | {how} | {r['step_ms']:.1f} | {r['tok_s']:.1f} | {r['model_ms']:.1f} | {r['sampler_ms']:.1f} | "
                f"{r['overhead_ms']:.1f} ms ({100 * r['overhead_share']:.0f}%) | {r['matmul_floor_ms']:.1f} | "
                f"{r['floor_tok_s']:.0f} | {100 * r['fraction_of_floor']:.0f}% | {r.get('kernel_floor_ms', float('nan')):.1f} |"
            )
        lines.append("")
    on, off = _load(res, "shared_prefix_on.json"), _load(res, "shared_prefix_off.json")
    if on and off:
        lines += [
            "### `shared_prefix` serving workload, prefix caching on vs off",
            "",
            "| prefix caching | prompt tokens | prefill tokens computed | saved | mean TTFT ms | median TTFT ms | output tok/s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, d in (("on", on), ("off", off)):
            lines.append(
                f"| {name} | {d['prompt_tokens']} | {d['prefill_tokens_computed']:.0f} | {100 * d['prefill_saved_frac']:.1f}% | "
                f"{_ms(d['ttft_s']['mean'])} | {_ms(d['ttft_s']['median'])} | {d['output_tok_s']:.1f} |"
            )
        lines.append("")
    off_tables = _load(res, "offline.json")
    if off_tables:
        for key, title in (
            ("modes", "Inference modes (offline engine)"),
            ("skew", "Static (gang) vs continuous batching by output-length skew (offline engine)"),
            ("prefix", "Prefix caching off vs on (offline engine, 300-token shared prefix)"),
            ("sim", "Policy-only scheduler simulation (no model; step = 30 ms + 0.5 ms/token)"),
        ):
            rows = off_tables.get(key)
            if not rows:
                continue
            keys = list(rows[0].keys())
            lines += [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            for r in rows:
                lines.append(
                    "| "
                    + " | ".join(
                        f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys
                    )
                    + " |"
                )
            lines.append("")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

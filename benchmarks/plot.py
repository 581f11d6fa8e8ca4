#!/usr/bin/env python
"""Draw the benchmark charts (PNG) from the JSON under benchmarks/results/.

  python benchmarks/plot.py [--results benchmarks/results] [--out benchmarks/results]

Needs matplotlib (``pip install -e '.[bench]'``). Draws whatever inputs exist:
  peers.json    -> throughput_vs_concurrency.png, ttft_tpot.png
  offline.json  -> static_vs_continuous.png
  spec_decode.json -> spec_decode.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_peers(data: dict, out: Path) -> list[Path]:
    """Charts for one workload: 'mixed' if the file has it, else its first."""
    plt = _plt()
    workloads = data.get("workloads") or list(dict.fromkeys(r["workload"] for r in data["runs"]))
    workload = "mixed" if "mixed" in workloads else workloads[0]
    # bench_serving summaries with "label", "workload" and "concurrency"
    runs = [r for r in data["runs"] if r["workload"] == workload]
    labels = sorted({r["label"] for r in runs})
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        rs = sorted((r for r in runs if r["label"] == label), key=lambda r: r["concurrency"])
        ax.plot(
            [r["concurrency"] for r in rs], [r["output_tok_s"] for r in rs], marker="o", label=label
        )
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens / s (median of runs)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{workload} workload, {describe(data.get('machine'))}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "throughput_vs_concurrency.png"
    fig.savefig(p, dpi=110)
    written.append(p)

    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        width = 0.8 / max(1, len(labels))
        concs = sorted({r["concurrency"] for r in runs})
        for i, label in enumerate(labels):
            ys = []
            for c in concs:
                vals = [
                    r[key]["median"] for r in runs if r["label"] == label and r["concurrency"] == c
                ]
                ys.append(1000 * vals[0] if vals and vals[0] is not None else 0)
            ax.bar([j + i * width for j in range(len(concs))], ys, width=width, label=label)
        ax.set_xticks(
            [j + width * (len(labels) - 1) / 2 for j in range(len(concs))], [str(c) for c in concs]
        )
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(f"median {name} (ms)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.tight_layout()
    p = out / "ttft_tpot.png"
    fig.savefig(p, dpi=110)
    written.append(p)
    return written


def plot_offline(data: dict, out: Path) -> list[Path]:
    rows = data.get("skew")
    if not rows:
        return []
    plt = _plt()
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in (
        (axes[0], "tok_s", "output tok/s"),
        (axes[1], "mean_ttft_s", "mean TTFT (s)"),
    ):
        for i, policy in enumerate(("static", "continuous")):
            ys = [
                next(r[key] for r in rows if r["skew"] == s and r["policy"] == policy)
                for s in skews
            ]
            ax.bar([j + i * 0.4 for j in range(len(skews))], ys, width=0.4, label=policy)
        ax.set_xticks([j + 0.2 for j in range(len(skews))], [s.replace("_", "\n") for s in skews])
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.suptitle("static (gang) vs continuous batching by output-length skew")
    fig.tight_layout()
    p = out / "static_vs_continuous.png"
    fig.savefig(p, dpi=110)
    return [p]


def plot_spec(data: dict, out: Path) -> list[Path]:
    """Output tok/s with speculative decoding off and on, per workload and concurrency."""
    plt = _plt()
    cells = data["cells"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    xs = list(range(len(cells)))
    ax.bar([x - 0.2 for x in xs], [c["off_tok_s"] for c in cells], 0.4, label="off")
    ax.bar([x + 0.2 for x in xs], [c["on_tok_s"] for c in cells], 0.4, label="ngram, k = 4")
    for x, c in zip(xs, cells, strict=True):
        ax.text(x + 0.2, c["on_tok_s"], f"{c['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"{c['workload']}\nc={c['concurrency']}" for c in cells])
    ax.set_ylabel("output tok/s (median)")
    ax.set_title(f"Speculative decoding, served — {describe(data['machine'])}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    p = out / "spec_decode.png"
    fig.savefig(p, dpi=110)
    return [p]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = Path(args.results)
    out = Path(args.out) if args.out else res
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if (res / "peers.json").is_file():
        written += plot_peers(json.loads((res / "peers.json").read_text()), out)
    if (res / "offline.json").is_file():
        written += plot_offline(json.loads((res / "offline.json").read_text()), out)
    if (res / "spec_decode.json").is_file():
        written += plot_spec(json.loads((res / "spec_decode.json").read_text()), out)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()

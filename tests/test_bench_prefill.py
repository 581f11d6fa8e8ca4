"""benchmarks/bench_prefill.py counts a prefill's FLOPs from the model's shapes (checked
here against a count done by hand) and runs end to end, and
benchmarks/bench_amx_peak.py measures the tile unit where there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinyserve.kernels import gemm

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_flops_are_counted_from_the_shapes():
    from benchmarks.bench_prefill import model_flops

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          vocab_size=100)  # fmt: skip
    got = model_flops(cfg, 8)
    # A row, per layer: qkv 64 x (64 + 2 * 32), o 64 x 64, gate_up 64 x 256, down 128 x 64
    # = 8192 + 4096 + 16384 + 8192 = 36864 multiply-adds; 2 layers, 8 rows, 2 FLOPs each,
    # and the LM head (64 x 100) at the last row only.
    assert got["linear"] == 2 * 8 * 2 * 36864 + 2 * 64 * 100
    # Row i sees i + 1 keys: 36 (row, key) pairs; q.k and p.v, 16 dims, 4 heads, 2 layers.
    assert got["attention"] == 2 * 2 * 2 * 4 * 16 * 36
    assert got["total"] == got["linear"] + got["attention"]


def _run(script: str, tmp_path, *args: str) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINYSERVE_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--out",
                           str(out)], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_prefill_runs_on_the_default_model(tmp_path, smollm2_gguf_path):
    result = _run("bench_prefill.py", tmp_path, "--model", str(smollm2_gguf_path),
                  "--prompt-len", "40", "--reps", "2")  # fmt: skip
    assert result["prompt_len"] == 40 and len(result["seconds"]["all"]) == 2
    assert result["prompt_tok_s"] > 0 and result["gflops_achieved"] > 0


@pytest.mark.skipif(not gemm.amx_active(), reason="needs a CPU with AMX-BF16 (and the tile state)")
def test_bench_amx_peak_measures_the_tiles(tmp_path):
    result = _run("bench_amx_peak.py", tmp_path, "--seconds", "0.05")
    one = result["gflops"]["1_threads"]
    # A tile multiply does 8x a vdpbf16ps's work in about 16 cycles: far ahead of it.
    assert one["tiles_registers"] > 4 * one["vdpbf16ps"] > 0

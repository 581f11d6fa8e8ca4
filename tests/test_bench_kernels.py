"""benchmarks/bench_kernels.py runs end to end (a subprocess, never imported): it compiles
the kernels of a git revision next to this tree's and times them side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyserve.kernels import gemm

ROOT = Path(__file__).resolve().parents[1]


def _bench_against_head(tmp_path, *args: str) -> dict:
    """bench_kernels.py --baseline-rev HEAD ``args``: its JSON (skips outside a git checkout)."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "kernels.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--baseline-rev",
           "HEAD", *args, "--reps", "1", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not gemm.available(), reason="needs an x86 CPU with AVX2/FMA/F16C and cc")
def test_bench_kernels_against_head(tmp_path):
    result = _bench_against_head(tmp_path, "--rows", "1,5", "--attention-rows", "5",
                                 "--context", "130")  # fmt: skip
    assert [r["rows"] for r in result["matmuls"]] == [1, 5]
    # HEAD's kernels are this tree's unless they are being edited: then only numbers differ.
    assert all(r["this"]["min_ms"] > 0 for r in result["matmuls"] + result["attention"])
    assert result["attention"][0]["max_abs_diff"] < 1e-5


@pytest.mark.skipif(not gemm.bf16_available(), reason="needs a CPU with AVX512-BF16 and cc")
def test_bench_kernels_bf16_against_the_float_tiles(tmp_path):
    result = _bench_against_head(tmp_path, "--bf16", "--rows", "1,9", "--q8-rows", "",
                                 "--attention-rows", "1", "--context", "20")  # fmt: skip
    assert result["bf16_activations"] is True
    for r in result["matmuls"]:  # rounded activations: close to the float tiles, not equal
        assert not r["bitwise_same"] and 0 < r["max_rel_diff"] < 1e-2, r

"""benchmarks/bench_step.py runs end to end (as a subprocess, never imported) on a tiny
random model, in bfloat16: its floor measurements feed activations in the model's dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model_with_tokenizer(smollm2_gguf_path, tmp_path_factory) -> Path:
    """2 random layers, SmolLM2's tokenizer (the script builds engines that load one)."""
    from tinyserve.models.default_model import tokenizer_dir_for
    from tinyserve.testing.checkpoints import build_fuzz_model

    dest = tmp_path_factory.mktemp("bench_step") / "model"
    return build_fuzz_model(dest, tokenizer_dir_for(smollm2_gguf_path))


@pytest.mark.slow
def test_bench_step_runs_in_bfloat16(tiny_model_with_tokenizer, tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--model",
           str(tiny_model_with_tokenizer), "--dtype", "bfloat16", "--batch-sizes", "1",
           "--steps", "2", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dtype"] == "torch.bfloat16"
    assert {r["path"] for r in result["rows"]} >= {"kernels", "torch"}
    assert all(r["kernel_floor_ms"] > 0 and r["step_ms"] > 0 for r in result["rows"])

"""Ranks started by torchrun (RANK / WORLD_SIZE / MASTER_* in the environment), the way
they sit on several hosts: rank 0 runs the command, rank 1 becomes a worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tinyserve.models.default_model import tokenizer_dir_for
from tinyserve.testing.checkpoints import build_fuzz_model


@pytest.mark.slow
def test_torchrun_generate_equals_one_process(smollm2_gguf_path, tmp_path, fresh_cache):
    """Also: the ranks start on a cache with no dtype calibration (``--dtype auto`` on a CPU
    is measured, worker/autotune.py). Each rank measured it at the same time, disturbed by
    the other, so nothing was trusted or cached: 90 s to start, at every start. The driver
    measures it alone now and hands the dtype to the other rank."""
    from tinyserve.worker.device import cpu_has_native_bf16

    model = build_fuzz_model(tmp_path / "model", tokenizer_dir_for(smollm2_gguf_path), seed=5)
    gen = [
        "-m", "tinyserve.entrypoints.cli", "generate", "--model", str(model),
        "--max-tokens", "12", "--log-level", "error", "Hello there", "The sky is",
    ]  # fmt: skip
    env = {**os.environ, "TINYSERVE_CACHE_DIR": str(fresh_cache)}
    tr = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run([*tr, *gen, "--tensor-parallel-size", "2"], capture_output=True,
                         text=True, timeout=300, env=env)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    if cpu_has_native_bf16():  # elsewhere the kernels are taken without measuring
        assert (fresh_cache / "calibration.json").is_file(), two.stderr[-3000:]
    one = subprocess.run([sys.executable, *gen], capture_output=True, text=True, timeout=300,
                         env=env)  # fmt: skip
    assert one.returncode == 0, one.stderr
    assert "### Hello there" in one.stdout
    assert two.stdout == one.stdout  # only rank 0 prints, and the same tokens

"""scripts/gpu_check.sh end to end on the CPU (GPU_CHECK_DEVICE=cpu): a dry run of the
plumbing a lent GPU gets one call for — the model build, the device-selected pytest run, the
server, a streamed request, the load tests and the step anatomy all write their files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(smollm2_gguf_path, tmp_path, fresh_cache):
    from tinyserve.models.default_model import tokenizer_dir_for

    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_DTYPE": "float32",
        "GPU_CHECK_MODEL": str(tmp_path / "model"),  # built by the script
        "GPU_CHECK_LAYERS": "2",  # SmolLM2's shape but 2 of its 30 layers: a fast dry run
        "GPU_CHECK_TOKENIZER": str(tokenizer_dir_for(smollm2_gguf_path)),
        "GPU_CARRY": str(tmp_path / "no-carry"),  # nothing to install here
        "GPU_CHECK_CONCURRENCY": "1 2",
        "GPU_CHECK_BATCHES": "1,2",
        "GPU_CHECK_TESTS": "tests/worker/test_sampler.py",  # collecting all of tests/: ~10 s
        "GPU_CHECK_K": "test_processors_match_reference",
        "GPU_CHECK_PORT": str(_free_port()),
        "TINYSERVE_CACHE_DIR": str(fresh_cache),
    }
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [line.split(":")[0] for line in summary.splitlines()]
    want = ["model", "device_tests", "health", "stream", "serving_c1", "serving_c2", "device_step"]
    assert steps == want, summary
    assert "torch" in (out / "env.txt").read_text()
    assert "1 passed" in (out / "device_tests.txt").read_text()
    stream = (out / "stream.txt").read_text()
    assert '"role":"assistant"' in stream and stream.rstrip().endswith("data: [DONE]")
    for c in (1, 2):
        s = json.loads((out / f"serving_c{c}.json").read_text())
        assert s["failed"] == 0 and s["completed"] >= 6 and s["output_tok_s"] > 0
    anatomy = json.loads((out / "device_step.json").read_text())
    assert [r["batch"] for r in anatomy["rows"]] == [1, 2]
    assert all(r["step_ms"] > 0 and r["aten_ops_per_step"] > 0 for r in anatomy["rows"])

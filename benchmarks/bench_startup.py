#!/usr/bin/env python
"""Start-up to healthy: seconds from launching ``tinyserve serve`` to ``/health`` answering 200,
cold (kernels not yet compiled, no dtype calibration cached: a fresh cache folder holding only
the model) and warm (the same folder again), medians of --repeats warm starts.

python benchmarks/bench_startup.py [--repeats 3] [--out benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.server import free_port  # noqa: E402


def time_to_healthy(cache: Path, timeout: float = 120.0) -> float:
    port = free_port()
    env = {**os.environ, "TINYSERVE_CACHE_DIR": str(cache), "TINYSERVE_NO_PROGRESS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinyserve.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],  # fmt: skip
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"tinyserve serve exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("not healthy in time")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/startup.json")
    args = ap.parse_args()
    from tinyserve.models.default_model import default_model_dir, ensure_default_model

    ensure_default_model(progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        # Only the model (and its converted tokenizer) travel: no kernels, no calibration.
        shutil.copytree(default_model_dir(), cache / "models" / default_model_dir().name)
        cold = time_to_healthy(cache)
        warm = [time_to_healthy(cache) for _ in range(args.repeats)]
    result = {
        "cold_s": cold,
        "warm_s": warm,
        "warm_median_s": statistics.median(warm),
        "machine": machine_info(),
    }
    print(f"start-up to healthy: cold {cold:.1f} s, warm {statistics.median(warm):.1f} s "
          f"(runs {', '.join(f'{w:.1f}' for w in warm)})")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

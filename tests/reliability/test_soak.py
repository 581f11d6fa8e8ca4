"""Soak: a smaller run of benchmarks/soak.py's soak (120 streaming requests at 32 concurrent,
30% hang-ups, n=2, stop strings) and its overload (64 clients, --max-queued-requests 8)."""

from __future__ import annotations

import pytest

from tinyserve.testing.server import start_server
from tinyserve.testing.soak import (
    SoakConfig,
    overload_failures,
    run_overload,
    run_soak,
    soak_failures,
)


@pytest.mark.slow
def test_soak_nothing_lost_nothing_leaked(smollm2_gguf_path, tmp_path):
    server = start_server(
        ["--model", str(smollm2_gguf_path), "--max-num-seqs", "64", "--kv-cache-memory", "256MiB"],
        tmp_path / "server.log",
    )
    try:
        cfg = SoakConfig(num_requests=120, concurrency=32, max_tokens_choices=(4, 8, 16, 32))
        s = run_soak(server.base_url, cfg, server_pid=server.pid)
    finally:
        exit_code = server.stop()
    # The run exercised every path it is meant to.
    assert s["disconnected"] >= 20 and s["completed"] >= 60, s
    assert s["with_n2"] >= 10 and s["with_stop"] >= 10, s
    assert s["output_tokens_streamed"] > 500, s
    assert soak_failures(s) == [], s
    assert s["after"]["total_blocks"] > 0 and s["rss_growth"] is not None
    assert exit_code == 0, server.log()[-2000:]
    assert "Traceback" not in server.log(), server.log()[-4000:]


@pytest.mark.slow
def test_overload_gets_429_at_once_and_admitted_complete(smollm2_gguf_path, tmp_path):
    server = start_server(
        [
            "--model",
            str(smollm2_gguf_path),
            "--max-num-seqs",
            "8",
            "--max-queued-requests",
            "8",
            "--kv-cache-memory",
            "128MiB",
        ],  # fmt: skip
        tmp_path / "server.log",
    )
    try:
        o = run_overload(server.base_url, clients=64, max_tokens=24)
    finally:
        server.stop()
    # 8 run + 8 wait = 16 admitted at most; the other 48 are refused.
    assert overload_failures(o, max_admitted=16) == [], o
    assert o["rejected_429"] >= 48 and o["admitted"] >= 8, o
    assert o["max_429_latency_s"] < o["median_admitted_e2e_s"], o

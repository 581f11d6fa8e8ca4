"""`tinyserve serve --tensor-parallel-size 2`: a real subprocess answers a streaming chat
request; killing a worker rank turns /health to 503 and new requests to 503, not a hang."""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil
import pytest

from tinyserve.models.default_model import tokenizer_dir_for
from tinyserve.testing.checkpoints import build_fuzz_model
from tinyserve.testing.server import start_server
from tinyserve.testing.sse import iter_data


@pytest.mark.slow
def test_tp2_server_streams_and_reports_a_dead_worker(smollm2_gguf_path, tmp_path):
    # The fuzz model: 4 heads, 2 KV heads, SmolLM2's tokenizer and chat template.
    model = build_fuzz_model(tmp_path / "model", tokenizer_dir_for(smollm2_gguf_path))
    server = start_server(
        ["--model", str(model), "--tensor-parallel-size", "2", "--kv-cache-memory", "16MiB"],
        tmp_path / "serve.log",
    )
    try:
        workers = [
            p
            for p in psutil.Process(server.pid).children()
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in p.cmdline()[-1]
        ]
        assert len(workers) == 1, [p.cmdline() for p in psutil.Process(server.pid).children()]
        body = {
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = server.base_url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            data = list(iter_data(r.iter_lines()))
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )

        workers[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(server.base_url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() - t0 < 5, "/health still 200 after a worker died"
            time.sleep(0.05)
        unstreamed = {k: v for k, v in body.items() if k != "stream_options"}  # a 400 unstreamed
        r = httpx.post(url, json={**unstreamed, "stream": False}, timeout=10)
        assert r.status_code == 503, r.text
        assert "worker" in r.json()["error"]["message"]
        err = httpx.get(server.base_url + "/health", timeout=5).json()["error"]
        assert "rank 1" in err["message"]
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]

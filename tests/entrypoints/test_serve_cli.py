"""`tinyserve serve`: its flags, the README's curl example, and a real subprocess."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tinyserve.entrypoints.api_server import server_config_from_namespace
from tinyserve.entrypoints.cli import build_parser
from tinyserve.testing.server import start_server, wait_until
from tinyserve.testing.sse import iter_data

README = Path(__file__).resolve().parents[2] / "README.md"


def test_serve_flags():
    ns = build_parser().parse_args(
        "serve --model m.gguf --host 0.0.0.0 --port 9000 --served-model-name tiny "
        "--dtype float32 --max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 256 "
        "--block-size 32 --kv-cache-memory 1GiB --no-enable-prefix-caching "
        "--max-queued-requests 3 --api-key k --log-level debug".split()
    )
    assert callable(ns.func) and ns.log_level == "debug"
    assert (ns.model, ns.dtype, ns.max_model_len, ns.max_num_seqs) == ("m.gguf", "float32", 512, 8)
    assert (ns.max_num_batched_tokens, ns.block_size, ns.kv_cache_memory) == (256, 32, "1GiB")
    assert ns.enable_prefix_caching is False
    config = server_config_from_namespace(ns)
    assert (config.host, config.port, config.served_model_name) == ("0.0.0.0", 9000, "tiny")
    assert (config.api_key, config.max_queued_requests) == ("k", 3)
    d = build_parser().parse_args(["serve"])
    assert (d.host, d.port, d.model, d.log_level) == ("127.0.0.1", 8321, None, "info")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--max-queued-requests=-1", "max_queued_requests must be >= 0, got -1"),
        ("--max-request-bytes=10", "max_request_bytes must be >= 1024, got 10"),
        ("--shutdown-timeout=-1", "shutdown_timeout must be >= 0, got -1.0"),
    ],
)
def test_bad_server_flags_exit_with_a_message(flag, message):
    from tinyserve.entrypoints.api_server import run_server

    ns = build_parser().parse_args(["serve", flag])
    with pytest.raises(SystemExit) as exc:
        run_server(ns)  # fails before any model is loaded
    assert str(exc.value) == f"tinyserve serve: {message}"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "/nonexistent/m.gguf"], "model '/nonexistent/m.gguf': no such file"),
        (["--device", "cuda"], "device 'cuda' was asked for but no CUDA device is available"),
        (["--device", "foo"], "Expected one of"),  # torch's RuntimeError: was a traceback
        (["--max-model-len", "-5"], "max_model_len must be >= 2, got -5"),  # was torch's
    ],
)
def test_bad_engine_settings_exit_with_one_line(flags, message):
    """What the engine refuses at start-up (a model that is not there, a device the machine
    lacks) ends `tinyserve serve` with its message, not a traceback."""
    import torch

    from tinyserve.entrypoints.api_server import run_server

    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    ns = build_parser().parse_args(["serve", *flags])
    with pytest.raises(SystemExit) as exc:
        run_server(ns)
    assert str(exc.value).startswith(f"tinyserve serve: {message}"), exc.value


def _readme_curl() -> str:
    lines = [line for line in README.read_text().splitlines() if line.startswith("curl -N ")]
    assert lines, "README.md has no `curl -N ...` example"
    return lines[0]


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")
def test_readme_curl_command(server):
    command = re.sub(r"http://(127\.0\.0\.1|localhost):\d+", server.base_url, _readme_curl())
    assert server.base_url in command
    out = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"object":"chat.completion.chunk"' in events[0]


@pytest.mark.slow
def test_tinyserve_serve_subprocess_answers_chat(tmp_path):
    exe = Path(sys.executable).parent / "tinyserve"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tinyserve.entrypoints.cli"]
    server = start_server(
        [], tmp_path / "serve.log", command=cmd, env={**os.environ, "TINYSERVE_API_KEY": ""}
    )
    proc, base = server.proc, server.base_url
    try:
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        page = httpx.get(base + "/", timeout=10)  # the playground, from the package's files
        assert page.status_code == 200 and "/playground/chat.js" in page.text
        assert httpx.get(base + "/playground/chat.js", timeout=10).status_code == 200

        # SIGTERM drains: a stream in flight finishes in full, then the process exits 0.
        body = {
            "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[str] = []
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as resp:
            for data in iter_data(resp.iter_lines()):
                events.append(data)
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        usage = [json.loads(x) for x in events[:-1] if '"usage":{' in x]
        assert usage and usage[-1]["usage"]["completion_tokens"] == 24
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = server.log()
    assert base in text and "SmolLM2-135M-Instruct" in text and f"playground at {base}/" in text
    assert "tokens" in text and re.search(r"request chatcmpl-\w+ finished", text)


@pytest.mark.slow
def test_sigterm_stops_admitting_and_cuts_streams_past_the_grace_period(
    smollm2_gguf_path, tmp_path
):
    """Requests still running when the drain time runs out end as answers that say so: the
    stream with an error event and [DONE], a waiting answer with a 503 (uvicorn's own cut
    left a stream with no end and no error, and a waiting answer a plain-text 500)."""
    grace = 2.0
    server = start_server(
        ["--model", str(smollm2_gguf_path), "--shutdown-timeout", str(grace)],
        tmp_path / "serve.log",
    )
    body = {"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True}
    waiting: list[httpx.Response] = []
    answer = threading.Thread(target=lambda: waiting.append(
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)))  # fmt: skip
    events, t_signal, refused = [], None, None

    def running() -> bool:  # the waiting answer admitted before the signal closes the socket
        text = httpx.get(server.base_url + "/metrics", timeout=5).text
        return re.search(r"^tinyserve:num_requests_running\{[^}]*\} [1-9]", text, re.M) is not None

    try:
        answer.start()
        assert wait_until(running, timeout=30), "the waiting answer never started"
        with httpx.stream("POST", server.base_url + "/v1/completions",
                          json={**body, "stream": True}) as r:  # fmt: skip
            for data in iter_data(r.iter_lines()):
                events.append(data)
                if len(events) == 3 and t_signal is None:
                    server.proc.send_signal(signal.SIGTERM)
                    t_signal = time.monotonic()
                    time.sleep(0.5)
                    try:  # no longer admitting: the listening socket is closed
                        httpx.post(server.base_url + "/v1/completions", json=body, timeout=5)
                        refused = False
                    except httpx.ConnectError:
                        refused = True
        ended = time.monotonic() - t_signal
        answer.join(30)
        assert server.proc.wait(30) == 0, server.log()[-3000:]
        exited = time.monotonic() - t_signal
    finally:
        server.stop()
    assert refused is True
    # cut well before its 2000 tokens (a Zen 5 streams ~300 in the 2.5 s; the time bounds
    # below say the cut came at the end of the grace period)
    assert 3 < len(events) < 1500 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "shutting down" in error["message"], error
    assert grace - 0.5 < ended < grace + 5, ended  # the stream ran on through the grace period
    assert exited < grace + 10, exited
    (r,) = waiting
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_a_usage_error(port, capsys):
    """uvicorn refused it only after the model had loaded (three tracebacks)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--port", port])
    assert e.value.code == 2 and "must be in 0-65535" in capsys.readouterr().err

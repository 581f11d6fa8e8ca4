"""Servers for tests and benchmarks: a free port, a real ``tinyserve serve`` subprocess
(returns once /health answers), and an in-process uvicorn server in a background thread."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 2.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# -- a ``tinyserve serve`` subprocess ----------------------------------------------------------


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    args: list[str],
    log_path: Path,
    timeout: float = 180.0,
    *,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """``tinyserve serve <args>`` on a free port; returns once /health answers 200.
    ``command``: how to run tinyserve (default ``python -m tinyserve.entrypoints.cli``);
    ``env``: the child's environment (default this process's)."""
    port = free_port()
    command = command or [sys.executable, "-m", "tinyserve.entrypoints.cli"]
    cmd = [*command, "serve", "--port", str(port), *args]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it for its whole life
    env = os.environ.copy() if env is None else env
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.log()[-3000:]}")


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _families(base_url: str, headers: dict | None = None):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    return list(text_string_to_metric_families(text))


def metric_samples(base_url: str, headers: dict | None = None) -> list[tuple[str, dict, float]]:
    """Every sample of /metrics: (name without the ``tinyserve:`` prefix, labels, value);
    a counter's sample is named ``<name>_total``."""
    return [
        (sample.name.removeprefix("tinyserve:"), sample.labels, sample.value)
        for family in _families(base_url, headers)
        for sample in family.samples
    ]


def engine_gauges(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """The engine's gauges from /metrics (names without the ``tinyserve:`` prefix)."""
    return {
        family.name.removeprefix("tinyserve:"): family.samples[0].value
        for family in _families(base_url, headers)
        if family.type == "gauge" and family.samples
    }


def wait_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the pool is whole; return the last read."""
    deadline = time.monotonic() + timeout
    while True:
        g = engine_gauges(base_url)
        whole = g["kv_cache_free_blocks"] == g["kv_cache_total_blocks"]
        if (g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0 and whole) or (
            time.monotonic() > deadline
        ):
            return g
        time.sleep(0.1)


# -- an in-process uvicorn server ---------------------------------------------------------------


@dataclass
class RunningServer:
    base_url: str
    port: int
    app: object
    async_engine: object  # tinyserve.engine.async_engine.AsyncEngine

    @property
    def engine(self):
        return self.async_engine.engine

    def url(self, path: str) -> str:
        return self.base_url + path


@contextlib.contextmanager
def serve(async_engine, config):
    """Serve ``async_engine`` with ``config`` (a ServerConfig; its port is replaced by a free
    one) on uvicorn in a daemon thread; yields a :class:`RunningServer`."""
    import uvicorn

    from tinyserve.config import ServerConfig
    from tinyserve.entrypoints.api_server import build_app

    port = free_port()
    config = ServerConfig(**{**config.__dict__, "port": port})
    app = build_app(async_engine, config)
    uv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=uv.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", port, app, async_engine)
    finally:
        uv.should_exit = True
        thread.join(30)

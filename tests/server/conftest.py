"""Server fixtures: a real uvicorn server on a free port, in a background thread.

``server`` serves the default SmolLM2 model (loaded once per session); ``fake_server`` is a
factory for servers over the FakeEngine (no model, starts in milliseconds)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine

from tinyserve.config import ServerConfig
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.entrypoints.api_server import build_app

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    port: int
    app: object
    async_engine: AsyncEngine

    @property
    def engine(self):
        return self.async_engine.engine

    def url(self, path: str) -> str:
        return self.base_url + path


@contextlib.contextmanager
def serve(async_engine: AsyncEngine, config: ServerConfig):
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


@pytest.fixture(scope="session")
def server(smollm2_gguf_path):
    from tinyserve.engine.arg_utils import EngineArgs
    from tinyserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(kv_cache_memory="256MiB", max_num_seqs=64))
    with serve(AsyncEngine(engine, max_queued_requests=64), ServerConfig()) as s:
        yield s


@pytest.fixture
def fake_server(smollm2_tokenizer):
    """Factory: ``with fake_server(api_key=..., max_num_seqs=..., ...) as s:``."""

    @contextlib.contextmanager
    def make(
        max_queued_requests: int = 16,
        api_key: str | None = None,
        server_options: dict | None = None,
        **engine_kwargs,
    ):
        fake = FakeEngine(tokenizer=smollm2_tokenizer, **engine_kwargs)
        config = ServerConfig(
            api_key=api_key, max_queued_requests=max_queued_requests, **(server_options or {})
        )
        with serve(AsyncEngine(fake, max_queued_requests=max_queued_requests), config) as s:
            yield s

    return make


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def wait_until(predicate, timeout: float = 2.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, checking the framing on the way."""
    events, lines = [], []
    for line in response.iter_lines():
        if line == "":
            if lines:
                assert len(lines) == 1, lines
                assert lines[0].startswith("data: "), lines
                events.append(lines[0][len("data: ") :])
            lines = []
        elif line.startswith(":"):
            continue  # SSE comment (keep-alive ping)
        else:
            lines.append(line)
    assert not lines, f"unterminated event: {lines}"
    return events

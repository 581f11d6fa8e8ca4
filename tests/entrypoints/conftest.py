"""Server fixtures: a real uvicorn server on a free port, in a background thread
(tinyserve.testing.server.serve).

``server`` serves the default SmolLM2 model (loaded once per session); ``fake_server`` is a
factory for servers over the FakeEngine (no model, starts in milliseconds)."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tinyserve.config import ServerConfig
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.testing.server import serve


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

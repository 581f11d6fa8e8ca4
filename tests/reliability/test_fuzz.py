"""Fuzzing the HTTP API (a smaller run of benchmarks/fuzz.py): schemathesis from the server's
own OpenAPI document, and the hand-written hostile requests. The server runs the real engine
over a tiny random Llama with SmolLM2's tokenizer, so valid requests are cheap."""

from __future__ import annotations

import pytest

from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.models.default_model import tokenizer_dir_for
from tinyserve.testing.checkpoints import build_fuzz_model
from tinyserve.testing.fuzz import (
    MAX_MODEL_LEN,
    MAX_REQUEST_BYTES,
    fuzz_failures,
    run_hostile,
    run_schemathesis,
)
from tinyserve.testing.server import serve, wait_until


@pytest.fixture(scope="module")
def fuzz_server(smollm2_gguf_path, tmp_path_factory):
    model = build_fuzz_model(
        tmp_path_factory.mktemp("fuzz") / "model", tokenizer_dir_for(smollm2_gguf_path)
    )
    engine = LLMEngine(
        EngineArgs(
            model=str(model),
            max_num_seqs=16,
            kv_cache_memory="64MiB",
            max_model_len=MAX_MODEL_LEN,
        )
    )
    config = ServerConfig(max_request_bytes=MAX_REQUEST_BYTES)
    with serve(AsyncEngine(engine, max_queued_requests=64), config) as s:
        yield s


def _idle_and_whole(server) -> bool:
    s = server.async_engine.stats()
    return (
        s.num_running == 0
        and s.num_waiting == 0
        and s.num_free_blocks == s.num_total_blocks
        and server.async_engine.num_requests_in_flight == 0
    )


@pytest.mark.slow
def test_hostile_requests(fuzz_server):
    r = run_hostile(fuzz_server.base_url)
    assert fuzz_failures(r) == [], r
    assert r["cases"] >= 250 and r["status_counts"].get("413") == 2, r
    assert r["status_counts"]["400"] > 150 and r["status_counts"]["200"] > 10, r
    assert wait_until(lambda: _idle_and_whole(fuzz_server), timeout=10)


@pytest.mark.slow
def test_schemathesis(fuzz_server):
    r = run_schemathesis(fuzz_server.base_url, max_examples=20, seed=1)  # 12 operations x 2 modes
    assert fuzz_failures(r) == [], r
    # Both modes of every operation ran, and the positive ones reached the engine.
    api = [k for k in r["operations"] if not k.startswith(("GET /health", "GET /metrics"))]
    ops = {k.rsplit(" ", 1)[0] for k in api}
    assert {
        "POST /v1/responses",
        "GET /v1/engine/events",
        "GET /v1/engine/snapshot",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        "GET /v1/models/{model_id}",
    } <= ops, r
    assert len(ops) == 12 and len(api) == 2 * 12, r
    assert all(r["operations"][k]["cases"] > 0 for k in api), r
    assert r["status_counts"].get("200", 0) > 20, r
    assert wait_until(lambda: _idle_and_whole(fuzz_server), timeout=10)

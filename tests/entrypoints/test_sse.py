"""Raw SSE framing, parsed by hand with httpx."""

from __future__ import annotations

import json

from tests.support.api import MODEL
from tinyserve.testing.sse import sse_events


def _stream(client, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def test_chat_sse_format_n2_with_usage(client):
    events = _stream(
        client,
        "/v1/chat/completions",
        {
            "model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        },
    )  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    body, usage = chunks[:-1], chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 12
    for index in (0, 1):
        mine = [ch for c in body for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        reasons = [ch["finish_reason"] for ch in mine]
        assert reasons.count("length") == 1 and reasons[-1] == "length"
        assert all(r is None for r in reasons[:-1])
        assert all("finish_reason" in ch for ch in mine)


def test_completion_sse_format(client):
    events = _stream(
        client,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "stream": True},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert all("usage" not in c for c in chunks)


def test_stream_over_context_window_is_a_400_before_streaming(client, server):
    body = {"prompt": "hi", "max_tokens": server.async_engine.max_model_len, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 400
        r.read()
        assert r.json()["error"]["param"] == "max_tokens"

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
    # OpenAI's contract: exactly one chunk with usage, every other one says null.
    assert all("usage" in c and c["usage"] is None for c in body)
    assert sum(c["choices"] == [] for c in chunks) == 1
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


def test_continuous_usage_stats_count_as_they_go(client):
    """vLLM's ``continuous_usage_stats``: every chunk carries the counts so far; the last
    (usage) chunk the totals."""
    for path, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                        ("/v1/completions", {"prompt": "Hello"})):  # fmt: skip
        events = _stream(client, path, {
            "model": MODEL, **extra, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        })  # fmt: skip
        chunks = [json.loads(e) for e in events[:-1]]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5
        assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
        assert chunks[-1]["choices"] == [] and chunks[-2]["usage"] == chunks[-1]["usage"]


def test_a_lone_surrogate_escape_in_decoded_json_is_replaced_not_a_500(fake_server):
    """Inside the tool envelope's content string (decoded for the client) or a tool_use
    block's input, a model may write half an emoji's escape; UTF-8 cannot carry the lone
    surrogate it decodes to (a 500, or a broken stream). It arrives as U+FFFD."""
    import httpx

    half = ['{"content": "hi \\ud83d', ' there"}']
    call = ['{"tool_calls": [{"name": "f", "arguments": {"a": "x\\udc00"}}]}']
    tool = {"type": "function", "function": {"name": "f"}}
    with fake_server(script=half) as s:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                "tools": [tool], "max_tokens": 8}  # fmt: skip
        r = httpx.post(s.url("/v1/chat/completions"), json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "hi \ufffd there"
        with httpx.stream("POST", s.url("/v1/chat/completions"), json={**body, "stream": True},
                          timeout=30) as st:  # fmt: skip
            lines = [json.loads(x[6:]) for x in st.iter_lines() if x.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in lines if c["choices"])
        assert text == "hi \ufffd there"
    with fake_server(script=call) as s:
        body = {"model": "fake-model", "max_tokens": 8, "tools": [
            {"name": "f", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        r = httpx.post(s.url("/v1/messages"), json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["input"] == {"a": "x\ufffd"}


def test_the_finishing_chunk_says_what_stopped_it(client):
    """vLLM's ``stop_reason`` (the stop string or token id) on the finishing chunk, as the
    unstreamed choice has it: streamed chunks never carried it."""
    for path, body in [("/v1/completions", {"prompt": "The capital of France is"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Name a city."}]})]:  # fmt: skip
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **body}
        whole = client.post(path, json=body).json()["choices"][0]
        text = whole.get("text") or whole["message"]["content"]
        stop = text.split()[1] if len(text.split()) > 1 else text[1:3]  # reached mid-answer
        assert client.post(path, json={**body, "stop": [stop]}).json()["choices"][0][
            "stop_reason"] == stop  # fmt: skip
        chunks = [json.loads(e) for e in _stream(client, path, {**body, "stop": [stop],
                                                               "stream": True})[:-1]]  # fmt: skip
        choices = [c["choices"][0] for c in chunks]
        assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop
        assert all(c["stop_reason"] is None for c in choices[:-1])

"""Many clients at once, and clients that go away mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.api import MODEL
from tinyserve.testing.server import wait_until
from tinyserve.testing.sse import aiter_data, iter_data

MAX_TOKENS = 8


async def _one_stream(client: httpx.AsyncClient, i: int) -> tuple[int, int, str]:
    body = {
        "model": MODEL, "prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "logprobs": 0, "temperature": 0.5, "seed": i, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    tokens, usage, finish = 0, None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for data in aiter_data(r.aiter_lines()):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk["choices"]:
                choice = chunk["choices"][0]
                tokens += len(choice["logprobs"]["tokens"])
                finish = choice["finish_reason"] or finish
            else:
                usage = chunk["usage"]["completion_tokens"]
    return tokens, usage, finish


@pytest.mark.slow
def test_32_concurrent_streams(server):
    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(_one_stream(c, i) for i in range(32)))

    results = asyncio.run(main())
    assert results == [(MAX_TOKENS, MAX_TOKENS, "length")] * 32
    assert wait_until(lambda: server.async_engine.stats().num_running == 0)


def _pool_is_whole(server) -> bool:
    s = server.async_engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_disconnect_after_3_chunks_aborts_and_frees_blocks(server, client, path):
    body = {"model": MODEL, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    else:
        body["prompt"] = "Once upon a time"
    with client.stream("POST", path, json=body) as r:
        seen = []
        for data in iter_data(r.iter_lines()):
            seen.append(data)
            if len(seen) == 3:
                break
        assert server.async_engine.stats().num_running == 1, seen
    t0 = time.monotonic()
    assert wait_until(lambda: _pool_is_whole(server), timeout=2.0), server.async_engine.stats()
    assert time.monotonic() - t0 < 2.0
    assert server.async_engine.num_requests_in_flight == 0
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_non_streamed_client_timeout_aborts(server):
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=1.0)
    assert wait_until(lambda: _pool_is_whole(server), timeout=2.0), server.async_engine.stats()


BIG = ("The quick brown fox jumps over the lazy dog. " * 23_000)[:1_000_000]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}),
    # content parts counted 0 characters: templated on the loop (a hunt: 2.5-4.4 s stalls)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": BIG}]}]}),
    ("/tokenize", {"prompt": BIG}),  # tokenized on the loop
], ids=["chat", "chat-parts", "tokenize"])  # fmt: skip
def test_a_megabyte_prompt_does_not_stall_other_streams(server, smollm2_tokenizer, path, body):
    """Templating and tokenising 1 MB of chat content takes about a second here; done on the
    event loop it would freeze every open stream for that long. It runs in a worker thread:
    a stream in flight keeps its inter-token gaps small while the big request is processed
    (a chat request rejected, as too long for the context, once tokenised)."""
    text = BIG
    t0 = time.perf_counter()
    smollm2_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    tokenise_s = time.perf_counter() - t0
    assert tokenise_s > 0.3, "too fast to show a stall: make the prompt longer"

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            stamps: list[float] = []
            big_sent = asyncio.Event()
            big_done: list[float] = []

            async def stream():
                body = {"model": MODEL, "prompt": "Count:", "max_tokens": 300, "stream": True,
                        "ignore_eos": True}  # fmt: skip
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            stamps.append(time.perf_counter())
                            if len(stamps) == 5:
                                big_sent.set()
                            if big_done and stamps[-1] > big_done[0] + 0.2:
                                return

            async def big():
                await big_sent.wait()
                start = time.perf_counter()
                r = await c.post(path, json={"model": MODEL, **body})
                big_done.append(time.perf_counter())
                return r, start

            _, (r, start) = await asyncio.gather(stream(), big())
            return r, start, stamps, big_done[0]

    r, start, stamps, end = asyncio.run(main())
    if path == "/tokenize":
        assert r.status_code == 200 and r.json()["count"] > 200_000
    else:
        assert r.status_code == 400 and "context window" in r.json()["error"]["message"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > start and a < end]
    assert gaps, "no token arrived while the big request was processed"
    assert max(gaps) < tokenise_s / 2, (max(gaps), tokenise_s, end - start)

"""Stream plumbing shared by chat and completions: merging the n/prompt sub-requests,
collecting non-streamed results, watching for a client that goes away, and SSE framing
(``data: {json}`` events, then ``data: [DONE]``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse

from tinyserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import OpenAIError, engine_error
from tinyserve.outputs import StepOutput, TokenLogprob


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# -- helpers shared by chat and completions ------------------------------------------------------


def finish_reason_of(out: StepOutput) -> str | None:
    """The client-facing finish reason; an internal failure of the request raises."""
    if out.finish_reason == "error":
        raise RequestFailedError(out.error or "internal error")
    return out.finish_reason


def usage(num_prompt_tokens: int, choices: list[Choice]) -> P.UsageInfo:
    completion = sum(c.num_tokens for c in choices)
    return P.UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=num_prompt_tokens + completion,
    )


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleave several requests' outputs as they come, tagged with the stream's position.
    Leaving early (error, disconnect) aborts every request still running."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.abort()


async def collect(streams: list[RequestStream], n: int) -> list[Choice]:
    choices = [Choice() for _ in range(n * len(streams))]
    async for prompt_idx, out in merge(streams):
        c = choices[prompt_idx * n + out.index]
        c.finish_reason = finish_reason_of(out)
        c.text += out.text_delta
        c.num_tokens += len(out.new_token_ids)
        c.logprobs.extend(out.logprobs)
        c.stop_reason = out.stop_reason
    return choices


async def until_disconnect(
    raw: Request, work: Awaitable[list[Choice]], streams: list[RequestStream]
) -> list[Choice]:
    """Run a non-streamed request, aborting it if the client goes away meanwhile."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        for s in streams:
            s.abort()
        raise OpenAIError(499, "client disconnected", "client_closed_request")
    try:
        return task.result()
    except RequestFailedError as e:
        raise engine_error(e) from None
    except EngineDeadError as e:
        raise engine_error(e) from None


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def sse(events: AsyncIterator[dict[str, Any]], shutdown_grace_period: float) -> EventSourceResponse:
    # sse-starlette ends every stream at the server's shutdown signal unless given a grace
    # period: with it, a SIGTERM lets streams in flight finish (the drain).
    return EventSourceResponse(
        _sse_lines(events), sep="\n", shutdown_grace_period=shutdown_grace_period
    )


async def _sse_lines(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    except (RequestFailedError, EngineDeadError) as e:
        yield json.dumps(engine_error(e).body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield "[DONE]"

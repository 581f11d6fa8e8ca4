"""Stream plumbing shared by chat and completions: reading one request's outputs (every
choice, already indexed by the engine's output processor), collecting non-streamed results,
watching for a client that goes away, mapping engine errors to HTTP statuses, and SSE framing
(``data: {json}`` events, then ``data: [DONE]``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from tinyserve.engine.client import (
    EngineDeadError,
    OutputStream,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
)
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import OpenAIError
from tinyserve.entrypoints.tool_stream import feed, feed_step
from tinyserve.outputs import StepOutput, TokenLogprob, Usage, count_cached

if TYPE_CHECKING:
    from tinyserve.entrypoints.tool_stream import AllStopped

# Inputs larger than this (characters of text or message content) are templated and
# tokenised in a worker thread instead of on the event loop.
OFF_LOOP_CHARS = 16_384


def input_size(value: Any) -> int:
    """The characters of text in a request's input, wherever they sit (message content, its
    parts' ``text``, calls' arguments, tools' schemas): the size ``off_loop`` goes by. It read
    ``content`` only, so text in content parts counted 0 and a 3 MB message was templated on
    the event loop, every other client waiting ~3 s."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(map(input_size, value))
    if isinstance(value, dict):
        return sum(map(input_size, value.values()))
    if isinstance(value, BaseModel):
        return sum(map(input_size, value.__dict__.values()))
    return 0


async def off_loop(size: int, fn: Callable, *args):
    """``fn(*args)``, in a worker thread when the input is large."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def engine_error(e: Exception) -> OpenAIError:
    """The HTTP error for an error raised at the engine seam (engine/client.py)."""
    if isinstance(e, QueueFullError):
        return OpenAIError(
            429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(e, RequestRejectedError):
        return OpenAIError(
            400, str(e), "invalid_request_error", param=e.param, code="invalid_value"
        )
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), "service_unavailable_error", code="engine_dead")
    return OpenAIError(500, f"internal error: {e}", "internal_error", code="internal_error")


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    prompt_index: int = 0
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    armed_at: int | None = None  # where in text stop strings began to count (min_tokens)

    def unarmed(self, text: str) -> int:
        """How many leading characters of ``text`` (this choice's text or a suffix of it: the
        answer after a reasoning block) came before stop strings counted."""
        armed = len(self.text) - (len(self.text) if self.armed_at is None else self.armed_at)
        return max(len(text) - armed, 0)


@dataclass
class ChunkFrame:
    """The frame of an OpenAI stream (chat and completions) around the API's own chunks: each
    chunk's head (id, object, created, model); the token counts so far (each prompt once,
    every choice's output), put on each chunk as the job's ``stream_options`` ask
    (``"usage": null``, or with vLLM's ``continuous_usage_stats`` the counts); and with
    ``include_usage`` one last chunk with no choices and the request's usage (serving.py
    ``Job``)."""

    job: Any
    head: dict[str, Any]
    counts: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    cached: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)
    usage: Usage | None = None

    @classmethod
    def start(cls, job: Any, chunk_object: str, model: str) -> ChunkFrame:
        head = {"id": job.request_id, "object": chunk_object, "created": int(time.time())}
        return cls(job, {**head, "model": model})

    async def chunks(
        self,
        stream: OutputStream,
        per_output: Callable[[StepOutput, str | None], list[dict[str, Any]]],
        opening: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The API's ``opening`` chunks, its chunks for each output (``per_output(out,
        finish_reason)``), then the usage chunk; each marked with the counts so far."""
        for chunk in opening or []:
            yield self.mark(chunk)
        async for out in outputs(stream):
            self.usage = out.usage or self.usage
            self.cached = count_cached(
                self.cached_by_prompt, out.prompt_index, out.num_cached_tokens
            )  # as the final usage counts them
            chunks = per_output(out, finish_reason_of(out))
            stopped = self.job.stop_counts  # (up to a text stop, not what ran on after it)
            self.counts[out.index] = stopped.get(out.index, out.num_output_tokens)
            for chunk in chunks:
                yield self.mark(chunk)
            if self.job.answered() and out.usage is None:  # every choice ended by a stop
                stream.abort()  # string of its text (Job.stops): nothing more to send
                break
        if self.job.include_usage:  # (the counts so far where the request was aborted)
            usage = self.usage or self._so_far()
            if self.usage is not None and self.job.stop_counts:
                usage = dataclasses.replace(usage, completion_tokens=sum(self.counts.values()))
            yield {**self.head, "choices": [], "usage": usage_info(usage).model_dump()}

    def mark(self, chunk: dict[str, Any]) -> dict[str, Any]:
        job = self.job
        if job.include_usage:
            usage = self._so_far()
            chunk["usage"] = usage_info(usage).model_dump() if job.continuous_usage else None
        return chunk

    def _so_far(self) -> Usage:
        return Usage(sum(map(len, self.job.prompts)), sum(self.counts.values()), self.cached)


# -- helpers shared by chat and completions ------------------------------------------------------


def finish_reason_of(out: StepOutput) -> str | None:
    """The client-facing finish reason; an internal failure of the request raises."""
    if out.finish_reason == "error":
        if out.error_param:
            raise RequestRejectedError(out.error or "invalid request", out.error_param)
        raise RequestFailedError(out.error or "internal error")
    return out.finish_reason


def usage_info(usage: Usage | None) -> P.UsageInfo:
    usage = usage or Usage()
    return P.UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=_prediction_details(usage),
    )


def _prediction_details(usage: Usage) -> dict[str, int] | None:
    """OpenAI's counts for a request with a prediction (None without one)."""
    if not usage.accepted_prediction_tokens + usage.rejected_prediction_tokens:
        return None
    return {"accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
            "reasoning_tokens": 0}  # fmt: skip


async def outputs(stream: OutputStream) -> AsyncIterator[StepOutput]:
    """A request's outputs as they come; leaving early (error, disconnect) aborts it."""
    try:
        async for out in stream:
            yield out
    finally:
        stream.abort()


async def collect(
    stream: OutputStream, answered: AllStopped | None = None
) -> tuple[list[Choice], Usage | None]:
    """A non-streamed request: every choice in index order, and the request's usage.
    ``answered(out)`` (fed every output; tool_stream.AllStopped): True once nothing more is
    wanted (every choice ended by a stop string of its text): the request is aborted there.
    A choice that met such a stop counts its tokens and logprobs to the token that completed
    it (tool_stream.feed_step) and takes nothing after, while others run on; the usage's
    completion_tokens are then these counts, not the engine's."""
    choices: dict[int, Choice] = {}
    usage, prompt_tokens, cached, cached_total = None, {}, {}, 0
    async for out in outputs(stream):
        c = choices.setdefault(out.index, Choice(prompt_index=out.prompt_index))
        usage = out.usage or usage
        prompt_tokens[out.prompt_index] = out.num_prompt_tokens
        cached_total = count_cached(cached, out.prompt_index, out.num_cached_tokens)
        if answered is not None and answered.stopped(out.index):
            continue  # past its text's stop: neither text, logprobs nor tokens count
        c.finish_reason = finish_reason_of(out)
        if c.armed_at is None and out.armed_from is not None:
            c.armed_at = len(c.text) + out.armed_from
        c.text += out.text_delta
        done = answered is not None and answered(out)
        took = len(out.new_token_ids)  # (of the stopping step, the tokens up to its stop)
        took = answered.used.get(out.index, took) if answered is not None else took
        c.num_tokens += took
        c.logprobs.extend(out.logprobs[:took])
        c.prompt_logprobs = c.prompt_logprobs or out.prompt_logprobs
        c.stop_reason = out.stop_reason
        if done and out.usage is None:
            stream.abort()
            break
    stopped = [i for i in choices if answered is not None and answered.stopped(i)]
    for i in stopped:  # ended by a stop string of its text
        choices[i].finish_reason = choices[i].finish_reason or "stop"
    if stopped:  # the tokens up to each choice's stop (the engine counted what ran on)
        counted = sum(c.num_tokens for c in choices.values())
        usage = dataclasses.replace(usage, completion_tokens=counted) if usage else Usage(
            sum(prompt_tokens.values()), counted, cached_total)  # fmt: skip
    return [choices[i] for i in sorted(choices)], usage


async def until_disconnect(raw: Request, work: Awaitable, stream: OutputStream):
    """Run a non-streamed request, aborting it if the client goes away meanwhile."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    left = True  # the client went away, or this handler was cancelled (a hard shutdown):
    try:  # the request is aborted either way (it was left running, its task orphaned)
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        left = not task.done()
    finally:
        watcher.cancel()
        if left:
            task.cancel()
            stream.abort()
    if left:
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


DRAIN_MARGIN_S = 2.0  # past the drain time: for the ended requests' last events to go out


def sse(
    events: AsyncIterator[dict[str, Any]], shutdown_grace_period: float, typed: bool = False
) -> EventSourceResponse:
    """``typed``: the Responses API's framing, each event named by its ``type``
    (``event: response.created``) and no ``[DONE]`` at the end."""
    # sse-starlette ends every stream at the server's shutdown signal unless given a grace
    # period: with it, a SIGTERM lets streams in flight finish (the drain). Its own cut is
    # silent: it comes DRAIN_MARGIN_S after the drain's (api_server._DrainingServer).
    grace = shutdown_grace_period + DRAIN_MARGIN_S
    return EventSourceResponse(_sse_lines(events, typed), sep="\n", shutdown_grace_period=grace)


# A surrogate code point in a str is a lone one (json.loads joins escaped pairs): a model
# may write half an emoji's escape ("\\ud83d") inside a JSON string we decode (the tool
# envelope's content, a tool_use block's input). UTF-8 cannot encode it (a 500, or a broken
# stream); it becomes U+FFFD, as a broken byte sequence in text does.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def answer_json(content: Any, allow_nan: bool = True) -> str:
    """An answer's JSON text for the wire (UTF-8, lone surrogates replaced)."""
    text = json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=allow_nan)
    return _LONE_SURROGATE.sub("\ufffd", text) if _LONE_SURROGATE.search(text) else text


class AnswerResponse(JSONResponse):
    """A JSON answer (``answer_json``)."""

    def render(self, content: Any) -> bytes:
        return answer_json(content, allow_nan=False).encode("utf-8")  # as Starlette's


async def _sse_lines(events: AsyncIterator[dict[str, Any]], typed: bool) -> AsyncIterator:
    try:
        async for event in events:
            data = answer_json(event)
            yield {"event": event["type"], "data": data} if typed else data
    except (RequestFailedError, EngineDeadError) as e:
        yield json.dumps(engine_error(e).body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    if not typed:
        yield "[DONE]"


def tokens_to_stop(out: StepOutput, used: int) -> int:
    """A choice's output tokens up to its text's stop string, met ``used`` tokens into
    ``out`` (tool_stream.feed_step; the engine counts what ran on after)."""
    return out.num_output_tokens - len(out.new_token_ids) + used


def stream_deltas(
    parser: Any, text: str, finish: str | None, unarmed: int = 0, out: StepOutput | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """Chat deltas of ``text``: content, or with tools what the tool-stream parser reads
    (stop strings not counting in its first ``unarmed`` characters: tool_stream.feed); of a
    step (``out``; ``text`` its text_delta or a reasoning splitter's part of it), fed through
    tool_stream.feed_step, with the tokens of the step its text's stop took (else None)."""
    if parser is None:
        return [{"content": text}], None
    stepped = out is not None
    events, used = feed_step(parser, out, text) if stepped else (feed(parser, text, unarmed), None)
    events += parser.finish(finish) if finish is not None else []
    return [delta for delta, _ in events], used

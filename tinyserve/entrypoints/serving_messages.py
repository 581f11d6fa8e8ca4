"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the
shared steps: the request becomes chat messages, tools and a tool choice
(protocol_anthropic.py), then takes the chat path's template, grammar-enforced tool calls and
parsers; the answer is Anthropic's message, or with ``stream: true`` its typed events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` (``text_delta``,
``input_json_delta``) / ``_stop``, ``message_delta`` with the stop reason and usage,
``message_stop``). Errors on these paths take Anthropic's shape (http_guards.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.engine.client import EngineDeadError, OutputStream, RequestFailedError
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints import protocol_anthropic as A
from tinyserve.entrypoints.http_guards import check_api_key
from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.serving import (
    Job,
    OpenAIServing,
    answers_json,
    format_constraint,
)
from tinyserve.entrypoints.streaming import (
    AnswerResponse,
    Choice,
    engine_error,
    finish_reason_of,
    off_loop,
    outputs,
    stream_deltas,
    tokens_to_stop,
)
from tinyserve.entrypoints.structured_options import json_answer_schema, with_json_options
from tinyserve.entrypoints.tool_formats import tool_format
from tinyserve.entrypoints.tool_stream import visible_stop
from tinyserve.outputs import Usage
from tinyserve.sampling_params import SamplingParams


class MessagesServing(OpenAIServing):
    async def create(self, req: A.MessagesRequest, raw: Request) -> Response:
        """validate -> params -> prompt (``prepare``) -> submit -> events or the message."""
        try:
            self.check_request(req)
            job = await self.prepare(req)
            stream = await self.submit(job, req)
        except OpenAIError as e:  # a prompt too long: this API's messages
            raise P.in_own_words(e, None, "messages") from None
        if job.stream:
            return self.sse(self._events(job, stream), typed=True)
        return AnswerResponse(self.response(job, *await self.collect(raw, stream, job)))

    async def prepare(self, req: A.MessagesRequest) -> Job:
        prompt_ids, tools, choice, parallel, prefill = await self._prompt(req)
        if req.max_tokens < 1:
            raise bad_request("max_tokens: must be >= 1", "max_tokens")
        fmt = req.output_config.format if req.output_config else None
        if prefill and (fmt is not None or (tools and tool_format(self.tokenizer) is None)):
            # The grammar would start the answer anew after the prefill: 'The answer is'
            # followed by a whole new envelope, or '{' by a whole new JSON object.
            raise bad_request("messages: an assistant prefill cannot be continued under "
                              + ("output_config.format" if fmt is not None else
                                 "tools with this model (its chat template has no tool "
                                 "support: the answer is a JSON envelope)"), "messages")  # fmt: skip
        if fmt is not None:  # Anthropic's structured outputs: chat's json_schema format
            fmt = format_constraint("json_schema", fmt.schema_, "output_config.format",
                                    "output_config.format.schema")  # fmt: skip
        json_answer = answers_json(tools, fmt, choice)  # beside tools: a call or that JSON
        if tools:
            so = self.tools_constraint(tools, choice, parallel,
                                       json_answer_schema(fmt) if json_answer else None)  # fmt: skip
        else:
            so = with_json_options(fmt, None, self.json_layout)  # --json-pretty
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                max_tokens=req.max_tokens, stop=req.stop_sequences or [], structured_outputs=so,
                **self.tool_decoding(tools),
            )  # fmt: skip
        except ValueError as e:
            raise bad_request(e) from None
        return Job(A.new_message_id(), [prompt_ids], params, stream=req.stream, tools=tools,
                   json_answer=json_answer, format_check=fmt if tools else None)  # fmt: skip

    async def _prompt(self, req: A.MessagesRequest) -> tuple[list[int], list, Any, bool, bool]:
        req.check()
        choice, parallel = req.chat_tool_choice()
        tools = self.checked_tools(req.chat_tools() or None, choice)
        messages, prefill = req.chat_messages()
        size = sum(len(m.content or "") if isinstance(m.content, str) else 0 for m in messages)
        prompt_ids = await off_loop(size, self.chat_prompt_ids, messages, True, tools, choice,
                                    None, prefill)  # fmt: skip
        return prompt_ids, tools, choice, parallel, prefill

    async def count_tokens(self, req: A.CountTokensRequest) -> dict[str, Any]:
        self.check_model(req.model)
        prompt_ids, *_ = await self._prompt(req)
        return {"input_tokens": len(prompt_ids)}

    def _answer(self, job: Job, c: Choice) -> tuple[list[dict[str, Any]], str, str | None]:
        content, calls, _, stop = self.answer_tools(
            job, c.text, c.finish_reason, c.stop_reason, c.unarmed(c.text)
        )
        finish = "stop" if isinstance(stop, str) else c.finish_reason  # a stop string won
        reason, sequence = A.stop_reason(finish, stop, bool(calls))
        return A.content_blocks(content, calls), reason, sequence

    def response(self, job: Job, choices: list[Choice], usage: Usage | None) -> dict[str, Any]:
        usage = usage or Usage()
        blocks, reason, sequence = self._answer(job, choices[0])
        return A.message(job.request_id, self.model_name, blocks, reason, sequence,
                         usage.prompt_tokens, usage.completion_tokens)  # fmt: skip

    async def _events(self, job: Job, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        head = A.message(job.request_id, self.model_name, [], None, None, len(job.prompts[0]), 0)
        yield {"type": "message_start", "message": head}
        yield {"type": "ping"}
        parser = self.tool_stream(job) if job.tools else None
        blocks, finish, stop, usage, tokens = _Blocks(), None, None, None, 0
        try:
            async for out in outputs(stream):
                usage, finish, stop = out.usage or usage, finish_reason_of(out), out.stop_reason
                tokens = out.num_output_tokens
                deltas, used = stream_deltas(parser, out.text_delta, finish, out=out)
                if used is not None:  # its text's stop: the tokens up to it
                    tokens = tokens_to_stop(out, used)
                for delta in deltas:
                    for event in blocks.feed(delta):
                        yield event
                if visible_stop(parser) is not None and out.usage is None:
                    stream.abort()  # a stop sequence of the text: nothing more to send
                    break
        except (RequestFailedError, EngineDeadError) as e:
            yield {"type": "error", **A.error_body(engine_error(e))}
            return
        for event in blocks.close():
            yield event
        if (text_stop := visible_stop(parser)) is not None:  # a stop string in the text
            finish, stop = "stop", text_stop
        reason, sequence = A.stop_reason(finish, stop, blocks.called and finish != "length")
        output_tokens = usage.completion_tokens if usage and text_stop is None else tokens
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": output_tokens}}  # fmt: skip
        yield {"type": "message_stop"}


class _Blocks:
    """The chat path's stream deltas (content, tool-call starts and argument fragments) as
    Anthropic's content blocks: one text block per run of text, one tool_use block per call."""

    def __init__(self) -> None:
        self.index, self.open, self.called = -1, None, False

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index, self.open = self.index + 1, block["type"]
        return [
            *events,
            {"type": "content_block_start", "index": self.index, "content_block": block},
        ]

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("content"):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "text_delta", "text": delta["content"]}})  # fmt: skip
        for e in delta.get("tool_calls") or []:
            fn = e.get("function") or {}
            if e.get("id") is not None:
                self.called = True
                events += self._start({"type": "tool_use", "id": A.tool_use_id(e["id"]),
                                       "name": fn.get("name") or "", "input": {}})  # fmt: skip
            if fn.get("arguments"):
                events.append({"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}})  # fmt: skip
        return events


def messages_router() -> APIRouter:
    api = APIRouter(dependencies=[Depends(check_api_key)])

    @api.post("/v1/messages")
    async def create_message(body: A.MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API; ``stream: true`` answers with its typed events."""
        return await request.app.state.serving_messages.create(body, request)

    @api.post("/v1/messages/count_tokens", response_model=A.CountTokensResponse)
    async def count_tokens(body: A.CountTokensRequest, request: Request) -> Response:
        """The prompt's tokens, as /v1/messages would template them."""
        return JSONResponse(await request.app.state.serving_messages.count_tokens(body))

    return api

"""``POST /v1/responses`` (OpenAI's Responses API, stateless) over the chat path.

The input items become chat messages (protocol_responses.chat_messages) and go through the
same chat template, tools (tools.py: the template's ``<tool_call>`` blocks or the JSON
envelope, grammar-enforced), structured outputs (``text.format`` -> a JSON-schema grammar),
sampling parameters and engine request as ``/v1/chat/completions``; the chat path's outputs
(its text, or its streamed tool-call deltas from tool_stream.py) are then built into output
items and typed events by responses_stream.ResponseBuilder. Nothing is stored:
``store: true``, ``previous_response_id`` and ``background`` are 400s, and
``GET /v1/responses/{id}`` is a 404 that says so. A client that goes away aborts the engine
request (streaming.outputs / until_disconnect, as for chat).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.engine.client import EngineDeadError, OutputStream, RequestFailedError
from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.http_guards import check_api_key
from tinyserve.entrypoints.protocol import ErrorResponse, OpenAIError, bad_request, dump
from tinyserve.entrypoints.protocol_responses import (
    ResponseObject,
    ResponsesRequest,
    TextConfig,
    chat_messages,
    response_head,
)
from tinyserve.entrypoints.responses_stream import Event, ResponseBuilder, new_id
from tinyserve.entrypoints.serving import OpenAIServing
from tinyserve.entrypoints.streaming import (
    collect,
    engine_error,
    finish_reason_of,
    off_loop,
    outputs,
    sse,
    until_disconnect,
)
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams


def text_format(text: TextConfig | None) -> StructuredOutputsParams | None:
    """``text.format``: json_schema / json_object -> the structured-outputs grammar."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, field="text.format")
    if fmt.schema_ is None:
        raise bad_request("text.format.schema: json_schema needs a schema", "text.format.schema")
    try:
        return StructuredOutputsParams(json=fmt.schema_, field="text.format")
    except ValueError as e:
        raise bad_request(e, "text.format") from None


class ResponsesServing:
    """The handler; ``serving`` (the app's ``OpenAIServing``) provides the chat path."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        s = self.serving
        s.check_model(req.model)
        req.check_stateless()
        choice = req.chat_tool_choice()
        tools = s.checked_tools(req.chat_tools(), choice)
        messages = chat_messages(req.input, req.instructions)
        response_id = new_id("resp")
        try:  # the chat path's messages name max_tokens
            params = self._params(req, tools, choice)
            # The body's size stands for the input's (templated off the loop when large).
            prompt_ids = await off_loop(
                _body_size(raw), s.chat_prompt_ids, messages, True, tools, choice
            )
            s._log_request(response_id, req)
            stream = await s.add(response_id, [prompt_ids], params)
        except OpenAIError as e:
            raise _max_output_tokens(e) from None
        builder = ResponseBuilder(response_head(req, response_id, s.model_name))
        if req.stream:
            events = self._events(builder, stream, s.tool_stream()() if tools else None)
            return sse(events, s.shutdown_grace_period, typed=True)
        (choice_out,), usage = await until_disconnect(raw, collect(stream), stream)
        # The whole text through the stream's parser: the same items as when streamed.
        parser = s.tool_stream()() if tools else None
        for delta in _deltas(parser, choice_out.text, choice_out.finish_reason):
            builder.chat_delta(delta)
        builder.finish(choice_out.finish_reason, usage)
        return JSONResponse(dump(builder.response))

    def _params(
        self, req: ResponsesRequest, tools: list[T.Tool], choice: T.ToolChoice | None
    ) -> SamplingParams:
        so = text_format(req.text)
        if so is not None and req.structured_outputs is not None:
            raise bad_request("text.format: give text.format or structured_outputs, not both",
                              "text.format")  # fmt: skip
        if tools:
            if so is not None or req.structured_outputs is not None:
                raise bad_request("tools: cannot be combined with text.format", "tools")
            so = self.serving.tool_structured_outputs(tools, choice, req.parallel_tool_calls)
        extra: dict[str, Any] = {"structured_outputs": so} if so is not None else {}
        return self.serving.sampling_params(req, max_tokens=req.max_output_tokens, **extra)

    async def _events(
        self, builder: ResponseBuilder, stream: OutputStream, parser: Any
    ) -> AsyncIterator[Event]:
        """The typed events; ``parser`` (a tool_stream parser, with tools) turns the text into
        content and call deltas as the chat stream does (``_deltas``)."""
        for event in builder.start():
            yield event
        finish, usage = None, None
        try:
            async for out in outputs(stream):
                usage = out.usage or usage
                finish = finish_reason_of(out)
                for delta in _deltas(parser, out.text_delta, finish):
                    for event in builder.chat_delta(delta):
                        yield event
        except (RequestFailedError, EngineDeadError) as e:
            for event in builder.fail(engine_error(e)):
                yield event
            return
        for event in builder.finish(finish, usage):
            yield event


def _deltas(parser: Any, text: str, finish: str | None) -> list[dict[str, Any]]:
    """Chat deltas of ``text``: content, or with tools what the tool-stream parser reads."""
    if parser is None:
        return [{"content": text}]
    events = parser.feed(text) + (parser.finish(finish) if finish is not None else [])
    return [delta for delta, _ in events]


def _max_output_tokens(e: OpenAIError) -> OpenAIError:
    """A 400 naming ``max_tokens`` names this API's field, max_output_tokens."""
    if e.param == "max_tokens":
        e.param = "max_output_tokens"
        e.message = re.sub(r"\bmax_tokens\b", "max_output_tokens", e.message)
    return e


def _body_size(raw: Request) -> int:
    length = raw.headers.get("content-length", "")
    return int(length) if length.isdigit() else 0


def responses_router() -> APIRouter:
    api = APIRouter(
        dependencies=[Depends(check_api_key)],
        responses={400: {"model": ErrorResponse, "description": "Invalid request"}},
    )

    @api.post("/v1/responses", response_model=ResponseObject)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """A model response (stateless); ``stream: true`` answers with typed
        ``text/event-stream`` events (``event: response.created`` ...)."""
        return await ResponsesServing(request.app.state.serving).create(body, request)

    @api.get("/v1/responses/{response_id}", responses={404: {"model": ErrorResponse}})
    async def get_response(response_id: str) -> Response:
        raise OpenAIError(
            404,
            f"No response with id {response_id!r}: this server is stateless and stores no "
            "responses",
            "not_found_error",
            param="response_id",
        )

    return api

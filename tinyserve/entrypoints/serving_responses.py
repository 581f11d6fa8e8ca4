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

import dataclasses
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tinyserve.engine.client import EngineDeadError, OutputStream, RequestFailedError
from tinyserve.entrypoints import reasoning as R
from tinyserve.entrypoints.http_guards import check_api_key
from tinyserve.entrypoints.protocol import ErrorResponse, OpenAIError, dump, in_own_words
from tinyserve.entrypoints.protocol_responses import (
    ResponseObject,
    ResponsesRequest,
    chat_messages,
    response_head,
)
from tinyserve.entrypoints.responses_stream import Event, ResponseBuilder, new_id
from tinyserve.entrypoints.serving import Job, OpenAIServing, answers_json, format_constraint
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
from tinyserve.entrypoints.tool_stream import visible_stop
from tinyserve.outputs import StepOutput, Usage


@dataclass
class ResponsesJob(Job):
    builder: ResponseBuilder | None = None
    splitter: R.ReasoningSplitter | None = None  # a thinking model's answer (reasoning.py)


class ResponsesServing(OpenAIServing):
    """The Responses API over the shared steps and the chat template; its own answer (output
    items, typed events) is responses_stream.ResponseBuilder's."""

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        """validate -> params -> prompt (``prepare``) -> submit -> typed events or the
        response object."""
        try:
            self.check_request(req)
            job = await self.prepare(req, raw)
            stream = await self.submit(job, req)
        except OpenAIError as e:
            raise _in_own_terms(e) from None
        if job.stream:
            parser = self.tool_stream(job) if job.tools else None
            return self.sse(self._events(job, stream, parser), typed=True)
        return AnswerResponse(self.response(job, *await self.collect(raw, stream, job)))

    async def prepare(self, req: ResponsesRequest, raw: Request) -> ResponsesJob:
        req.check_stateless()
        choice = req.chat_tool_choice()
        tools = self.checked_tools(req.chat_tools(), choice)
        fmt = req.text.format if req.text is not None else None
        answer = format_constraint(fmt.type if fmt else None, fmt.schema_ if fmt else None,
                                   "text.format", "text.format.schema",
                                   fmt.strict if fmt else None)  # fmt: skip
        so = self.constraint(req, answer, "text.format", tools, choice, req.parallel_tool_calls)
        params = self.sampling_params(
            req,
            max_tokens=req.max_output_tokens,
            structured_outputs=so,
            **self.tool_decoding(tools),
        )
        # The body's size stands for the input's (templated off the loop when large).
        messages = chat_messages(req.input, req.instructions)
        prompt_ids = await off_loop(
            _body_size(raw), self.chat_prompt_ids, messages, True, tools, choice
        )
        response_id = new_id("resp")
        builder = ResponseBuilder(response_head(req, response_id, self.model_name))
        splitter = None
        if self.thinks(None):  # as chat: the grammar after the block, or no split at all
            opened = R.split_or_gate(self.tokenizer, prompt_ids, params)
            splitter = R.ReasoningSplitter(opened) if opened is not None else None
        return ResponsesJob(response_id, [prompt_ids], params, stream=req.stream, tools=tools,
                            json_answer=answers_json(tools, answer, choice),
                            format_check=answer if tools else None,
                            builder=builder, splitter=splitter)  # fmt: skip

    def response(
        self, job: ResponsesJob, choices: list[Choice], usage: Usage | None
    ) -> dict[str, Any]:
        (choice,) = choices
        # The whole text through the stream's parsers: the same items as when streamed.
        parser = self.tool_stream(job) if job.tools else None
        cut = choice.unarmed(choice.text)  # before it stop strings do not count (min_tokens)
        list(_answer_events(job, parser, choice.text[:cut], None, cut))  # events dropped
        list(_answer_events(job, parser, choice.text[cut:], choice.finish_reason))
        job.builder.finish("stop" if visible_stop(parser) else choice.finish_reason, usage)
        return dump(job.builder.response)

    async def _events(
        self, job: ResponsesJob, stream: OutputStream, parser: Any
    ) -> AsyncIterator[Event]:
        """The typed events; ``parser`` (a tool_stream parser, with tools) turns the text into
        content and call deltas as the chat stream does (``_deltas``)."""
        builder = job.builder
        for event in builder.start():
            yield event
        finish, usage = None, None
        try:
            async for out in outputs(stream):
                usage = out.usage or usage
                finish = finish_reason_of(out)
                for event in _answer_events(job, parser, out.text_delta, finish, out=out):
                    yield event
                if visible_stop(parser) is not None and out.usage is None:  # a stop string of
                    stream.abort()  # the text (Job.stops): nothing more to send
                    tokens = job.stop_counts.get(0, out.num_output_tokens)  # up to the stop
                    usage = Usage(len(job.prompts[0]), tokens, out.num_cached_tokens)
                    break
        except (RequestFailedError, EngineDeadError) as e:
            for event in builder.fail(engine_error(e)):
                yield event
            return
        if usage is not None and 0 in job.stop_counts:  # met in the last output: the engine
            usage = dataclasses.replace(usage, completion_tokens=job.stop_counts[0])  # ran on
        for event in builder.finish("stop" if visible_stop(parser) else finish, usage):
            yield event


def _answer_events(
    job: ResponsesJob,
    parser: Any,
    text: str,
    finish: str | None,
    unarmed: int = 0,
    out: StepOutput | None = None,
):
    """A piece of the answer's text as the builder's events: its thinking (with a splitter)
    as reasoning, the rest through the tool parser as content and calls (stop strings not
    counting in its first ``unarmed`` characters: min_tokens; streamed, ``out`` the step,
    whose text stop's token count goes to Job.stop_counts)."""
    if job.splitter is not None:
        reasoning, content = job.splitter.step(text, finish is not None)
        yield from job.builder.reasoning(reasoning)
        if content != text:  # split: none of it counts where any of the piece did not
            unarmed = 0 if unarmed == 0 else len(content)
        text = content
    deltas, used = stream_deltas(parser, text, finish, unarmed, out)
    if used is not None:
        job.stop_counts[0] = tokens_to_stop(out, used)
    for delta in deltas:
        yield from job.builder.chat_delta(delta)


def _in_own_terms(e: OpenAIError) -> OpenAIError:
    """A 400 of the shared steps in this API's words: ``max_tokens`` is max_output_tokens
    (also inside another field's message: min_tokens'), and the messages, or a prompt too
    long for the context, are ``input`` (``prompt`` is a field of its own here: its 400
    keeps its name)."""
    if e.param == "messages":
        e.param, e.message = "input", re.sub(r"^messages\b", "input", e.message)
    return in_own_words(e, "max_output_tokens", "input")


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
        return await request.app.state.serving_responses.create(body, request)

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

"""/v1/chat/completions: messages -> chat template -> prompt ids; tools (entrypoints/tools.py:
the template's <tool_call> blocks or a JSON envelope, grammar-enforced); responses and SSE
chunks, in which content and tool-call deltas stream as generated (tool_stream.py).

``ChatServing`` is a mixin of ``OpenAIServing`` (serving.py), which provides the shared
input handling (``tokenizer``, ``sampling_params``, ``add``, ``token_str``, ...).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.engine.client import OutputStream
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.streaming import (
    collect,
    finish_reason_of,
    input_size,
    off_loop,
    outputs,
    sse,
    until_disconnect,
    usage_info,
)
from tinyserve.entrypoints.tool_stream import EnvelopeStream, HermesStream
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams


class ChatServing:
    def chat_prompt_ids(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[T.Tool] | None = None,
        tool_choice: T.ToolChoice | None = None,
    ) -> list[int]:
        conversation = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            conversation.append({"role": m.role, "content": content or ""})
        kwargs: dict[str, Any] = {}
        if tools and T.hermes_template(self.tokenizer):  # the template renders the tools
            conversation = T.native_messages(conversation, messages)
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        else:
            conversation = T.render_messages(conversation, messages, tools or [], tool_choice)
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
            )
        except OpenAIError:
            raise
        except Exception as e:  # the template rejected the conversation (jinja raise_exception)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _chat_params(self, req: P.ChatCompletionRequest, tools: list[T.Tool]) -> SamplingParams:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs=true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise bad_request(f"top_logprobs: must be in [0, 20], got {req.top_logprobs}")
        extra: dict[str, Any] = {}
        if tools:
            if self.structured_outputs(req) is not None:
                raise bad_request("tools: cannot be combined with response_format", "tools")
            so = self.tool_structured_outputs(tools, req.tool_choice, req.parallel_tool_calls)
            extra["structured_outputs"] = so
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        return self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            **extra,
        )

    @staticmethod
    def checked_tools(tools: list[T.Tool] | None, choice: T.ToolChoice | None) -> list[T.Tool]:
        """The tools the model may call (tools.check_tools); bad ones are a 400."""
        try:
            return T.check_tools(tools, choice)
        except ValueError as e:
            raise bad_request(e, "tool_choice" if "tool_choice" in str(e) else "tools") from None

    def tool_structured_outputs(
        self, tools: list[T.Tool], tool_choice: T.ToolChoice | None, parallel: bool
    ) -> StructuredOutputsParams:
        """The grammar that makes the output a valid call (tools.py: Hermes blocks when the
        template renders tools, else the JSON envelope)."""
        if T.hermes_template(self.tokenizer):
            grammar = T.hermes_grammar(tools, tool_choice, parallel)
            return StructuredOutputsParams(grammar=grammar, field="tools")
        schema = T.envelope_schema(tools, tool_choice, parallel)
        return StructuredOutputsParams(json=schema, field="tools")

    def _parse_tools(self, text: str) -> tuple[str | None, list[T.ToolCall]]:
        if T.hermes_template(self.tokenizer):
            return T.parse_native(text)
        return T.parse_output(text)

    def tool_stream(self) -> type[HermesStream] | type[EnvelopeStream]:
        """The streamed counterpart of ``_parse_tools`` (tool_stream.py)."""
        return HermesStream if T.hermes_template(self.tokenizer) else EnvelopeStream

    async def chat(self, req: P.ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        tools = self.checked_tools(req.tools, req.tool_choice)
        params = self._chat_params(req, tools)
        prompt_ids = await off_loop(
            input_size(req.messages),
            self.chat_prompt_ids,
            req.messages,
            req.add_generation_prompt,
            tools,
            req.tool_choice,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._log_request(request_id, req)
        stream = await self.add(request_id, [prompt_ids], params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            tool_stream = self.tool_stream() if tools else None
            events = self._chat_stream(request_id, stream, params, include_usage, tool_stream)
            return sse(events, self.shutdown_grace_period)
        choices, usage = await until_disconnect(raw, collect(stream), stream)
        result_choices = []
        for i, c in enumerate(choices):
            content, calls, finish = c.text, [], c.finish_reason
            if tools and finish == "stop":
                content, calls = self._parse_tools(c.text)
                finish = "tool_calls" if calls else finish
            logprobs = None
            if params.logprobs is not None:
                logprobs = P.chat_logprobs(c.logprobs, self.token_str)
            message = P.ChatResponseMessage(content=content, tool_calls=calls or None)
            result_choices.append(
                P.ChatCompletionChoice(
                    index=i,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )  # fmt: skip
            )
        result = P.ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=result_choices, usage=usage_info(usage)
        )
        return JSONResponse(P.dump(result))

    async def _chat_stream(
        self,
        request_id: str,
        stream: OutputStream,
        params: SamplingParams,
        include_usage: bool,
        tool_stream: type[HermesStream] | type[EnvelopeStream] | None,
    ) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created}
        head["model"] = self.model_name

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
            choice["finish_reason"] = finish_reason
            return {**head, "choices": [choice]}

        for i in range(params.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        usage = None
        parsers: dict[int, HermesStream | EnvelopeStream] = {}  # with tools: one per choice
        async for out in outputs(stream):
            usage = out.usage or usage
            fr = finish_reason_of(out)
            lp = (
                P.chat_logprobs(out.logprobs, self.token_str)
                if params.logprobs is not None
                else None
            )
            if tool_stream is not None:
                parser = parsers.setdefault(out.index, tool_stream())
                events = parser.feed(out.text_delta)
                events += parser.finish(fr) if fr is not None else []
                if not events and out.logprobs and lp is not None:
                    events = [({}, None)]
                for n, (delta, finish) in enumerate(events):
                    yield chunk(out.index, delta, lp if n == 0 else None, finish)
                continue
            if not out.text_delta and fr is None and not out.logprobs:
                continue  # the detokenizer held the text back (stop-string or UTF-8 boundary)
            delta = {"content": out.text_delta} if out.text_delta or fr is None else {}
            yield chunk(out.index, delta, lp, fr)
        if include_usage:
            yield {**head, "choices": [], "usage": usage_info(usage).model_dump()}

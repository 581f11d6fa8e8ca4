"""One response's output items and the typed events that build them (torch-free).

``ResponseBuilder`` is fed what the chat path produces -- text, and per function call its
``call_id``, name and argument fragments (the chat deltas of tool_stream.py, or the parsed
non-streamed calls) -- and keeps the response's ``output``: a ``message`` item (one
``output_text`` part) for each run of text, a ``function_call`` item for each call. Each
call returns the events that step makes, every one with its ``type`` and the next
``sequence_number``::

    response.created, response.in_progress
    response.output_item.added                  (reasoning: a thinking model's <think> block)
      response.reasoning_text.delta ...
      response.reasoning_text.done
    response.output_item.done
    response.output_item.added                  (message)
      response.content_part.added
      response.output_text.delta ...
      response.output_text.done, response.content_part.done
    response.output_item.done
    response.output_item.added                  (function_call)
      response.function_call_arguments.delta ...
      response.function_call_arguments.done
    response.output_item.done
    response.completed | response.incomplete | response.failed

An item is done when the next one begins or the response ends. The non-streamed answer is
the same builder's ``response`` with its events dropped, so both carry the same items.
"""

from __future__ import annotations

import uuid
from typing import Any

from tinyserve.entrypoints.protocol import OpenAIError, dump
from tinyserve.entrypoints.protocol_responses import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)
from tinyserve.outputs import Usage

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage | None) -> ResponseUsage:
    usage = usage or Usage()
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


class ResponseBuilder:
    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._seq = 0
        self._open: OutputMessage | FunctionCallOutput | ReasoningOutput | None = None

    def start(self) -> list[Event]:
        return [
            self._with_response("response.created"),
            self._with_response("response.in_progress"),
        ]

    def chat_delta(self, delta: dict[str, Any]) -> list[Event]:
        """A chat-chunk delta (tool_stream.py): content, a call's first delta, its arguments."""
        events = self.text(delta.get("content") or "")
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if "id" in call:
                events += self.call(call["id"], function.get("name", ""))
            events += self.arguments(function.get("arguments") or "")
        return events

    def text(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = [] if isinstance(self._open, OutputMessage) else self._open_message()
        message = self._open
        assert isinstance(message, OutputMessage)
        message.content[0].text += delta
        events.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=delta, logprobs=[]))  # fmt: skip
        return events

    def reasoning(self, delta: str) -> list[Event]:
        """Thinking text: into the open reasoning item, or a new one."""
        if not delta:
            return []
        events = (
            []
            if isinstance(self._open, ReasoningOutput)
            else self._add(ReasoningOutput(id=new_id("rs"), content=[ReasoningText()]))
        )
        item = self._open
        assert isinstance(item, ReasoningOutput)
        item.content[0].text += delta
        events.append(self._event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=delta))  # fmt: skip
        return events

    def call(self, call_id: str, name: str) -> list[Event]:
        return self._add(FunctionCallOutput(id=new_id("fc"), call_id=call_id, name=name))

    def arguments(self, delta: str) -> list[Event]:
        call = self._open
        if not delta or not isinstance(call, FunctionCallOutput):
            return []
        call.arguments += delta
        return [self._event("response.function_call_arguments.delta", **self._where(), delta=delta)]

    def finish(self, finish_reason: str | None, usage: Usage | None) -> list[Event]:
        """The last events: ``stop`` completes the response; ``length`` (max_output_tokens or
        the context window) leaves it incomplete, as does an abort."""
        # Never an empty output, nor one with no message: a thinking-only answer gets one.
        messages = any(not isinstance(i, ReasoningOutput) for i in self.response.output)
        events = [] if messages else self._open_message()
        complete = finish_reason == "stop"
        events += self._close("completed" if complete else "incomplete")
        self.response.status = "completed" if complete else "incomplete"
        if finish_reason == "length":
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        self.response.usage = response_usage(usage)
        events.append(self._with_response(f"response.{self.response.status}"))
        return events

    def fail(self, error: OpenAIError) -> list[Event]:
        """A failure after the stream began: ``response.failed`` with the error."""
        events = self._close("incomplete")
        self.response.status = "failed"
        # The Responses API's error codes: the request's fault (a 4xx: an answer that
        # breaks its schema's dropped keywords, a grammar past the parser's limits) is
        # invalid_prompt, not the server's.
        code = "invalid_prompt" if error.status < 500 else "server_error"
        self.response.error = {"code": code, "message": error.message}
        events.append(self._with_response("response.failed"))
        return events

    # -- items ------------------------------------------------------------------------------

    def _open_message(self) -> list[Event]:
        message = OutputMessage(id=new_id("msg"), content=[OutputText()])
        events = self._add(message)
        part = dump(OutputText())
        events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                  part=part))  # fmt: skip
        return events

    def _add(self, item: OutputMessage | FunctionCallOutput | ReasoningOutput) -> list[Event]:
        events = self._close("completed")
        item_dump = dump(item)
        if isinstance(item, (OutputMessage, ReasoningOutput)):
            item_dump["content"] = []  # its part is added by its own event / deltas
        self.response.output.append(item)
        self._open = item
        index = len(self.response.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item_dump))
        return events

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        self._open = None
        item.status = status  # type: ignore[assignment]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [
                self._event("response.output_text.done", **where, content_index=0, text=part.text,
                            logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0,
                            part=dump(part)),
            ]  # fmt: skip
        elif isinstance(item, ReasoningOutput):
            events = [self._event("response.reasoning_text.done", **where, content_index=0,
                                  text=item.content[0].text)]  # fmt: skip
        else:
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item.name, arguments=item.arguments)]  # fmt: skip
        index = where["output_index"]
        events.append(self._event("response.output_item.done", output_index=index, item=dump(item)))
        return events

    # -- events -----------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.response.output) - 1}

    def _with_response(self, type: str) -> Event:
        return self._event(type, response=dump(self.response))

    def _event(self, type: str, **fields: Any) -> Event:
        event = {"type": type, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

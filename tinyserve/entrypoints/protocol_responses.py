"""The Responses API's wire format (``POST /v1/responses``, stateless; pydantic, the HTTP edge).

The request's ``input`` items become the chat path's messages (``chat_messages``):
``instructions`` a first system message, message items their role and text, a run of
``function_call`` items one assistant turn with ``tool_calls``, a ``function_call_output`` a
``tool`` turn answering its ``call_id`` -- what a chat client would send for the same
conversation. Function tools and ``tool_choice`` map to the chat path's ``Tool`` /
``NamedToolChoice``. The response models follow the official SDK's
(``openai.types.responses``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tinyserve.entrypoints.protocol import (
    ChatMessage,
    PastToolCall,
    TextContentPart,
    _range,
    _Request,
    _Response,
    _SamplingFields,
    bad_request,
)
from tinyserve.entrypoints.protocol_base import error_messages
from tinyserve.entrypoints.tools import NamedToolChoice, Tool

# -- the request --------------------------------------------------------------------------------


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> Tool:
        return Tool.model_validate({"type": "function", "function": self.model_dump()})


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str

    def chat_choice(self) -> NamedToolChoice:
        return NamedToolChoice.model_validate({"function": {"name": self.name}})


class TextFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_SamplingFields):
    """OpenAI's fields, plus the chat path's sampling extensions (top_k, seed, stop, ...,
    as vLLM's Responses API takes them). One output per request (``n`` is 1); JSON output
    is asked for with ``text.format``, not ``response_format``."""

    input: str | list[dict[str, Any]] = Field(
        ..., description="Text, or message / function_call / function_call_output items"
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, **_range(minimum=1))
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool | None = Field(None, description="Only false: this server keeps no responses")
    previous_response_id: str | None = Field(None, description="Not supported (stateless)")
    background: bool | None = None
    metadata: dict[str, str] | None = None
    n: Literal[1] = 1
    response_format: None = Field(None, description="Not here: use text.format")

    def check_stateless(self) -> None:
        """What a stateless server cannot do is a 400 naming the field."""
        if self.store:
            raise bad_request(
                "store: this server is stateless and keeps no responses; send store=false "
                "or leave it out",
                "store",
            )
        if self.previous_response_id is not None:
            raise bad_request(
                "previous_response_id: this server is stateless and keeps no responses; "
                "send the whole conversation in input",
                "previous_response_id",
            )
        if self.background:
            raise bad_request("background: not supported (stateless server)", "background")
        if self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs: a chat / completions field", "prompt_logprobs")

    def chat_tools(self) -> list[Tool] | None:
        return [t.chat_tool() for t in self.tools] if self.tools is not None else None

    def chat_tool_choice(self):
        choice = self.tool_choice
        return choice.chat_choice() if isinstance(choice, FunctionToolChoice) else choice


# -- input items -> chat messages -----------------------------------------------------------------


class _ContentPart(_Request):
    type: str
    text: str | None = None


class _MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_ContentPart]


class _FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_ContentPart]


class _ReasoningItem(_Request):  # an earlier answer's thinking, sent back with its output
    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None  # [{"type": "reasoning_text", "text": ...}]


_ITEMS: dict[str, type[_Request]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
    "reasoning": _ReasoningItem,
}
_TEXT_PARTS = ("input_text", "output_text")


def chat_messages(input: str | list[dict[str, Any]], instructions: str | None) -> list[ChatMessage]:
    """The conversation the chat template renders (see the module docstring)."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    if isinstance(input, str):
        return [*messages, ChatMessage(role="user", content=input)]
    if not input:
        raise bad_request("input: must not be empty", "input")
    thinking = None  # a reasoning item's text, for the assistant turn that follows it
    calls: set[str] = set()  # the call ids so far: an output answers one of them (OpenAI)
    for i, raw in enumerate(input):
        item = _parse_item(raw, f"input[{i}]")
        if isinstance(item, _ReasoningItem):
            parts = item.content or []
            thinking = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
            continue
        if isinstance(item, _MessageItem):
            content = _text_parts(item.content, f"input[{i}].content")
            messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, _FunctionCallItem):
            calls.add(item.call_id)
            call = PastToolCall.model_validate({"id": item.call_id, "function": {
                "name": item.name, "arguments": item.arguments}})  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # one turn, several calls
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            if item.call_id not in calls:
                raise bad_request(f"input[{i}].call_id: no function_call item before it has "
                                  f"call_id {item.call_id!r} (a stateless server: send the "
                                  "call with its output)", f"input[{i}].call_id")  # fmt: skip
            output = _text_parts(item.output, f"input[{i}].output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        if thinking is not None and messages[-1].role == "assistant":  # the template's call
            messages[-1].reasoning_content, thinking = thinking or None, None
    return messages


def _parse_item(raw: dict[str, Any], where: str) -> _Request:
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(
            f"{where}.type: {kind!r} is not supported (this server takes message, "
            "function_call, function_call_output and reasoning items)",
            f"{where}.type",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        loc, msg = error_messages(e.errors())[0]
        param = where + ("." + loc if loc and loc[0] != "[" else loc)
        raise bad_request(f"{param}: {msg}", param) from None


def _text_parts(content: str | list[_ContentPart], where: str) -> str | list[TextContentPart]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(
                f"{where}[{j}].type: {part.type!r} is not supported (text only: input_text, "
                "output_text)",
                f"{where}[{j}].type",
            )
        parts.append(TextContentPart(text=part.text))
    return parts


# -- the response ---------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(BaseModel):  # a thinking model's <think> block (entrypoints/reasoning.py)
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # no explicit cache writes here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    output: list[OutputMessage | FunctionCallOutput | ReasoningOutput] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    usage: ResponseUsage | None = None
    store: bool = False
    previous_response_id: None = None
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None


def response_head(req: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response before any output: the request's settings echoed, status in_progress."""
    choice = req.tool_choice
    return ResponseObject(
        id=response_id,
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # what samples, as
        top_p=1.0 if req.top_p is None else req.top_p,  # OpenAI echoes: its defaults too
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls,
        text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text and req.text.format
        else {"format": {"type": "text"}},
        metadata=req.metadata or {},
        user=req.user,
    )

"""Anthropic's Messages API on the wire (``POST /v1/messages``, ``/v1/messages/count_tokens``):
the request models, their translation to the chat path's messages, tools and tool choice,
and the answer's content blocks. No engine imports (as protocol.py).

A request maps onto a chat completion: ``system`` (a string or text blocks) becomes the
system message; a user turn's ``tool_result`` blocks become ``tool`` messages (before the
turn's text), an assistant turn's ``tool_use`` blocks its ``tool_calls``; ``tools`` (custom
tools: ``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any`` =
required, ``tool`` = named, ``none``; ``disable_parallel_tool_use``) go through the same
grammar-enforced tool calling as chat. A final assistant message is a prefill the answer
continues. Images, documents, thinking and server tools are 400s; an earlier answer's thinking
blocks are dropped.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from tinyserve.entrypoints.protocol import (
    ChatMessage,
    OpenAIError,
    PastToolCall,
    _Request,
    bad_request,
)
from tinyserve.entrypoints.protocol_base import error_messages
from tinyserve.entrypoints.tools import NamedToolChoice, Tool, ToolCall, ToolChoice

# HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}  # fmt: skip


def error_body(err: OpenAIError) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class _Strict(_Request):
    null_is_default = False  # OpenAI reads null as the default; Anthropic's fields are typed


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class OtherBlock(_Strict):
    """Any other block (image, document, server tool results, ...): refused by name; an
    earlier answer's ``thinking`` / ``redacted_thinking`` are dropped (Anthropic strips them
    from previous turns too, so clients send them back as they got them)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _block_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    # The tags are the blocks' class names: error_location leaves them out of a param.
    tags = {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock"}
    return tags.get(kind, "OtherBlock")


# Tagged by ``type``: a known block with a bad field is that block's error (``text`` missing,
# ``input`` not an object), never "a 'text' block is not supported" from the catch-all.
Block = Annotated[
    Annotated[TextBlock, Tag("TextBlock")] | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")] | Annotated[OtherBlock, Tag("OtherBlock")],
    Discriminator(_block_kind),
]  # fmt: skip
DROPPED = frozenset({"thinking", "redacted_thinking"})


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CustomTool(_Strict):
    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(_Strict):
    """``output_config``: ``format`` (Anthropic's structured outputs) is enforced by the
    grammar as chat's ``response_format``; ``effort`` is accepted and changes nothing (the
    served model has no effort to spend). Other keys are a 400."""

    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: str | None = None


# The SDK's request fields that are metadata, billing, routing or caching hints (accepted,
# unused, as the chat path treats OpenAI's); tests classify every field of the SDK's type.
IGNORED = frozenset({"metadata", "service_tier", "cache_control", "container", "diagnostics",
                     "inference_geo", "speed", "user_profile_id", "workspace_id"})  # fmt: skip


class MessagesRequest(_Strict):
    """The fields a Messages API client sends; the SDK's others are IGNORED, and unknown
    ones too, as the chat path treats metadata."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Message] = Field(..., min_length=1)
    max_tokens: int = Field(..., description="Required, as Anthropic's API")
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range: 0.0 to 1.0
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def check(self) -> None:
        if self.thinking and self.thinking.get("type") not in (None, "disabled"):
            raise bad_request("thinking: the served model has no thinking mode", "thinking")

    def chat_messages(self) -> tuple[list[ChatMessage], bool]:
        """The chat messages, and whether the last (an assistant's text) is a prefill the
        answer continues. Only a final assistant message may be empty (then it is left out)."""
        out: list[ChatMessage] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else _join(self.system)
            out.append(ChatMessage(role="system", content=text))
        last, prefill = len(self.messages) - 1, False
        for i, m in enumerate(self.messages):
            turn = _turn(m, i)
            if turn[-1].role == "tool" or turn[-1].content or turn[-1].tool_calls:
                out += turn
                prefill = i == last and m.role == "assistant" and not turn[-1].tool_calls
            elif not (i == last and i > 0 and m.role == "assistant"):
                raise bad_request(f"messages[{i}]: content must be non-empty (only the final "
                                  "assistant message may be empty)", "messages")  # fmt: skip
        if prefill and out[-1].content != out[-1].content.rstrip():
            raise bad_request(f"messages[{last}]: the final assistant content cannot end with "
                              "trailing whitespace", "messages")  # fmt: skip
        return out, prefill

    def chat_tools(self) -> list[Tool]:
        tools = []
        for i, raw in enumerate(self.tools or []):
            if raw.get("type") not in (None, "custom"):
                raise bad_request(f"tools[{i}]: tool type {raw.get('type')!r} is not "
                                  "supported (custom tools only)", "tools")  # fmt: skip
            try:
                t = CustomTool.model_validate(raw)
                fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
                tools.append(Tool.model_validate({"type": "function", "function": fn}))
            except ValidationError as e:
                raise bad_request(f"tools[{i}]: {_first_error(e)}", "tools") from None
        return tools

    def chat_tool_choice(self) -> tuple[ToolChoice | None, bool]:
        """The chat path's tool_choice and parallel_tool_calls."""
        c = self.tool_choice
        if c is None:
            return None, True
        parallel = not c.disable_parallel_tool_use
        if c.type == "tool":
            if not c.name:
                raise bad_request("tool_choice: type 'tool' needs a name", "tool_choice")
            return NamedToolChoice.model_validate({"function": {"name": c.name}}), parallel
        return {"auto": "auto", "any": "required", "none": "none"}[c.type], parallel


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = None  # type: ignore[assignment]


def _first_error(e: ValidationError) -> str:
    where, msg = error_messages(e.errors())[0]
    return f"{where}: {msg}" if where else msg


def _join(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _turn(m: Message, i: int) -> list[ChatMessage]:
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    texts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif b.type in DROPPED and m.role == "assistant":
            continue
        elif isinstance(b, ToolUseBlock) and m.role == "assistant":
            calls.append(
                PastToolCall.model_validate(
                    {
                        "id": b.id,
                        "function": {
                            "name": b.name,
                            "arguments": json.dumps(b.input, ensure_ascii=False),
                        },
                    }
                )
            )
        elif isinstance(b, ToolResultBlock) and m.role == "user":
            content = b.content if isinstance(b.content, str) else _join(b.content)
            results.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=b.tool_use_id,
                    content=("Error: " if b.is_error else "") + content,
                )
            )
        else:
            raise bad_request(f"{where}: {b.type!r} blocks are not supported in {m.role} "
                              "turns", "messages")  # fmt: skip
    turn = []
    if texts or calls or not results:
        turn.append(ChatMessage(role=m.role, content="\n".join(texts) if texts or not calls else None,
                                tool_calls=calls or None))  # fmt: skip
    return results + turn


# -- the answer ----------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(content: str | None, calls: list[ToolCall]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for c in calls:
        try:
            args = json.loads(c.function.arguments or "{}")
        except ValueError:  # a call cut by max_tokens: what of its arguments is whole, as the
            args = _partial(c.function.arguments)  # SDK reads the streamed input_json_delta
        blocks.append({"type": "tool_use", "id": tool_use_id(c.id), "name": c.function.name,
                       "input": args})  # fmt: skip
    return blocks


def _partial(text: str) -> dict[str, Any]:
    """JSON cut short, read as the anthropic SDK reads a stream's input_json_delta (jiter's
    partial mode, which pydantic_core's from_json shares): a value not yet whole is left
    out. Was ``{}``, so a cut call's input differed streamed and not."""
    try:
        value = pydantic_core.from_json(text, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, stop: int | str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat path's finish reason. A stop sequence wins
    over calls: one that cut a call (kept as far as it got) did not end it."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if called:
        return "tool_use", None
    return "end_turn", None


def message(message_id: str, model: str, blocks: list, reason: str | None,
            sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:  # fmt: skip
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            # Anthropic's prompt caching (cache_control breakpoints) is not ours: its counts
            # are 0, as its API reports them when none is used (the prefix cache is unseen).
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}  # fmt: skip


class CountTokensResponse(BaseModel):
    input_tokens: int

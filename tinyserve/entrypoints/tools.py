"""OpenAI function calling on any chat template, guaranteed by constrained decoding.

A chat template with Hermes-style tool support (Qwen2.5: ``tools`` rendered by the template,
calls as ``<tool_call>{"name", "arguments"}</tool_call>``) is used natively: the template
renders the tools and past calls, ``required`` / named choices are enforced by a grammar of
``<tool_call>`` blocks whose JSON validates, and ``auto`` output is parsed for the blocks
(and for a Llama-3 style bare ``{"name", "parameters"}`` call).

Any other template gets the tools in a system message and answers in one JSON envelope, which
a grammar enforces (as llama.cpp's generic handler does for templates without tool support):

    {"tool_calls": [{"name": "get_weather", "arguments": {...}}, ...]}   # a call
    {"content": "..."}                                                  # plain text

``tool_choice``: ``none`` (tools ignored, no grammar), ``auto`` (either envelope),
``required`` (a call to any tool) or ``{"type": "function", "function": {"name"}}`` (a call
to that one). The arguments of every call validate against its function's ``parameters``
schema; ``parallel_tool_calls=false`` allows one call. Earlier assistant ``tool_calls`` and
``tool`` results in the conversation are rendered in the same envelope, so the template
needs no tool support. The output is parsed back into ``message.tool_calls`` (content
null, finish_reason ``tool_calls``) or ``message.content``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_PARALLEL_CALLS = 8


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Wire):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: _FunctionName


class FunctionCall(_Wire):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Wire):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[Tool]:
    """The tools the model may call (empty: answer as plain chat). ValueError for bad input."""
    if isinstance(choice, NamedToolChoice) or choice == "required":
        if not tools:
            raise ValueError("tool_choice: requires tools")
    if not tools or choice == "none":
        return []
    for t in tools:
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ValueError(
                f"tools: the parameters of {t.function.name!r} must be an object schema"
            )
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not in tools")
        return named
    return list(tools)


def envelope_schema(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> dict:
    """The JSON schema the output must match (see the module docstring)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    call_schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # A named tool_choice asks for one call of that function, as OpenAI answers it.
    max_calls = MAX_PARALLEL_CALLS if parallel and not isinstance(choice, NamedToolChoice) else 1
    with_calls = {
        "type": "object",
        "properties": {
            "tool_calls": {
                "type": "array", "items": call_schema, "minItems": 1, "maxItems": max_calls,
            }
        },
        "required": ["tool_calls"],
        "additionalProperties": False,
    }  # fmt: skip
    if choice in (None, "auto"):
        text = {"type": "object", "properties": {"content": {"type": "string"}},
                "required": ["content"], "additionalProperties": False}  # fmt: skip
        return {"anyOf": [with_calls, text]}
    return with_calls


def system_prompt(tools: list[Tool], choice: ToolChoice | None) -> str:
    specs = [t.function.model_dump(exclude_none=True) for t in tools]
    must = choice not in (None, "auto")
    lines = [
        "You can call these functions:",
        json.dumps(specs, ensure_ascii=False),
        'Reply with JSON only. To call functions: {"tool_calls": [{"name": <function name>, '
        '"arguments": <arguments object>}]}.',
        "You must call a function." if must else 'To answer in text: {"content": <your answer>}.',
    ]
    return "\n".join(lines)


def render_messages(conversation: list[dict], messages, tools, choice) -> list[dict]:
    """``conversation`` (role/content dicts from ``messages``) with the tools' system message
    added and assistant tool calls / tool results rendered as text."""
    out = []
    for turn, m in zip(conversation, messages, strict=True):
        if m.role == "assistant" and getattr(m, "tool_calls", None):
            calls = [{"name": c.function.name, "arguments": _loads(c.function.arguments)}
                     for c in m.tool_calls]  # fmt: skip
            turn = {"role": "assistant", "content": json.dumps({"tool_calls": calls})}
        elif m.role == "tool":
            call_id = getattr(m, "tool_call_id", None) or "?"
            turn = {"role": "tool", "content": f"Result of call {call_id}: {turn['content']}"}
        out.append(turn)
    if tools:
        prompt = system_prompt(tools, choice)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_output(text: str) -> tuple[str | None, list[ToolCall]]:
    """The envelope back into (content, tool calls). Text that is not an envelope (cut by
    max_tokens) comes back as content."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return None, [_call(c["name"], c["arguments"]) for c in value["tool_calls"]]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"], []
    return text, []


# -- native (Hermes) templates -------------------------------------------------------------------

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def hermes_template(tokenizer) -> bool:
    """The chat template renders ``tools`` and writes calls as ``<tool_call>`` blocks."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    return "tools" in template and "<tool_call>" in template


def native_messages(conversation: list[dict], messages) -> list[dict]:
    """Past calls and tool results in the form tool-aware templates read."""
    out = []
    for turn, m in zip(conversation, messages, strict=True):
        if m.role == "assistant" and getattr(m, "tool_calls", None):
            calls = [{"type": "function", "id": c.id, "function": {
                "name": c.function.name, "arguments": _loads(c.function.arguments)}}
                for c in m.tool_calls]  # fmt: skip
            turn = {**turn, "tool_calls": calls}
        elif m.role == "tool" and getattr(m, "tool_call_id", None):
            turn = {**turn, "tool_call_id": m.tool_call_id}
        out.append(turn)
    return out


def hermes_grammar(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> str | None:
    """A Lark grammar of one or more ``<tool_call>`` blocks (None for ``auto``: free text)."""
    if choice in (None, "auto"):
        return None
    call = envelope_schema(tools, choice, parallel)["properties"]["tool_calls"]["items"]
    many = parallel and not isinstance(choice, NamedToolChoice)
    return "\n".join([
        'start: call ("\\n" call)*' if many else "start: call",
        'call: "<tool_call>\\n" body "\\n</tool_call>"',
        "body: %json " + json.dumps(call),
    ])  # fmt: skip


def parse_native(text: str) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>`` blocks (or one bare Llama-3 JSON call) -> (content, tool calls)."""
    calls, rest = [], text
    for block in _HERMES_CALL.findall(text):
        value = _loads(block)
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            calls.append(_call(value["name"], value.get("arguments", {})))
    if calls:
        rest = _HERMES_CALL.sub("", text).strip()
        return rest or None, calls
    value = _loads(text.strip())
    if (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and ("parameters" in value or "arguments" in value)
    ):
        return None, [_call(value["name"], value.get("parameters", value.get("arguments")))]
    return text, []


def _call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=args)
    )

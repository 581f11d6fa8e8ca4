"""OpenAI function calling on any chat template, guaranteed by constrained decoding.

A chat template with Hermes-style tool support (Qwen2.5: ``tools`` rendered by the template,
calls as ``<tool_call>{"name", "arguments"}</tool_call>``) is used natively: the template
renders the tools and past calls, and a grammar of ``<tool_call>`` blocks whose JSON
validates shapes the output: ``required`` / named, the output is the blocks; ``auto``, free
text until the model writes ``<tool_call>``, from where a valid call must follow. Text
outside the blocks is the message's content.

Any other template gets the tools in a system message and answers in one JSON envelope, which
a grammar enforces (as llama.cpp's generic handler does for templates without tool support):

    {"tool_calls": [{"name": "get_weather", "arguments": {...}}, ...]}   # a call
    {"content": "..."}                                                  # plain text

``tool_choice``: ``none`` (tools ignored, no grammar), ``auto`` (either envelope),
``required`` (a call to any tool) or ``{"type": "function", "function": {"name"}}`` (a call
to that one). The arguments of every call validate against its function's ``parameters``
schema; ``parallel_tool_calls=false`` allows one call. Earlier calls (their ``arguments``
as sent) and results are rendered in the same envelope: no tool support needed. The output
is parsed into ``message.tool_calls`` (content null, finish_reason ``tool_calls``) or
``message.content``; a call's ``arguments`` is its JSON text exactly as generated, what its
streamed fragments add up to (tool_stream.py).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyserve.entrypoints.protocol_base import _Request
from tinyserve.structured.strict import closed_objects, dangling_ref
from tinyserve.utils.regex_size import check_regex, schema_patterns

MAX_PARALLEL_CALLS = 8
# How a call's JSON is written (llguidance's options, read from the schema's top-level
# "x-guidance" key): on one line, ", " and ": " between items (json.dumps's own form), no
# other whitespace. Free whitespace let a 135M model pretty-print and pad forced calls until
# max_tokens (issue 39: 72 of 100 forced weather calls finished within 200 tokens).
TOOL_JSON_OPTIONS = {"coerce_one_of": True, "whitespace_flexible": False,
                     "whitespace_pattern": None,  # null: no default pattern merged back in
                     "item_separator": ", ", "key_separator": ": "}  # fmt: skip


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Request):  # a lone surrogate in a description is the field's 400
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
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):  # a call names its function: which one would it be?
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tools: function names must be unique ({twice!r} is given twice)")
    for t in tools:
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ValueError(f"tools: {t.function.name!r}'s parameters must be an object schema")
        for pattern in schema_patterns(params):  # checked here: Hermes embeds them in Lark
            check_regex(pattern, "tools")
        if (ref := dangling_ref(params, params)) is not None:  # checked here: inside the
            raise ValueError(  # envelope the library's message names our relocated $defs
                f"tools: the parameters of {t.function.name!r}: $ref {ref!r} does not resolve"
            )
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not in tools")
        return named
    return list(tools)


def call_schema(
    tools: list[Tool],
    defs: dict | None = None,
    open_args: bool = False,
    args_key: str = "arguments",
) -> dict:
    """The JSON schema of one call: ``{"name": <a tool>, <args_key>: <its parameters>}``.
    Parameters that use ``$ref`` are moved into ``defs`` (the envelope's root ``$defs``).
    Unless ``open_args``, an object with declared properties takes no others where its schema
    does not say (OpenAI's strict semantics: ``closed_objects``)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                args_key: _relocated(parameters(t, open_args), f"t{i}", defs),
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def parameters(tool: Tool, open_args: bool = False) -> dict:
    """A tool's arguments schema; closed (``closed_objects``) unless ``open_args``. None,
    ``{}`` or a bare object: no parameters (OpenAI: "omitting parameters defines a function
    with an empty parameter list"): arguments ``{}``, where the model had invented some."""
    p = tool.function.parameters or {}
    if not set(p) - {"type", "title", "description", "$schema", "$id"}:
        p = {**p, "type": "object", "properties": {}}
    return p if open_args else closed_objects(p)


def _relocated(params: dict, own: str, defs: dict | None) -> dict:
    """A schema (tool ``i``'s parameters, ``own`` = ``t{i}``), placed inside the envelope:
    its ``$ref``s point at its own root (``#``, ``#/$defs/X``, ``#/definitions/X``,
    ``#/properties/...``), which inside the envelope is no longer the document's root. So
    such a schema becomes ``$defs/{own}`` of the envelope, its definitions ``$defs/{own}__X``,
    and every ref is rewritten to match (pydantic-made schemas use ``$defs`` for nested
    models)."""
    if defs is None or "$ref" not in json.dumps(params):
        return params

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            parts = ref[2:].split("/", 2) if ref != "#" else []
            if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
                out["$ref"] = "/".join([f"#/$defs/{own}__{parts[1]}", *parts[2:]])
            else:
                out["$ref"] = f"#/$defs/{own}" + (ref[1:] if ref != "#" else "")
        return out

    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    for key in ("$defs", "definitions"):
        for name, schema in (params.get(key) or {}).items():
            defs[f"{own}__{name}"] = rewrite(schema)
    defs[own] = rewrite(body)
    return {"$ref": f"#/$defs/{own}"}


def envelope_schema(
    tools: list[Tool],
    choice: ToolChoice | None,
    parallel: bool,
    open_args: bool = False,
    answer: dict | None = None,
) -> dict:
    """The JSON schema the output must match (see the module docstring), written on one
    line (TOOL_JSON_OPTIONS). ``answer``: with ``auto``, the schema of the answer that is not
    a call (a response format's): ``{"content": <that JSON value>}``, not a string."""
    defs: dict = {}
    one_call = call_schema(tools, defs, open_args)
    # A named tool_choice asks for one call of that function, as OpenAI answers it.
    max_calls = MAX_PARALLEL_CALLS if parallel and not isinstance(choice, NamedToolChoice) else 1
    with_calls = {
        "type": "object",
        "properties": {
            "tool_calls": {
                "type": "array", "items": one_call, "minItems": 1, "maxItems": max_calls,
            }
        },
        "required": ["tool_calls"],
        "additionalProperties": False,
    }  # fmt: skip
    body = with_calls
    if choice in (None, "auto"):  # (the answer's definitions join defs: root made after)
        content = {"type": "string"} if answer is None else _relocated(answer, "answer", defs)
        text = {"type": "object", "properties": {"content": content},
                "required": ["content"], "additionalProperties": False}  # fmt: skip
        body = {"anyOf": [with_calls, text]}
    return {"x-guidance": TOOL_JSON_OPTIONS, **({"$defs": defs} if defs else {}), **body}


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


def render_messages(conversation: list[dict], messages, tools, choice, tool_role=True) -> list:
    """``conversation`` (role/content dicts from ``messages``) with the tools' system message
    added and assistant tool calls / tool results rendered as text; without a ``tool_role``
    in the template (chat_template.renders_tool_role) results are user turns, run together
    with the user turns beside them (such templates want user and assistant to alternate)."""
    out: list[dict] = []
    merged = False
    for turn, m in zip(conversation, messages, strict=True):
        if m.role == "assistant" and getattr(m, "tool_calls", None) and not tools:
            # No tools now (tool_choice none): no envelope to answer in, so earlier calls
            # are text; as envelope JSON the model copied it, and nothing unwrapped it.
            calls = [f"(called {c.function.name} with {c.function.arguments})"
                     for c in m.tool_calls]  # fmt: skip
            turn = {"role": "assistant", "content": "\n".join([turn["content"], *calls]).strip()}
        elif m.role == "assistant" and getattr(m, "tool_calls", None):
            # Text the assistant wrote beside its calls stays in the history, before them.
            calls = ", ".join(written_call(c) for c in m.tool_calls)
            text = "\n".join(filter(None, [turn["content"], f'{{"tool_calls": [{calls}]}}']))
            turn = {"role": "assistant", "content": text}
        elif m.role == "tool":
            call_id = getattr(m, "tool_call_id", None) or "?"
            turn = {"role": "tool" if tool_role else "user",
                    "content": f"Result of call {call_id}: {turn['content']}"}  # fmt: skip
        result = not tool_role and m.role == "tool"
        if out and turn["role"] == out[-1]["role"] == "user" and (result or merged):
            turn = {"role": "user", "content": f"{out.pop()['content']}\n\n{turn['content']}"}
        merged = result  # a result turn: the user turn after it joins it
        out.append(turn)
    if tools:
        prompt = system_prompt(tools, choice)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def written_call(call, key: str = "arguments") -> str:
    """A past call as the model writes it, arguments starting with "{" as sent back, JSON or
    not (the generated text, cut by max_tokens too: the next prompt repeats its tokens and hits
    the prefix cache, which re-serialising missed), other arguments as JSON."""
    args = call.function.arguments
    args = args if args.lstrip().startswith("{") else json.dumps(loads(args), ensure_ascii=False)
    return f'{{"name": {json.dumps(call.function.name, ensure_ascii=False)}, "{key}": {args}}}'


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_output(text: str, json_answer: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The envelope back into (content, tool calls). Text that is not an envelope (cut by
    max_tokens) comes back as content. Each call's ``arguments`` is the JSON text exactly as
    generated (what a streamed call's fragments add up to); so is the content where it is a
    response format's JSON answer (``json_answer``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        items = value["tool_calls"]
        if all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
            raw_items = raw_children(raw_children(text)["tool_calls"])
            raw_args = [raw_children(r).get("arguments", "{}") for r in raw_items]
            return None, [_call(c["name"], a) for c, a in zip(items, raw_args, strict=True)]
    if isinstance(value, dict) and json_answer and "content" in value:
        return raw_children(text)["content"], []
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"], []
    return text, []


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def raw_children(text: str) -> Any:
    """The members of the JSON object (``{key: source text}``) or the items of the JSON array
    (``[source text]``) ``text``, each value's text exactly as written. ValueError if ``text``
    is not an object or an array."""
    i = _WS.match(text).end()
    opener = text[i : i + 1]
    if opener not in ("{", "["):
        raise ValueError("not a JSON object or array")
    closer = "}" if opener == "{" else "]"
    members: dict[str, str] = {}
    items: list[str] = []
    i = _WS.match(text, i + 1).end()
    while text[i : i + 1] != closer:
        if opener == "{":
            if text[i : i + 1] != '"':
                raise ValueError("expected a key")
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _WS.match(text, i).end()
            if text[i : i + 1] != ":":
                raise ValueError("expected ':'")
            i = _WS.match(text, i + 1).end()
        _, end = _DECODER.raw_decode(text, i)
        if opener == "{":
            members[key] = text[i:end]
        else:
            items.append(text[i:end])
        i = _WS.match(text, end).end()
        if text[i : i + 1] == ",":
            i = _WS.match(text, i + 1).end()
        elif text[i : i + 1] != closer:
            raise ValueError(f"expected ',' or {closer!r}")
    return members if opener == "{" else items


# -- native (Hermes) templates -------------------------------------------------------------------

# A block and the whitespace around it (which is not content).
_OPEN = re.compile(r"[ \t\n\r]*<tool_call>[ \t\n\r]*")
_CLOSE = re.compile(r"[ \t\n\r]*</tool_call>[ \t\n\r]*")


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
                "name": c.function.name, "arguments": loads(c.function.arguments)}}
                for c in m.tool_calls]  # fmt: skip
            turn = {**turn, "tool_calls": calls}
        elif m.role == "tool" and getattr(m, "tool_call_id", None):
            turn = {**turn, "tool_call_id": m.tool_call_id}
        out.append(turn)
    return out


def parse_native(text: str) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>`` blocks -> (content, tool calls): the content is the text outside the
    blocks less the whitespace next to them; a block that is not a call ends the parse (it and
    what follows stay content). ``arguments`` is the JSON text exactly as generated."""
    pieces, calls, pos = [], [], 0
    while (tag := _OPEN.search(text, pos)) is not None:
        try:
            value, end = _DECODER.raw_decode(text, tag.end())
        except ValueError:
            break
        close = _CLOSE.match(text, end)
        if close is None or not isinstance(value, dict) or not isinstance(value.get("name"), str):
            break
        pieces.append(text[pos : tag.start()])
        calls.append(_call(value["name"], raw_children(text[tag.end() : end]).get("arguments")))
        pos = close.end()
    if not calls:
        return text, []
    content = "".join(pieces) + text[pos:]
    return content or None, calls


def _call(name: str, arguments: str | None) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments or "{}"))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"

"""Tool calls in each model family's own format, chosen from the chat template's text.

A template that knows tools says how its model writes a call, and a model calls best in the
form it was trained on. Four forms are read from the template and grammar-enforced:

=========  ===========================================================  ======================
format     the model writes                                             template marker
=========  ===========================================================  ======================
hermes     ``<tool_call>{"name", "arguments"}</tool_call>`` blocks      ``<tool_call>``
           (Qwen2.5/3, SmolLM3, Hermes; tools.py)
mistral    ``[TOOL_CALLS][{"name", "arguments"}, ...]``, or in v11+         ``[TOOL_CALLS]``
           templates (``[ARGS]`` in them) ``[TOOL_CALLS]name[ARGS]{...}``
           per call, back to back (Mistral Small 3.2: ``name[CALL_ID]id[ARGS]``,
           the id optional)
granite    ``<|tool_call|>[{"name", "arguments"}, ...]``                 ``<|tool_call|>``
llama3     ``{"name", "parameters"}``, the whole answer (one call)      ``"parameters"``
=========  ===========================================================  ======================

At most ``MAX_PARALLEL_CALLS`` calls in every format (``parallel_tool_calls=false`` or a
named choice: one). Any other template gets tools.py's JSON envelope. Where the marker is one special token of
the tokenizer (Mistral's ``[TOOL_CALLS]``, Granite's ``<|tool_call|>``), the grammar names the
token (llguidance's ``<[id]>``) and the answer is detokenized with special tokens kept, so the
parser sees the marker (vLLM's Mistral parser does the same); elsewhere the marker is text.
Past calls go back to the template as ``tool_calls`` where it renders them (Mistral's template
insists on 9-character alphanumeric ids: the ids are mapped, the same way in a call and in its
result), else as the assistant's content written in the format (Granite 3.x's template
renders content only). The non-streamed parse is the streamed parser run over the whole text
(tool_stream_marked.py), so the two agree by construction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.tool_stream import HermesStream
from tinyserve.entrypoints.tool_stream_marked import (
    PYTHON_TAG,
    MarkedStream,
    NamedArgsStream,
    collect_calls,
)
from tinyserve.structured.schema_approx import final_check, needs_final_check
from tinyserve.structured.schema_fixes import fix_schema


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


@dataclass(frozen=True)
class MarkedFormat:
    """Calls after a marker, as one JSON array of ``{"name", <args_key>}`` objects
    (``array``), or as one such object that is the whole answer (no marker: Llama 3.x)."""

    name: str
    marker: str  # "" for a bare call at the start of the answer
    array: bool
    args_key: str = "arguments"
    marker_id: int | None = None  # the marker's token id where it is one special token
    renders_calls: bool = True  # the template writes past tool_calls itself
    id_length: int | None = None  # Mistral: tool call ids of 9 alphanumerics
    args_marker: str = ""  # Mistral v11+: each call is MARKER name ARGS_MARKER {arguments}
    args_marker_id: int | None = None
    id_marker: str = ""  # Mistral Small 3.2: name [CALL_ID] 9 alphanumerics [ARGS] ... (optional)
    id_marker_id: int | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        return any(i is not None for i in (self.marker_id, self.args_marker_id, self.id_marker_id))

    def grammar(
        self, tools: list[T.Tool], choice, parallel: bool, open_args: bool,
        answer: dict | None = None,
    ) -> str:  # fmt: skip
        """llguidance Lark: ``required`` / named, the answer is the calls; ``auto``, free text
        until the marker, then calls (Llama 3.x: a call, or text that does not open one). With
        ``answer`` (a response format's schema), that JSON instead of text without calls."""
        many = parallel and not isinstance(choice, T.NamedToolChoice)
        auto = choice in (None, "auto")
        alone, rules = answer_rule(answer) if auto else ("TEXT", [])
        if self.args_marker:
            return self._named_grammar(tools, auto, many, open_args, (alone, rules))
        defs: dict = {}
        one = T.call_schema(tools, defs, open_args, self.args_key)
        body = one if not self.array else {
            "type": "array", "items": one, "minItems": 1,
            "maxItems": T.MAX_PARALLEL_CALLS if many else 1,
        }  # fmt: skip
        schema = {"x-guidance": T.TOOL_JSON_OPTIONS, **({"$defs": defs} if defs else {}),
                  **fix_schema(body)}  # fmt: skip
        lines = ["calls: %json " + json.dumps(schema), *rules]
        if not self.marker:
            lines.append("start: calls" + (f" | {alone}" if auto else ""))
            if alone == "TEXT":
                lines.append("TEXT: /(?s:([^{ \\t\\n\\r]|[ \\t\\n\\r]+[^{ \\t\\n\\r]).*)?/")
            return "\n".join(lines)
        mark = _lark_literal(self.marker, self.marker_id)
        if auto and rules:  # the JSON or a call, no text before it (one lexer cannot end
            lines.append(f"start: {alone} | {mark} calls")  # a lazy text and a JSON value)
        elif auto:
            lines += ["start: TEXT | head calls", f"head[lazy]: TEXT {mark}",
                      "TEXT: /(?s:.*)/"]  # fmt: skip
        else:
            lines.append(f"start: {mark} calls")
        return "\n".join(lines)

    def _named_grammar(
        self, tools: list[T.Tool], auto: bool, many: bool, open_args: bool,
        answer: tuple[str, list[str]] = ("TEXT", []),
    ) -> str:  # fmt: skip
        """``MARKER name ARGS {arguments}`` per call, the calls back to back; where the
        template writes past calls with an id (``id_marker``), the model may write one too."""
        mark = _lark_literal(self.marker, self.marker_id)
        args = _lark_literal(self.args_marker, self.args_marker_id)
        if self.id_marker:
            call_id = _lark_literal(self.id_marker, self.id_marker_id)
            args = f"({call_id} CALL_ID)? {args}"
        lines = [
            f"call{i}: {json.dumps(t.function.name)} {args} %json " + json.dumps({
                "x-guidance": T.TOOL_JSON_OPTIONS,
                **fix_schema(T.parameters(t, open_args))})
            for i, t in enumerate(tools)
        ]  # fmt: skip
        lines.append("call: " + " | ".join(f"call{i}" for i in range(len(tools))))
        if self.id_marker:
            lines.append(f"CALL_ID: /[a-zA-Z0-9]{{{self.id_length}}}/")
        calls = "call"  # then at most MAX_PARALLEL_CALLS - 1 more, as the arrays' maxItems
        for _ in range(T.MAX_PARALLEL_CALLS - 1 if many else 0):
            calls = f"call ({mark} {calls})?"
        if auto and answer[1]:  # the JSON or calls (as ``grammar``)
            lines += [f"start: {answer[0]} | {mark} {calls}", *answer[1]]
        elif auto:
            lines += [f"start: TEXT | head {calls}", f"head[lazy]: TEXT {mark}",
                      "TEXT: /(?s:.*)/"]  # fmt: skip
        else:
            lines.append(f"start: {mark} {calls}")
        return "\n".join(lines)

    def stream(self, answer_names: list[str] | None = None):
        """The parser of a streamed answer; ``answer_names``: the tools, where a JSON answer
        may stand instead of calls (Llama 3.x's bare JSON calls then wait for the end)."""
        if self.args_marker:
            return NamedArgsStream(self.marker, self.args_marker, self.id_marker)
        if answer_names is not None and not self.marker:
            return WholeAnswer(self, answer_names)
        return MarkedStream(self.marker, self.array, self.args_key)

    def parse(
        self, text: str, answer_names: list[str] | None = None
    ) -> tuple[str | None, list[T.ToolCall]]:
        stream = self.stream(answer_names)
        return collect_calls(stream.feed(text) + stream.finish("stop"))

    def messages(self, conversation: list[dict], messages) -> list[dict]:
        """Past calls and results as this template reads them."""
        out = []
        for turn, m in zip(conversation, messages, strict=True):
            calls = getattr(m, "tool_calls", None)
            if m.role == "assistant" and calls and not self.renders_calls:
                turn = {**turn, "content": (turn.get("content") or "") + self.written(calls)}
            elif m.role == "assistant" and calls:
                turn = {**turn, "tool_calls": [
                    {"type": "function", "id": self.call_id(c.id), "function": {
                        "name": c.function.name, "arguments": T.loads(c.function.arguments)}}
                    for c in calls]}  # fmt: skip
            elif m.role == "tool" and getattr(m, "tool_call_id", None):
                turn = {**turn, "tool_call_id": self.call_id(m.tool_call_id)}
            out.append(turn)
        return out

    def written(self, calls) -> str:
        """Calls as the model writes them (for templates that render content only)."""
        items = [T.written_call(c, self.args_key) for c in calls]
        return self.marker + (f"[{', '.join(items)}]" if self.array else items[0])

    def call_id(self, call_id: str) -> str:
        """The id the template is given: as sent, or (Mistral) 9 alphanumerics derived from
        it, the same for a call and its result."""
        if self.id_length is None:
            return call_id
        alnum = "".join(ch for ch in call_id if ch.isalnum())
        if len(alnum) < self.id_length:
            alnum += hashlib.sha256(call_id.encode()).hexdigest()
        return alnum[-self.id_length :] if len(alnum) > self.id_length else alnum


@dataclass(frozen=True)
class HermesFormat:
    """``<tool_call>`` blocks amid text (tools.py's native path)."""

    name: str = "hermes"
    keeps_special_tokens: bool = False

    def grammar(
        self, tools: list[T.Tool], choice, parallel: bool, open_args: bool,
        answer: dict | None = None,
    ) -> str:  # fmt: skip
        return hermes_grammar(tools, choice, parallel, open_args, answer)

    def stream(self, answer_names: list[str] | None = None) -> HermesStream:
        return HermesStream()

    def parse(
        self, text: str, answer_names: list[str] | None = None
    ) -> tuple[str | None, list[T.ToolCall]]:
        return T.parse_native(text)

    def messages(self, conversation: list[dict], messages) -> list[dict]:
        return T.native_messages(conversation, messages)


ToolFormat = MarkedFormat | HermesFormat


class WholeAnswer:
    """Llama 3.x's calls (a bare ``{"name", "parameters"}`` object) beside a JSON answer:
    which of the two an answer is shows only at its end (a ``Person`` answer has a "name"
    too), so it is read whole: a call where it is exactly one of a given tool, else content."""

    def __init__(self, fmt: MarkedFormat, names: list[str]) -> None:
        self._fmt, self._names, self._text = fmt, set(names), ""

    def feed(self, text: str) -> list:
        self._text += text
        return []

    def held(self) -> int:  # all of it, until the end
        return len(self._text)

    def finish(self, finish_reason: str) -> list:
        if not self._is_call():  # all of it content, in one delta
            return [*([({"content": self._text}, None)] if self._text else []),
                    ({}, finish_reason)]  # fmt: skip
        stream = self._fmt.stream()
        return stream.feed(self._text) + stream.finish(finish_reason)

    def _is_call(self) -> bool:
        text = self._text.strip()
        text = text.removeprefix(PYTHON_TAG).lstrip()
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return (isinstance(value, dict) and set(value) == {"name", self._fmt.args_key}
                and value["name"] in self._names)  # fmt: skip


def hermes_grammar(
    tools: list[T.Tool],
    choice: T.ToolChoice | None,
    parallel: bool,
    open_args: bool = False,
    answer: dict | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) of ``<tool_call>`` blocks whose JSON is a valid
    call. ``required`` / named: the output is the blocks. ``auto``: free text, until the model
    writes ``<tool_call>``; from there a valid call must follow (``head`` is a lazy lexeme:
    it ends at the first ``<tool_call>``, so text that goes on to the end never holds one).
    With ``answer`` (a response format's schema): that JSON, or blocks from the start."""
    many = parallel and not isinstance(choice, T.NamedToolChoice)
    more = ""  # up to MAX_PARALLEL_CALLS calls, as the envelope's maxItems
    for _ in range(T.MAX_PARALLEL_CALLS - 1 if many else 0):
        more = f' ("\\n<tool_call>" call{more})?'
    schema = {"x-guidance": T.TOOL_JSON_OPTIONS,
              **fix_schema(T.call_schema(tools, None, open_args))}  # fmt: skip
    lines = ['call: "\\n" %json ' + json.dumps(schema) + ' "\\n</tool_call>"']
    if choice in (None, "auto") and answer is not None:  # no text before a call: one lexer
        alone, rules = answer_rule(answer)  # cannot end both a lazy text and a JSON value
        lines += [f'start: {alone} | "<tool_call>" call{more}', *rules]
    elif choice in (None, "auto"):
        lines += [f"start: TEXT | head call{more}", 'head[lazy]: TEXT "<tool_call>"',
                  "TEXT: /(?s:.*)/"]  # fmt: skip
    else:
        lines.append(f'start: "<tool_call>" call{more}')
    return "\n".join(lines)


def answer_rule(answer: dict | None) -> tuple[str, list[str]]:
    """The Lark alternative to calls under ``auto``: free text (``TEXT``), or with a response
    format's schema ``answer`` the JSON it asks for (``answer``, and its rule)."""
    if answer is None:
        return "TEXT", []
    schema = {"x-guidance": T.TOOL_JSON_OPTIONS, **fix_schema(answer)}
    return "answer", ["answer: %json " + json.dumps(schema)]


def _lark_literal(text: str, token_id: int | None) -> str:
    """A marker in llguidance's Lark: its special token by id, else the text."""
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def calls_check(
    fmt: ToolFormat, tools: list[T.Tool], open_args: bool = False, answer: dict | None = None
):
    """The check of a finished answer's calls (or, without calls, of its JSON ``answer``: a
    response format's schema) for the schema keywords their grammar narrows or drops
    (structured/schema_approx.py), or None when no schema uses one; the envelope's JSON
    schema is checked by the output processor itself."""
    schemas = {t.function.name: json.dumps(T.parameters(t, open_args)) for t in tools}
    checked = {name: text for name, text in schemas.items() if needs_final_check(text)}
    own = json.dumps(answer) if answer is not None else None
    own = own if own is not None and needs_final_check(own) else None
    if not checked and own is None:
        return None

    names = [t.function.name for t in tools] if answer is not None else None

    def check(text: str) -> str | None:
        content, calls = fmt.parse(text, names)  # as the answer is read (WholeAnswer)
        if not calls and own is not None:
            return final_check(own, content or "")
        for call in calls:
            schema = checked.get(call.function.name)
            why = schema and final_check(schema, call.function.arguments)
            if why:
                return f"the call of {call.function.name!r}: {why}"
        return None

    return check


def special_id(tokenizer, marker: str) -> int | None:
    """The token id of ``marker`` where the tokenizer has it as one special token."""
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {str(t) for t in added.values() if getattr(t, "special", False)}
    if marker not in special:
        return None
    token_id = tokenizer.convert_tokens_to_ids(marker)
    return token_id if isinstance(token_id, int) else None


def tool_format(tokenizer) -> ToolFormat | None:
    """The format the chat template writes calls in; None: it knows no tools (the envelope)."""
    text = template_text(tokenizer)
    if "tools" not in text:
        return None
    renders = "tool_calls" in text
    if "[TOOL_CALLS]" in text:  # Mistral: an array of calls, or (v11+) name[ARGS]{...} each
        named, ids = "[ARGS]" in text, "[ARGS]" in text and "[CALL_ID]" in text
        return MarkedFormat("mistral", "[TOOL_CALLS]", not named, renders_calls=renders,
                            marker_id=special_id(tokenizer, "[TOOL_CALLS]"), id_length=9,
                            args_marker="[ARGS]" if named else "",
                            args_marker_id=special_id(tokenizer, "[ARGS]") if named else None,
                            id_marker="[CALL_ID]" if ids else "",
                            id_marker_id=special_id(tokenizer, "[CALL_ID]") if ids else None)  # fmt: skip
    if "<|tool_call|>" in text:
        return MarkedFormat("granite", "<|tool_call|>", True, renders_calls=renders,
                            marker_id=special_id(tokenizer, "<|tool_call|>"))  # fmt: skip
    if "<tool_call>" in text:
        return HermesFormat()
    if '"parameters"' in text and "<|eot_id|>" in text:
        return MarkedFormat("llama3", "", False, "parameters", renders_calls=renders)
    return None

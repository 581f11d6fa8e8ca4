"""Streamed tool calls that follow a marker as one JSON value (tool_formats.py): Mistral's
``[TOOL_CALLS][...]`` and Granite's ``<|tool_call|>[...]`` (an array of calls, after text),
and Llama 3.x's ``{"name", "parameters"}`` (one call that is the whole answer, possibly after
``<|python_tag|>``); ``NamedArgsStream``: Mistral's v11+ ``[TOOL_CALLS]name[ARGS]{...}``. The deltas are tool_stream.py's: content until the marker (less the
whitespace before it, a tail that may begin the marker held back), then each call's name and
its arguments' JSON text exactly as generated. JSON after the marker that is not a call is
content again, marker included. ``collect_calls`` turns the events back into one answer,
which is how a whole answer is parsed (so streamed and not streamed agree by construction)."""

from __future__ import annotations

import re

from tinyserve.entrypoints.json_scanner import JsonScanner
from tinyserve.entrypoints.tool_stream import (
    BufferedStream,
    Event,
    _Deltas,
    partial_tag,
    scan_more,
    text_until,
)
from tinyserve.entrypoints.tools import FunctionCall, ToolCall

_WS = " \t\n\r"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it (kept special tokens)
_NAME = re.compile(r"[a-zA-Z0-9_-]*")  # a function name as far as it has come
_CALL_ID = re.compile(r"[a-zA-Z0-9]*")  # a Mistral call id (9 alphanumerics) so far


class MarkedStream(BufferedStream):
    """Text, then a marker, then the calls as one JSON value (or, without a marker, the
    answer itself as one call)."""

    def __init__(self, marker: str, array: bool, args_key: str) -> None:
        self._marker, self._array, self._key = marker, array, args_key
        self._d = _Deltas()
        self._mode = "text" if marker else "start"  # start | text | json | after | raw
        self._buf = ""  # text not yet used
        self._held = ""  # the marker and what followed it: content again if not a call
        self._scan = JsonScanner()

    def held(self) -> int:
        return len(self._buf) + len(self._held)

    def finish(self, finish_reason: str) -> list[Event]:
        if self._mode in ("start", "text", "raw"):
            self._d.content(self._buf)
        self._buf = ""
        return self._d.take(finish_reason, mid_call=self._mode == "json")

    def _step(self) -> bool:
        if self._mode == "raw":
            return self._raw()
        if self._mode == "after":  # text after the calls (not from the grammar): content
            stripped = self._buf.lstrip(_WS)
            self._buf, self._mode = stripped, "raw" if stripped else "after"
            return bool(stripped)
        return {"start": self._start, "text": self._text, "json": self._json}[self._mode]()

    def _start(self) -> bool:
        """No marker: a call is the answer itself, from its first non-blank character."""
        stripped = self._buf.lstrip(_WS)
        if not stripped or (PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
            return False  # blank so far, or perhaps the tag
        if stripped.startswith(PYTHON_TAG):
            self._held, self._buf = (
                self._buf[: -len(stripped)] + PYTHON_TAG,
                stripped[len(PYTHON_TAG) :],
            )
            self._mode = "json"
        elif stripped[0] == "{":
            self._held, self._buf, self._mode = self._buf[: -len(stripped)], stripped, "json"
        else:
            self._mode = "raw"
        return True

    def _text(self) -> bool:
        marker, self._buf = text_until(self._d, self._buf, self._marker)
        if marker is None:
            return False
        self._held, self._mode = marker, "json"
        return True

    def _json(self) -> bool:
        events, used, self._buf = scan_more(self._scan, self._buf, "[" if self._array else "{")
        self._held += used
        if events is None:
            return self._not_a_call()
        for kind, path, piece in events:
            self._event(kind, path, piece)
        if not self._scan.done:
            return False
        if not self._array:
            self._d.call_done(0)
        if not self._d.is_named(0):
            return self._not_a_call()
        self._mode = "after"
        return True

    def _event(self, kind: str, path: tuple, piece: str) -> None:
        if self._array:
            if not path or not isinstance(path[0], int):
                return
            index, rest = path[0], path[1:]
        else:
            index, rest = 0, path
        if rest == ("name",) and kind == "str":
            self._d.name_piece(index, piece)
        elif rest == ("name",) and kind == "end" and piece == '"':
            self._d.named(index)
        elif rest[:1] == (self._key,) and kind == "raw":
            self._d.arguments(index, piece)
        elif self._array and rest == () and kind == "end":
            self._d.call_done(index)

    def _not_a_call(self) -> bool:
        self._mode = "raw"
        self._buf, self._held = self._held + self._buf, ""
        return True


class NamedArgsStream(MarkedStream):
    """``MARKER name ARGS {arguments}`` per call (Mistral's v11+ templates): content until the
    first marker, then calls back to back. With ``id_marker`` (Mistral Small 3.2) a call may
    carry the model's id, ``name ID_MARKER id ARGS``; the call keeps the server's own id, as
    every other call does (a model may repeat an id from the conversation)."""

    def __init__(self, marker: str, args_marker: str, id_marker: str = "") -> None:
        super().__init__(marker, False, "")
        self._args_marker, self._id_marker = args_marker, id_marker
        self._calls = 0
        self._pending = ""  # the name read, until its arguments open

    def finish(self, finish_reason: str) -> list[Event]:
        mid_call = self._mode in ("name", "json")
        if self._mode in ("text", "raw"):
            self._d.content(self._buf)
        self._buf = ""
        return self._d.take(finish_reason, mid_call=mid_call)

    def _step(self) -> bool:
        if self._mode == "raw":
            return self._raw()
        if self._mode == "text":
            marker, self._buf = text_until(self._d, self._buf, self._marker)
            if marker is not None:
                self._held, self._mode = marker, "name"
            return marker is not None
        return {"name": self._name, "json": self._args, "after": self._next}[self._mode]()

    def _name(self) -> bool:
        at = self._buf.find(self._args_marker)
        if at < 0:
            head = self._buf[: len(self._buf) - partial_tag(self._buf, self._args_marker)]
            return False if self._head_name(head, False) is not None else self._not_a_call()
        name = self._head_name(self._buf[:at], True)
        if not name:
            return self._not_a_call()
        self._pending = name  # named once its arguments open
        self._held += self._buf[: at + len(self._args_marker)]
        self._buf = self._buf[at + len(self._args_marker) :]
        self._mode, self._scan = "json", JsonScanner()
        return True

    def _head_name(self, head: str, whole: bool) -> str | None:
        """The function name in ``head`` (what came between the marker and ARGS, perhaps with
        an id) as far as it has come; None where it cannot be a call's."""
        name, call_id = head, ""
        if self._id_marker and self._id_marker in head:
            name, _, call_id = head.partition(self._id_marker)
            if not _CALL_ID.fullmatch(call_id) or (whole and not call_id):
                return None
        elif self._id_marker and not whole:  # the id's marker may be arriving
            name = head[: len(head) - partial_tag(head, self._id_marker)]
        return name if _NAME.fullmatch(name) else None

    def _args(self) -> bool:
        events, used, self._buf = scan_more(self._scan, self._buf, "{")
        self._held += used
        if events is None:
            return self._not_a_call()
        if self._scan.started and not self._d.is_named(self._calls):  # the arguments opened
            self._d.name_piece(self._calls, self._pending)
            self._d.named(self._calls)
        for kind, _, piece in events:
            if kind == "raw":
                self._d.arguments(self._calls, piece)
        if self._scan.done:
            self._d.call_done(self._calls)
            self._calls += 1
            self._mode, self._held = "after", ""
        return self._scan.done

    def _next(self) -> bool:
        """After a call: the next one's marker, or text (not from the grammar): content."""
        stripped = self._buf.lstrip(_WS)
        if stripped.startswith(self._marker):
            self._held, self._buf = self._marker, stripped[len(self._marker) :]
            self._mode = "name"
            return True
        if stripped and not self._marker.startswith(stripped):
            self._buf, self._mode = stripped, "raw"
            return True
        return False


def collect_calls(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """A choice's streamed events as one answer: (content or None, calls)."""
    content, calls = None, {}
    for delta, _ in events:
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for e in delta.get("tool_calls") or []:
            fn = e.get("function") or {}
            if e.get("id") is not None:
                calls[e["index"]] = ToolCall(id=e["id"], function=FunctionCall(
                    name=fn.get("name") or "", arguments=fn.get("arguments") or ""))  # fmt: skip
            elif e["index"] in calls:
                calls[e["index"]].function.arguments += fn.get("arguments") or ""
    # No calls: the content, "" when empty (as a stop string at the start gives without tools)
    return content if content is not None or calls else "", [calls[i] for i in sorted(calls)]

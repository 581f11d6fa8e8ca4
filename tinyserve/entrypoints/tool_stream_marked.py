"""Streamed tool calls that follow a marker as one JSON value (tool_formats.py): Mistral's
``[TOOL_CALLS][...]`` and Granite's ``<|tool_call|>[...]`` (an array of calls, after text),
and Llama 3.x's ``{"name", "parameters"}`` (one call that is the whole answer, possibly after
``<|python_tag|>``). The deltas are tool_stream.py's: content until the marker (less the
whitespace before it, a tail that may begin the marker held back), then each call's name and
its arguments' JSON text exactly as generated. JSON after the marker that is not a call is
content again, marker included. ``collect_calls`` turns the events back into one answer,
which is how a whole answer is parsed (so streamed and not streamed agree by construction)."""

from __future__ import annotations

from tinyserve.entrypoints.tool_stream import Event, JsonScanner, _Deltas, text_until
from tinyserve.entrypoints.tools import FunctionCall, ToolCall

_WS = " \t\n\r"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it (kept special tokens)


class MarkedStream:
    def __init__(self, marker: str, array: bool, args_key: str) -> None:
        self._marker, self._array, self._key = marker, array, args_key
        self._d = _Deltas()
        self._mode = "text" if marker else "start"  # start | text | json | after | raw
        self._buf = ""  # text not yet used
        self._held = ""  # the marker and what followed it: content again if not a call
        self._scan = JsonScanner()

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf and self._step():
            pass
        return self._d.take()

    def finish(self, finish_reason: str) -> list[Event]:
        if self._mode in ("start", "text", "raw"):
            self._d.content(self._buf)
        self._buf = ""
        return self._d.take(finish_reason, mid_call=self._mode == "json")

    def _step(self) -> bool:
        """Use what ``_buf`` allows; False when it must wait for more text."""
        if self._mode == "raw":
            self._d.content(self._buf)
            self._buf = ""
            return False
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
        if not self._scan.started:
            stripped = self._buf.lstrip(_WS)
            self._held += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            if not stripped:
                return False
            if stripped[0] != ("[" if self._array else "{"):
                return self._not_a_call()
        events, used = self._scan.feed(self._buf)
        self._held += self._buf[:used]
        self._buf = self._buf[used:]
        for kind, path, piece in events:
            self._event(kind, path, piece)
        if self._scan.error:
            return self._not_a_call()
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
    return content, [calls[i] for i in sorted(calls)]

"""An incremental JSON reader (tool_stream.py's streamed tool calls): one value, a piece at a
time, with events for each character of the value it belongs to, decoded string text and
complete values. Torch-free."""

from __future__ import annotations

import json

_WS = " \t\n\r"

_LITERAL = frozenset("0123456789+-.eEtrufalsnNIiy")  # numbers, true/false/null, NaN/Infinity


class JsonScanner:
    """One JSON value read a piece at a time. ``feed(text)`` returns events and how many
    characters of ``text`` it used (it stops at the end of the value or at an error):

    * ``("raw", path, ch)``: a character of the innermost value at ``path`` (a container's
      brackets, keys and inner whitespace are its own; whitespace around a member is not);
    * ``("str", path, text)``: decoded text of the string value at ``path``;
    * ``("end", path, first)``: the value at ``path`` is complete (``first``: its first char).

    A path is the keys and indexes from the top value, ``()`` for the top value itself."""

    def __init__(self) -> None:
        self.started = self.done = self.error = False
        self._path: list[str | int] = []  # the member being read in each open container
        self._stack: list[str] = []  # the open containers' brackets
        self._mode = "value"  # value | key | key_string | colon | string | literal | after
        self._first = ""  # the first character of the scalar being read
        self._key_text = ""
        self._esc = ""  # an escape not yet complete
        self._events: list[tuple[str, tuple, str]] = []

    @property
    def pending_escape(self) -> bool:
        """An escape begun and not complete (its character not yet given)."""
        return bool(self._esc)

    def feed(self, text: str) -> tuple[list[tuple[str, tuple, str]], int]:
        self._events, used = [], 0
        for ch in text:
            if self.done or self.error:
                break
            try:
                if self._mode == "literal" and ch not in _LITERAL:
                    self._end_value()
                    if self.done:
                        break
                getattr(self, "_" + self._mode)(ch)
            except ValueError:  # a bad escape or an unexpected character
                self.error = True
                break
            used += 1
        return self._events, used

    def _here(self) -> tuple:
        """The path of the innermost open container."""
        return tuple(self._path[: len(self._stack) - 1])

    def _raw(self, path: tuple, ch: str) -> None:
        self._events.append(("raw", path, ch))

    def _value(self, ch: str) -> None:
        if ch in _WS:
            if self._stack:
                self._raw(self._here(), ch)
            return
        if ch == "]" and self._stack and self._stack[-1] == "[":  # [] (or a trailing comma)
            self._path.pop()
            return self._close(ch)
        self.started = True
        self._raw(tuple(self._path), ch)
        if ch in "{[":
            self._stack.append(ch)
            self._path += [0] if ch == "[" else []
            self._mode = "value" if ch == "[" else "key"
            return
        if ch != '"' and ch not in _LITERAL:
            raise ValueError(ch)
        self._first, self._mode = ch, "string" if ch == '"' else "literal"

    def _key(self, ch: str) -> None:
        if ch == "}":
            return self._close(ch)
        if ch not in _WS and ch != '"':
            raise ValueError(ch)
        self._raw(tuple(self._path), ch)
        if ch == '"':
            self._key_text, self._mode = "", "key_string"

    def _key_string(self, ch: str) -> None:
        self._raw(tuple(self._path), ch)
        text, ended = self._string_char(ch)
        self._key_text += text
        if ended:
            self._mode = "colon"

    def _colon(self, ch: str) -> None:
        if ch not in _WS and ch != ":":
            raise ValueError(ch)
        self._raw(tuple(self._path), ch)
        if ch == ":":
            self._path.append(self._key_text)
            self._mode = "value"

    def _string(self, ch: str) -> None:
        path = tuple(self._path)
        self._raw(path, ch)
        text, ended = self._string_char(ch)
        if text:
            self._events.append(("str", path, text))
        if ended:
            self._end_value()

    def _literal(self, ch: str) -> None:
        self._raw(tuple(self._path), ch)

    def _after(self, ch: str) -> None:
        if ch in _WS:
            return self._raw(self._here(), ch)
        if ch == ",":
            self._raw(self._here(), ch)
            if self._stack[-1] == "{":
                self._path.pop()
                self._mode = "key"
            else:
                self._path[-1] += 1  # type: ignore[operator]
                self._mode = "value"
            return
        self._path.pop()
        self._close(ch)

    def _close(self, ch: str) -> None:
        opener = {"}": "{", "]": "["}.get(ch)
        if opener is None or opener != self._stack[-1]:
            raise ValueError(ch)
        path = tuple(self._path)
        self._raw(path, ch)
        self._stack.pop()
        self._first = opener
        self._end_value()

    def _end_value(self) -> None:
        self._events.append(("end", tuple(self._path), self._first))
        self._mode = "after"
        self.done = not self._stack

    def _string_char(self, ch: str) -> tuple[str, bool]:
        """(decoded text, string ended) for one character of a string's source."""
        if not self._esc:
            if ch == '"':
                return "", True
            if ch == "\\":
                self._esc = ch
                return "", False
            return ch, False
        esc = self._esc = self._esc + ch
        n = len(esc)
        if (n == 2 and ch != "u") or (n == 8 and ch != "u"):
            return self._unescape(), False
        if n == 6 and not _high(esc):
            return self._unescape(), False
        if n == 12:  # a high surrogate, then \uXXXX: a pair, or the second one stands alone
            if 0xDC00 <= int(esc[8:12], 16) < 0xE000:
                return self._unescape(), False
            self._esc = esc[:6]
            text, self._esc = self._unescape(), esc[6:]
            return (text, False) if _high(self._esc) else (text + self._unescape(), False)
        if n == 7 and ch != "\\":  # a lone high surrogate, then an ordinary character
            self._esc = esc[:6]
            text = self._unescape()
            more, ended = self._string_char(ch)
            return text + more, ended
        return "", False

    def _unescape(self) -> str:
        text = json.loads('"' + self._esc + '"')
        self._esc = ""
        return text


def _high(escape: str) -> bool:
    """``escape`` (``\\uXXXX``) is a UTF-16 high surrogate (the first of a pair)."""
    return 0xD800 <= int(escape[2:6], 16) < 0xDC00

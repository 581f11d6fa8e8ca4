"""Streamed tool calls: a choice's text deltas in, OpenAI chat-chunk deltas out, as the text is
generated (torch-free; the non-streamed parsers are ``tools.parse_output`` / ``parse_native``,
and the two agree on every output: tests/entrypoints/test_tools_stream.py).

Content streams until a call begins; each call then gets a first delta with ``index``,
``id``, ``type``, ``function.name`` and ``arguments: ""`` (sent once its name is complete),
then ``function.arguments`` fragments: the arguments' JSON text exactly as generated, so the
fragments add up to the non-streamed ``arguments``. ``finish`` ends the choice: ``stop`` with
calls becomes ``tool_calls``; ``length`` (or a stop string mid-call, finishing ``stop``) keeps
what was sent, and the non-streamed answer is read the same (serving.answer_tools).

``EnvelopeStream`` reads the JSON envelope (``{"content": "..."}``: the string decoded as it
comes; ``{"tool_calls": [...]}``), ``HermesStream`` ``<tool_call>`` blocks amid text, holding
back a tail that may begin the tag (and whitespace next to a block, which is not content).
"""

from __future__ import annotations

from tinyserve.engine.detokenizer import find_stop
from tinyserve.entrypoints.json_scanner import JsonScanner
from tinyserve.entrypoints.tools import new_call_id

Event = tuple[dict, str | None]  # (delta, finish_reason)
_TAG, _END_TAG = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"


class _Deltas:
    """The deltas of one choice: content merged, arguments held until their call is named."""

    def __init__(self) -> None:
        self._out: list[dict] = []
        self._names: dict[int, str] = {}
        self._named: set[int] = set()
        self._held_args: dict[int, str] = {}
        self._sent_args: set[int] = set()

    def content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def name_piece(self, index: int, text: str) -> None:
        self._names[index] = self._names.get(index, "") + text

    def named(self, index: int) -> None:
        if index in self._named:
            return
        self._named.add(index)
        function = {"name": self._names.get(index, ""), "arguments": ""}
        first = {"index": index, "id": new_call_id(), "type": "function", "function": function}
        self._out.append({"tool_calls": [first]})
        self.arguments(index, self._held_args.pop(index, ""))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if index not in self._named:
            self._held_args[index] = self._held_args.get(index, "") + text
            return
        self._sent_args.add(index)
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else {}
        if last.get("index") == index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def is_named(self, index: int) -> bool:
        return index in self._named

    def call_done(self, index: int) -> None:
        """A complete call without arguments gets ``{}`` (as the non-streamed parse does)."""
        if index in self._named and index not in self._sent_args:
            self.arguments(index, "{}")

    def take(self, finish_reason: str | None = None, mid_call: bool = False) -> list[Event]:
        """The deltas so far; with ``finish_reason``, then the finish event (``stop`` after
        calls is ``tool_calls``, but not cut mid-call by a stop string)."""
        events: list[Event] = [(d, None) for d in self._out]
        self._out = []
        if finish_reason is not None:
            called = finish_reason == "stop" and bool(self._named) and not mid_call
            events.append(({}, "tool_calls" if called else finish_reason))
        return events


class BufferedStream:
    """A choice's parser over a buffer of text not yet used: ``_step`` uses what it allows
    and says whether to go on (False: wait for more text)."""

    _d: _Deltas
    _buf: str

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf and self._step():
            pass
        return self._d.take()

    def _step(self) -> bool:
        raise NotImplementedError

    def held(self) -> int:
        """At most how many characters of content the text fed so far still holds back."""
        return len(self._buf)

    def _raw(self) -> bool:
        """Not a call after all: the rest is content as it comes."""
        self._d.content(self._buf)
        self._buf = ""
        return False


class EnvelopeStream:
    """``{"content": "..."}`` or ``{"tool_calls": [{"name", "arguments"}, ...]}``; with
    ``json_answer`` (a response format beside the tools), the content is the JSON text of
    ``{"content": <a JSON value>}`` as generated."""

    def __init__(self, json_answer: bool = False) -> None:
        self._scan = JsonScanner()
        self._d = _Deltas()
        self._json_answer = json_answer

    def feed(self, text: str) -> list[Event]:
        events, _ = self._scan.feed(text)
        for kind, path, piece in events:
            if path[:1] == ("content",) and self._json_answer:
                if kind == "raw":
                    self._d.content(piece)
            elif path[:1] == ("content",) and kind == "str" and len(path) == 1:
                self._d.content(piece)
            elif len(path) >= 3 and path[0] == "tool_calls" and isinstance(path[1], int):
                index, field = path[1], path[2]
                if field == "name" and len(path) == 3:
                    if kind == "str":
                        self._d.name_piece(index, piece)
                    elif kind == "end" and piece == '"':
                        self._d.named(index)
                elif field == "arguments" and kind == "raw":
                    self._d.arguments(index, piece)
            elif len(path) == 2 and path[0] == "tool_calls" and kind == "end":
                self._d.call_done(path[1])
        return self._d.take()

    def finish(self, finish_reason: str) -> list[Event]:
        return self._d.take(finish_reason, mid_call=not self._scan.done)

    def held(self) -> int:
        """An escape not yet complete: one character of content at most."""
        return 1 if self._scan.pending_escape else 0


class HermesStream(BufferedStream):
    """Text with ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>`` blocks."""

    def __init__(self) -> None:
        self._d = _Deltas()
        self._mode = "text"  # text | call | close | raw (a block that is not a call)
        self._buf = ""  # text not yet sent: a possible tag prefix, whitespace, a closing tag
        self._block = ""  # the current block's text, sent as content if it is not a call
        self._calls = 0
        self._after_block = False  # whitespace after a block is not content
        self._scan = JsonScanner()

    def finish(self, finish_reason: str) -> list[Event]:
        if self._mode in ("text", "raw"):
            self._d.content(self._buf.lstrip(_WS) if self._after_block else self._buf)
            self._buf = ""
        return self._d.take(finish_reason, mid_call=self._mode in ("call", "close"))

    def _step(self) -> bool:
        if self._mode == "raw":
            return self._raw()
        if self._mode == "text":
            return self._text()
        if self._mode == "call":
            return self._call()
        return self._close()

    def _text(self) -> bool:
        if self._after_block:
            self._buf = self._buf.lstrip(_WS)
            if not self._buf:
                return False
            self._after_block = False
        tag, self._buf = text_until(self._d, self._buf, _TAG)
        if tag is None:
            return False
        self._block = tag
        self._mode, self._scan = "call", JsonScanner()
        return True

    def _call(self) -> bool:
        events, used, self._buf = scan_more(self._scan, self._buf, "{")
        self._block += used
        if events is None:
            return self._not_a_call()
        for kind, path, piece in events:
            if path == ("name",) and kind == "str":
                self._d.name_piece(self._calls, piece)
            elif path == ("name",) and kind == "end" and piece == '"':
                self._d.named(self._calls)
            elif path[:1] == ("arguments",) and kind == "raw":
                self._d.arguments(self._calls, piece)
        if self._scan.done and not self._d.is_named(self._calls):
            return self._not_a_call()
        if self._scan.done:
            self._mode = "close"
            return True
        return False

    def _close(self) -> bool:
        stripped = self._buf.lstrip(_WS)
        if len(stripped) < len(_END_TAG) and _END_TAG.startswith(stripped):
            return False  # more may come
        if not stripped.startswith(_END_TAG):
            return self._not_a_call()
        self._d.call_done(self._calls)
        self._calls += 1
        self._buf = stripped[len(_END_TAG) :]
        self._mode, self._after_block = "text", True
        return True

    def _not_a_call(self) -> bool:
        self._mode = "raw"
        self._buf = self._block + self._buf
        return True


def scan_more(scan: JsonScanner, buf: str, openers: str) -> tuple[list | None, str, str]:
    """Feed ``buf`` to ``scan``, whose value must open (after blanks) with one of ``openers``.
    Returns (the events, or None when the text cannot be that value; the text used; the
    text left)."""
    blanks = ""
    if not scan.started:
        stripped = buf.lstrip(_WS)
        blanks, buf = buf[: len(buf) - len(stripped)], stripped
        if stripped and stripped[0] not in openers:
            return None, blanks, buf
    events, used = scan.feed(buf)
    return (None if scan.error else events), blanks + buf[:used], buf[used:]


def text_until(d: _Deltas, buf: str, tag: str) -> tuple[str | None, str]:
    """Send ``buf`` to ``d`` as content up to ``tag``, less the whitespace just before it;
    without the tag, hold back a tail that may begin it (and whitespace before that). Returns
    (that whitespace and the tag, or None when the tag is not in ``buf``; the text left)."""
    at = buf.find(tag)
    if at >= 0:
        before = buf[:at]
        d.content(before.rstrip(_WS))
        return before[len(before.rstrip(_WS)) :] + tag, buf[at + len(tag) :]
    keep = partial_tag(buf, tag)
    keep = len(buf) - len(buf[: len(buf) - keep].rstrip(_WS))
    d.content(buf[: len(buf) - keep])
    return None, buf[len(buf) - keep :]


def partial_tag(text: str, tag: str = _TAG) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class StopAtText:
    """Stop strings over what the client sees of an answer with tools (its text), not the
    raw output: there they matched the wrapper (``{"content": "``, the closing ``"}``, a
    call's JSON), so ``"`` ended every envelope answer before its first word and ``}`` a
    complete one. Wraps a choice's parser: content is held back while a stop string may
    begin in it, cut where one ends it (kept with ``include``), then the choice finishes
    (``stop``; ``stop_reason`` the string); a call's deltas pass as they are. The request
    is then aborted (Job.answered for a stream, ``AllStopped`` for a whole answer). Text fed
    with ``armed`` false (the first min_tokens output tokens': StepOutput.armed_from)
    passes unmatched and unheld, as the detokenizer treats it without tools — also the
    content the inner parser held back from it and gives later (its ``held()``: an upper
    bound, so a stop string just past min_tokens may go unseen, never one before it)."""

    def __init__(self, inner, stops, include: bool = False) -> None:
        self.inner, self.stops, self.include = inner, list(stops), include
        self._holdback = max(len(s) for s in self.stops) - 1
        self._held = ""
        self._free = 0  # characters of content still to come from text fed unarmed
        self._called = False  # a call has begun: a stop in later text ends with tool_calls
        self.stop_reason: str | None = None

    def feed(self, text: str, armed: bool = True) -> list[Event]:
        if self.stop_reason is not None:
            return []
        out = self._filter(self.inner.feed(text), armed)
        held = getattr(self.inner, "held", lambda: 0)()
        # Unarmed: all it holds came before min_tokens. Armed: held text that never became
        # content (whitespace before a call) leaves the budget, not skipping later content.
        self._free = held if not armed else min(self._free, held)
        return out

    def finish(self, finish_reason: str) -> list[Event]:
        if self.stop_reason is not None:
            return []
        return self._filter(self.inner.finish(finish_reason))

    def _filter(self, events: list[Event], armed: bool = True) -> list[Event]:
        out: list[Event] = []
        for delta, finish_reason in events:
            if set(delta) != {"content"} or finish_reason is not None or not armed:
                if self._held:  # anything else ends the text a stop string could span
                    out.append(({"content": self._held}, None))
                    self._held = ""
                self._called = self._called or "tool_calls" in delta
                out.append((delta, finish_reason))
                continue
            text, free = delta["content"], min(self._free, len(delta["content"]))
            if free:  # given now, fed before min_tokens: unmatched
                out.append(({"content": text[:free]}, None))
                self._free, text = self._free - free, text[free:]
            self._held += text
            hit = find_stop(self._held, self.stops)
            if hit is not None:
                i, stop = hit
                text = self._held[: i + len(stop) if self.include else i]
                out += [({"content": text}, None)] if text else []
                self.stop_reason, self._held = stop, ""
                return out + [({}, "tool_calls" if self._called else "stop")]
            keep = max(len(self._held) - self._holdback, 0)
            if keep:
                out.append(({"content": self._held[:keep]}, None))
                self._held = self._held[keep:]
        return out


def feed(parser, text: str, unarmed: int = 0) -> list[Event]:
    """``parser.feed(text)``; behind stop strings (StopAtText) the first ``unarmed``
    characters are text where they do not count yet (min_tokens: unarmed_chars)."""
    if not isinstance(parser, StopAtText) or unarmed <= 0:
        return parser.feed(text)
    head = parser.feed(text[:unarmed], armed=False)
    return head + parser.feed(text[unarmed:]) if unarmed < len(text) else head


def unarmed_chars(out, text: str | None = None) -> int:
    """How many leading characters of a step's text (``out.text_delta``, or ``text``: what a
    reasoning splitter made of it) come before stop strings count (StepOutput.armed_from)."""
    if text is None or text == out.text_delta:
        return len(out.text_delta) if out.armed_from is None else out.armed_from
    return 0 if out.armed_from == 0 else len(text)  # a split step: all of it, to be safe


def feed_step(parser, out, text: str | None = None) -> tuple[list[Event], int | None]:
    """A step's text (``out.text_delta``, or ``text``: a reasoning splitter's part of it)
    through ``feed`` -> (events, how many of the step's tokens its text stop took: the
    tokens up to the one that completed it, where this feed met it; else None). A step of
    several tokens (StepOutput.token_ends) is fed a token at a time, so that the count (the
    usage, the logprobs) ends where the text does, as the detokenizer's stop strings do."""
    text = out.text_delta if text is None else text
    unarmed = unarmed_chars(out, text)
    if not isinstance(parser, StopAtText) or parser.stop_reason is not None:
        return feed(parser, text, unarmed), None  # no stops, or met before this step
    exact = out.token_ends if text == out.text_delta else None  # (ends at len(text))
    events, start = [], 0
    for j, end in enumerate(exact or [len(text)]):
        events += feed(parser, text[start:end], min(max(unarmed - start, 0), end - start))
        start = end
        if parser.stop_reason is not None:
            return events, j + 1 if exact else len(out.new_token_ids)
    return events, None


def visible_stop(parser) -> str | None:
    """The stop string that ended a choice's text (StopAtText), or None."""
    return parser.stop_reason if isinstance(parser, StopAtText) else None


class AllStopped:
    """``answered(out)`` for a non-streamed answer (streaming.collect): each choice's text
    through its own parser from ``make()`` (a StopAtText), True once all ``choices`` have
    met a stop string, so that the request is aborted there; ``stopped(index)``: that
    choice's text has met one (what it generates after is not its answer)."""

    def __init__(self, make, choices: int) -> None:
        self._make, self._choices = make, choices
        self._parsers: dict[int, StopAtText] = {}
        self.used: dict[int, int] = {}  # choice -> the tokens of its stopping step it took

    def stopped(self, index: int) -> bool:
        parser = self._parsers.get(index)
        return parser is not None and visible_stop(parser) is not None

    def __call__(self, out) -> bool:
        parser = self._parsers.get(out.index) or self._parsers.setdefault(out.index, self._make())
        _, used = feed_step(parser, out)
        if used is not None:
            self.used[out.index] = used
        parsers = self._parsers.values()
        return len(parsers) == self._choices and all(map(visible_stop, parsers))

"""A client's side of server-sent events over httpx streaming responses."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator


def sse_data(line: str) -> str | None:
    """The payload of a ``data:`` line (one leading space dropped), or None for any other."""
    if not line.startswith("data:"):
        return None
    return line[6:] if line.startswith("data: ") else line[5:]


def iter_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data:`` payloads of lines (``response.iter_lines()``), ``[DONE]`` included."""
    for line in lines:
        data = sse_data(line)
        if data is not None:
            yield data


async def aiter_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """:func:`iter_data` over ``response.aiter_lines()``."""
    async for line in lines:
        data = sse_data(line)
        if data is not None:
            yield data


def sse_events(response) -> list[str]:
    """The ``data:`` payloads of a whole SSE response, checking the framing on the way: one
    ``data: `` line per event, events ended by a blank line, comments (pings) skipped."""
    events, lines = [], []
    for line in response.iter_lines():
        if line == "":
            if lines:
                assert len(lines) == 1, lines
                assert lines[0].startswith("data: "), lines
                events.append(lines[0][len("data: ") :])
            lines = []
        elif line.startswith(":"):
            continue  # SSE comment (keep-alive ping)
        else:
            lines.append(line)
    assert not lines, f"unterminated event: {lines}"
    return events

"""ResponseBuilder without a model: chat deltas (tool_stream.py's parsers) in, typed events
out, each valid for the official SDK, and the same items streamed or built at once."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import TypeAdapter

from tinyserve.entrypoints.protocol_responses import ResponseObject
from tinyserve.entrypoints.responses_stream import ResponseBuilder
from tinyserve.entrypoints.tool_stream import EnvelopeStream, HermesStream
from tinyserve.entrypoints.tools import parse_native, parse_output
from tinyserve.outputs import Usage

EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES = f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\nDone."
ENVELOPE = '{"tool_calls": [' + CALL + ', {"name": "get_time", "arguments": {}}]}'


def _builder() -> ResponseBuilder:
    return ResponseBuilder(ResponseObject(id="resp_1", model="m"))


def _streamed(parser, text: str, finish: str, piece: int = 3) -> tuple[ResponseBuilder, list]:
    """``text`` fed in pieces of ``piece`` characters (all at once: the non-streamed path)."""
    b = _builder()
    events = b.start()
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for n, piece in enumerate(pieces):
        deltas = parser.feed(piece) + (parser.finish(finish) if n == len(pieces) - 1 else [])
        for delta, _ in deltas:
            events += b.chat_delta(delta)
    events += b.finish(finish, Usage(prompt_tokens=5, completion_tokens=7))
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return b, events


def _parsed(b: ResponseBuilder) -> tuple[str | None, list[tuple[str, str]]]:
    """The builder's items as the chat path's parse: (content, [(name, arguments)])."""
    texts = [i.content[0].text for i in b.response.output if i.type == "message"]
    calls = [(i.name, i.arguments) for i in b.response.output if i.type == "function_call"]
    return "".join(texts) or None, calls


def _shape(b: ResponseBuilder) -> list[tuple]:
    """The items without their generated ids."""
    return [(i.type, i.status, getattr(i, "name", None), getattr(i, "arguments", None),
             [c.text for c in getattr(i, "content", [])]) for i in b.response.output]  # fmt: skip


@pytest.mark.parametrize("parser, parse, text", [(HermesStream, parse_native, HERMES),
                                                 (EnvelopeStream, parse_output, ENVELOPE)])  # fmt: skip
def test_streamed_items_equal_the_parsed_ones(parser, parse, text):
    b, events = _streamed(parser(), text, "stop", piece=3)
    assert _shape(b) == _shape(_streamed(parser(), text, "stop", piece=len(text))[0])
    content, calls = parse(text)
    assert _parsed(b) == (content, [(c.function.name, c.function.arguments) for c in calls])
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == [item.model_dump() for item in b.response.output]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(b.response.output))) and len(added) >= 2
    for item in b.response.output:
        if item.type == "function_call":
            args = [e["delta"] for e in events if e["type"].endswith("arguments.delta")
                    and e["item_id"] == item.id]  # fmt: skip
            assert "".join(args) == item.arguments and json.loads(item.arguments) is not None
    final = openai.types.responses.Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.usage.total_tokens == 12


def test_cut_mid_call_is_incomplete():
    b, events = _streamed(HermesStream(), HERMES[:66], "length")
    assert b.response.status == "incomplete"
    assert b.response.incomplete_details.reason == "max_output_tokens"
    assert [i.status for i in b.response.output] == ["completed", "incomplete"]
    assert events[-1]["type"] == "response.incomplete"


def test_no_output_is_one_empty_message():
    b = _builder()
    events = b.start() + b.finish("stop", None)
    for e in events:
        EVENT.validate_python(e)
    assert [i.content[0].text for i in b.response.output] == [""]
    assert events[-1]["response"]["usage"]["total_tokens"] == 0

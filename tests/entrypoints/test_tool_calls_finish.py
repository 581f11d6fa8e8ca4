"""Forced tool calls that finish (issue 39 item 6): a call's arguments hold the declared
properties only unless the schema allows others (OpenAI's strict semantics; the server's
--open-tool-arguments relaxes it), the JSON is written on one line, and a forced call cut by
max_tokens still comes back in tool_calls with finish_reason "length", the same streamed
or not. benchmarks/bench_tool_calls.py measures the finish rate over 100 prompts."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.api import MODEL, accumulate, non_streamed
from tinyserve.entrypoints import tools as T
from tinyserve.structured.strict import closed_objects

# A plain weather tool as clients write it: no additionalProperties, one required property.
PLAIN = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}  # fmt: skip
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo"]
ASKS = ["What's the weather in {}?", "Is it raining in {} now?", "How hot is it in {} today?",
        "Weather report for {}, please."]  # fmt: skip


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as c:
        yield c


def test_closed_objects_closes_what_the_schema_leaves_open():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
            "pat": {"type": "object", "properties": {"y": {}}, "patternProperties": {"^z": {}}},
            "free": {"type": "object"},
            "list": {"type": "array", "items": {"properties": {"c": {}}}},
            "alt": {"anyOf": [{"properties": {"d": {}}}, {"type": "null"}]},
        },
        "$defs": {"D": {"type": "object", "properties": {"e": {}}}},
    }
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before  # the client's schema is not touched
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert (
        "additionalProperties" not in props["pat"] and "additionalProperties" not in props["free"]
    )
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["alt"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    tool = T.Tool.model_validate(PLAIN)
    open_call = T.call_schema([tool], None, open_args=True)
    assert "additionalProperties" not in open_call["properties"]["arguments"]


def test_forced_calls_finish_on_one_line_with_declared_properties(oai):
    finished = 0
    prompts = [a.format(c) for a in ASKS for c in CITIES]
    for i, p in enumerate(prompts):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], tools=[PLAIN],
            tool_choice="required", max_tokens=200, temperature=0.7, seed=i,
        )  # fmt: skip
        c = r.choices[0]
        calls = c.message.tool_calls  # finished or cut: calls, never JSON in content
        assert calls and c.message.content is None
        assert all(call.function.name == "get_weather" for call in calls)
        assert all("\n" not in call.function.arguments for call in calls)
        if c.finish_reason == "length":
            continue
        finished += 1
        assert c.finish_reason == "tool_calls"
        for call in calls:
            args = json.loads(call.function.arguments)
            assert set(args) <= {"location", "unit"} and "location" in args
    assert finished >= 18, f"{finished} of {len(prompts)} forced calls finished"


def test_a_cut_forced_call_is_a_call_streamed_or_not(oai):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=[PLAIN], tool_choice="required", max_tokens=24, temperature=0)  # fmt: skip
    content, calls, finish = non_streamed(oai, **request)
    assert finish == "length" and content is None
    ((name, arguments),) = calls
    assert name == "get_weather" and arguments.startswith("{")
    s_content, s_calls, s_finish, _ = accumulate(oai, **request)
    assert (s_content, s_calls, s_finish) == (content, calls, finish)

"""/v1/responses (stateless) with the official SDK on the real server (SmolLM2): answers equal
the chat path's for the same greedy request (text, usage, a tool round trip), the SDK's stream
helper, the raw typed-event order, function calls, text.format JSON schemas, incomplete
responses, the 400s, and aborts that leave the engine idle with its KV blocks free."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, TypeAdapter

from tests.support.api import MODEL
from tests.support.api import WEATHER as CHAT_WEATHER
from tinyserve.testing.server import wait_until

ASK = "Name three colors."
# The chat tests' tool, in the Responses API's flat form.
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)
RESPONSE = openai.types.responses.Response


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as c:
        yield c


def _idle(server) -> bool:
    s = server.async_engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


def _chat(oai, messages, max_tokens, **kwargs):
    return oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def _same_as_chat(r, chat) -> None:
    """The response carries the chat completion's text, usage and finish."""
    choice = chat.choices[0]
    assert r.output_text == choice.message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    cached = chat.usage.prompt_tokens_details.cached_tokens
    assert r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens
    assert cached <= chat.usage.prompt_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    want = "incomplete" if choice.finish_reason == "length" else "completed"
    assert r.status == want and r.output[0].status == want


def test_string_input_equals_chat(oai):
    r = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=16, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.temperature == 0 and r.top_p == 1.0  # the settings that sampled, defaults too
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    _same_as_chat(r, _chat(oai, [{"role": "user", "content": ASK}], 16))


def test_message_items_with_instructions_equal_chat(oai):
    items = [
        {"role": "user", "content": "Hi!"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello! How can I help?"}]},
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]  # fmt: skip
    r = oai.responses.create(model=MODEL, input=items, instructions="Be brief.",
                             max_output_tokens=12, temperature=0, store=False)  # fmt: skip
    assert r.instructions == "Be brief." and r.store is False
    messages = [{"role": "system", "content": "Be brief."}, items[0],
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": ASK}]  # fmt: skip
    _same_as_chat(r, _chat(oai, messages, 12))


def test_sdk_stream_helper(oai):
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=16, temperature=0)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert final.output_text == oai.responses.create(**kwargs).output_text
    assert events[-1].type == "response.completed" and final.usage.output_tokens > 0
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def _typed_events(server, body) -> list[dict]:
    """A raw stream: every event named by its type, numbered 0, 1, ..., valid for the SDK."""
    with httpx.stream("POST", server.url("/v1/responses"), json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().replace("\r\n", "\n").strip().split("\n\n")
    events = []
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        event = json.loads(lines["data"])
        assert lines["event"] == event["type"]
        EVENT.validate_python(event)  # the SDK's pydantic models are the spec
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_raw_stream_event_order(server, oai):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 16, "temperature": 0}
    events = _typed_events(server, {**body, "stream": True})
    types = [e["type"] for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]  # fmt: skip
    final = oai.responses.create(**body)
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", f"response.{final.status}"]  # fmt: skip
    n = len(types) - len(head) - len(tail)
    assert n >= 1 and types == head + ["response.output_text.delta"] * n + tail
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == final.output_text
    done = RESPONSE.model_validate(events[-1]["response"])
    assert done.output_text == text and done.usage.total_tokens == final.usage.total_tokens
    item_ids = {e.get("item_id") or e.get("item", {}).get("id") for e in events[2:-1]}
    assert item_ids == {done.output[0].id}


def test_max_output_tokens_makes_it_incomplete(server, oai):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 3}
    r = oai.responses.create(**body, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = _typed_events(server, {**body, "ignore_eos": True, "stream": True})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["usage"]["output_tokens"] == 3


def test_forced_function_call_and_its_result(oai):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "name": "get_weather"}
    r = oai.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=forced,
                             max_output_tokens=80, temperature=0)  # fmt: skip
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    result = json.dumps({"city": args["city"], "temperature": 21, "unit": args["unit"]})
    turn2 = [*ask, *r.output, {"type": "function_call_output", "call_id": call.call_id,
                               "output": result}]  # fmt: skip
    final = oai.responses.create(model=MODEL, input=turn2, tools=[WEATHER], tool_choice="none",
                                 max_output_tokens=24, temperature=0)  # fmt: skip
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    messages = [*ask, {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]  # fmt: skip
    _same_as_chat(final, _chat(oai, messages, 24, tools=[CHAT_WEATHER], tool_choice="none"))


def test_streamed_function_call(server, oai):
    body = {"model": MODEL, "input": "Weather in Rome?", "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 80, "temperature": 0}  # fmt: skip
    events = _typed_events(server, {**body, "stream": True})
    types = [e["type"] for e in events]
    n = types.count("response.function_call_arguments.delta")
    assert n > 1 and types == ["response.created", "response.in_progress",
                               "response.output_item.added",
                               *["response.function_call_arguments.delta"] * n,
                               "response.function_call_arguments.done",
                               "response.output_item.done", "response.completed"]  # fmt: skip
    args = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    (want,) = oai.responses.create(**body).output
    assert args == events[-3]["arguments"] == want.arguments
    item = events[-2]["item"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["name"] == "get_weather" and item["call_id"].startswith("call_")


def test_text_format_json_schema(oai):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
              "why": {"type": "string", "maxLength": 40}}, "required": ["answer", "why"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    r = oai.responses.create(model=MODEL, input="Is the sky blue? Answer in JSON.",
                             text={"format": fmt}, max_output_tokens=60, temperature=0)  # fmt: skip
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    parsed = oai.responses.parse(model=MODEL, input="Name a city in JSON.", text_format=City,
                                 max_output_tokens=60, temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, City)


def test_tools_beside_a_text_format_parse_with_the_sdk(oai):
    """The Agents SDK over /v1/responses sends an agent's tools and output type together (a
    400 before): each answer is calls or the format's JSON, which the SDK's parse reads."""
    kinds = set()
    for seed in range(5):
        r = oai.responses.parse(model=MODEL, input="Is it sunny in Paris?", tools=[WEATHER],
                                text_format=City, max_output_tokens=80, temperature=1.0,
                                extra_body={"seed": seed})  # fmt: skip
        assert r.status in ("completed", "incomplete")
        types = {o.type for o in r.output}
        if r.status == "completed" and types == {"message"}:
            kinds.add("answer")
            assert isinstance(r.output_parsed, City)
        elif "function_call" in types:
            kinds.add("call")
            assert types == {"function_call"}
    assert kinds == {"answer", "call"}, kinds


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        # an output answering no call before it (OpenAI: "No tool call found ...")
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
         "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]},
         "input[0].call_id"),
        ({"input": []}, "input"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        # a union's branch name was the param: input[0].content.str
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": "x" * 40_000}, "input"),  # over the context window: was "prompt"
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_requests_are_openai_400s(server, oai, extra, param):
    kwargs = {"model": MODEL, "input": ASK, "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**kwargs)
    error = e.value.body
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"]
    assert _idle(server) and server.async_engine.num_requests_in_flight == 0


def test_retrieve_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve("resp_123")
    assert "stateless" in e.value.body["message"]


def test_disconnects_abort(server):
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 1000,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url("/v1/responses"), json={**body, "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 24:  # 8 events (3 lines each): 4 text deltas in
                break
        assert server.async_engine.stats().num_running == 1
    assert wait_until(lambda: _idle(server), timeout=2.0), server.async_engine.stats()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/responses"), json=body, timeout=1.0)
    assert wait_until(lambda: _idle(server), timeout=2.0), server.async_engine.stats()
    assert server.async_engine.num_requests_in_flight == 0


def test_a_failing_request_is_500_or_response_failed(fake_server):
    """The fake engine fails a prompt holding token 13 (SmolLM2's "<jupyter_code>")."""
    body = {"input": "<jupyter_code>", "max_output_tokens": 4}
    with fake_server() as s:
        r = httpx.post(s.url("/v1/responses"), json=body)
        assert r.status_code == 500 and "fake failure" in r.json()["error"]["message"]
        events = _typed_events(s, {**body, "stream": True})
        assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                               "response.failed"]  # fmt: skip
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "fake failure" in failed["error"]["message"]
        ok = httpx.post(s.url("/v1/responses"), json={"input": "hi", "max_output_tokens": 3})
        assert ok.json()["output"][0]["content"][0]["text"] == "t0 t1 t2 "


def test_an_answer_that_breaks_its_schema_is_the_clients_fault_streamed_too(server):
    """``uniqueItems`` is checked on the finished answer (structured/schema_approx.py): here
    the grammar can only write [1, 1], which breaks it. Unstreamed a 400 naming text.format;
    streamed, ``response.failed`` said ``server_error`` for the client's own schema."""
    items = {"type": "integer", "enum": [1]}
    schema = {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "array", "items": items, "minItems": 2, "maxItems": 2, "uniqueItems": True}}}  # fmt: skip
    body = {"model": MODEL, "input": "json", "max_output_tokens": 40,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}  # fmt: skip
    r = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    failed = _typed_events(server, {**body, "stream": True})[-1]
    assert failed["type"] == "response.failed"
    error = failed["response"]["error"]
    assert error["code"] == "invalid_prompt" and "uniqueItems" in error["message"], error

"""Function calling on the real server (SmolLM2, whose template has no tool support): forced
and automatic calls whose arguments validate, a full round trip through a local function,
streamed calls accumulated by the official SDK's stream helper, and the 400s."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import openai
import pytest

from tests.support.api import MODEL, WEATHER, same_when_streamed

TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"]}},
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as c:
        yield c


def _check_call(call, tool=WEATHER):
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_forced_call_round_trip(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice=choice, max_tokens=120)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    _check_call(call)
    args = json.loads(call.function.arguments)
    result = {"city": args["city"], "temperature": 21, "unit": args["unit"]}  # the local function
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    final = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                        tool_choice="none", max_tokens=40, temperature=0)  # fmt: skip
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_required_and_auto_always_parse(oai):
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                        tool_choice="required", max_tokens=150, seed=seed,
                                        temperature=1.0, parallel_tool_calls=False)  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                        max_tokens=150, seed=seed, temperature=1.0)  # fmt: skip
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            for call in c.message.tool_calls:
                _check_call(call)
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content is not None


def test_streamed_call_accumulates_in_the_sdk(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                   max_tokens=120, seed=0)  # fmt: skip
    with oai.chat.completions.stream(**request) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    _check_call(call)
    (want,) = oai.chat.completions.create(**request).choices[0].message.tool_calls
    assert call.function.arguments == want.function.arguments


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required", "auto"])  # fmt: skip
def test_streamed_envelope_equals_the_non_streamed_one(oai, choice):
    """Same seed, stream=False and stream=True: the same content (decoded from the
    envelope's string as it streams) or calls (arguments in several fragments)."""
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                   max_tokens=96, temperature=1.0)  # fmt: skip
    assert same_when_streamed(oai, range(2), **request)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "'nope' is not in tools"),
        ({"tool_choice": "required"}, "requires tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "array"}}}]}, "object schema"),
        ({"tools": [WEATHER], "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"tools": [WEATHER, WEATHER]}, "'get_weather' is given twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
          "properties": {"a": {"$ref": "#/$defs/No"}}, "$defs": {"N": {}}}}}]},
         "$ref '#/$defs/No' does not resolve"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(server, extra, words):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_tools_whose_parameters_use_defs_and_refs(oai):
    """pydantic writes nested models as ``$defs`` + ``#/$defs/...`` refs relative to the
    parameters' root; inside the envelope that root moved, and such tools were a 400
    ("Pointer '/$defs/Address' does not exist"). Two of them side by side (same def name):
    each call's arguments validate against its own tool's schema."""
    from pydantic import BaseModel

    class Address(BaseModel):
        city: str
        zip_code: str

    class Person(BaseModel):
        name: str
        home: Address
        friends: list[Person] = []

    class Order(BaseModel):
        item: str
        ship_to: Address

    tools = [{"type": "function", "function": {"name": n, "parameters": m.model_json_schema()}}
             for n, m in (("add_person", Person), ("place_order", Order))]  # fmt: skip
    assert "$defs" in tools[0]["function"]["parameters"]
    calls = 0
    for tool in tools:
        choice = {"type": "function", "function": {"name": tool["function"]["name"]}}
        r = oai.chat.completions.create(
            model=MODEL, tools=tools, tool_choice=choice, max_tokens=200, temperature=0,
            messages=[{"role": "user", "content": "Ann lives in Oslo, zip code 0150. She orders a lamp."}],
        )  # fmt: skip
        c = r.choices[0]
        (call,) = c.message.tool_calls  # cut by max_tokens too: a forced call is still a call
        assert call.function.name == tool["function"]["name"] and c.message.content is None
        if c.finish_reason == "length":  # a small model may recurse into friends
            assert call.function.arguments.startswith("{")
            continue
        _check_call(call, tool)
        calls += 1
    assert calls >= 1


VERDICT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
           "sunny": {"type": "boolean"}}, "required": ["city", "sunny"],
           "additionalProperties": False}  # fmt: skip
VERDICT_FORMAT = {"type": "json_schema",
                  "json_schema": {"name": "Verdict", "schema": VERDICT, "strict": True}}  # fmt: skip


def test_tools_beside_a_response_format_answer_in_that_json_or_call(oai):
    """The OpenAI Agents SDK sends an agent's tools and its output type's response_format
    together (it was a 400): under ``auto`` the answer is a call or the format's JSON, never
    free text; streamed, the same; a forced call is a call whatever the format."""
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                   temperature=1.0, response_format=VERDICT_FORMAT)  # fmt: skip
    kinds = set()
    for seed in range(6):
        c = oai.chat.completions.create(seed=seed, **request).choices[0]
        if c.finish_reason == "tool_calls":
            kinds.add("call")
            for call in c.message.tool_calls:
                _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
        elif c.finish_reason == "stop":
            kinds.add("answer")
            assert not c.message.tool_calls
            jsonschema.validate(json.loads(c.message.content), VERDICT)
    assert kinds == {"call", "answer"}, kinds  # both happen: the test sees each kind
    assert same_when_streamed(oai, range(4), **request) >= 2
    for fmt in (VERDICT_FORMAT, {"type": "json_object"}):
        c = oai.chat.completions.create(**{**request, "response_format": fmt}, seed=0,
                                        tool_choice="required").choices[0]  # fmt: skip
        assert c.message.tool_calls and c.message.content is None  # (cut: "length")


def test_tools_beside_json_object_answer_an_object_or_call(oai):
    for seed in range(4):
        c = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, seed=seed,
            temperature=1.0, response_format={"type": "json_object"}, tool_choice="auto",
        ).choices[0]  # fmt: skip
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict) and not c.message.tool_calls
        else:
            assert c.finish_reason in ("tool_calls", "length")
            assert c.finish_reason == "length" or c.message.tool_calls


def test_refs_resolve_within_the_parameters_or_are_named():
    from tinyserve.entrypoints.tools import Tool, check_tools

    def tool(params):
        return Tool.model_validate({"type": "function", "function": {"name": "f",
                                                                     "parameters": params}})  # fmt: skip

    fine = {"type": "object", "$defs": {"a/b": {"type": "integer"}, "~x": {}},
            "properties": {"p": {"$ref": "#/$defs/a~1b"}, "q": {"$ref": "#/$defs/~0x"},
                           "r": {"$ref": "#/properties/p"}, "s": {"$ref": "#"},
                           "t": {"items": [{"type": "integer"}]},
                           "u": {"$ref": "#/properties/t/items/0"},
                           "v": {"const": {"$ref": "#/nowhere"}}}}  # data, not a schema  # fmt: skip
    assert check_tools([tool(fine)], "auto")
    for ref in ("#/$defs/a/b", "#/properties/t/items/1", "#/$defs/missing"):
        with pytest.raises(ValueError, match="does not resolve"):
            check_tools([tool({**fine, "properties": {"p": {"$ref": ref}}})], "auto")


@pytest.mark.parametrize("choice, stop", [("auto", [" the", "}"]), ("required", ["}"])])
def test_a_stop_string_inside_the_envelope_never_sends_the_wrapper(oai, choice, stop):
    """A stop string that cuts the envelope (ReAct agents send stop=["Observation:"]): the
    answer is what the stream sent, the text inside {"content": ...} or the cut call, never
    the raw wrapper as content (the non-streamed answer sent that, unlike the stream)."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Describe the sea."}],
                   tools=[WEATHER], tool_choice=choice, max_tokens=80, temperature=1.0,
                   stop=stop)  # fmt: skip
    for seed in range(4):
        c = oai.chat.completions.create(seed=seed, **request).choices[0]
        assert not (c.message.content or "").lstrip().startswith(('{"content"', '{"tool_calls"'))
        if c.finish_reason == "stop" and choice == "required":
            assert c.message.tool_calls and c.message.content is None
    same_when_streamed(oai, range(4), **request)


@pytest.mark.parametrize("params", [None, {}, {"type": "object"}])
def test_a_function_without_parameters_is_called_with_none(oai, params):
    """OpenAI: omitting parameters defines a function with an empty parameter list. The
    grammar had let the model invent arguments ('{"time": 1234567890123...')."""
    fn = {"name": "get_time", **({"parameters": params} if params is not None else {})}
    for seed in range(2):
        c = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
            tools=[{"type": "function", "function": fn}], tool_choice="required",
            max_tokens=40, seed=seed, temperature=1.0, parallel_tool_calls=False,
        ).choices[0]  # fmt: skip
        assert c.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
            ("get_time", "{}")
        ]


def test_a_response_format_with_defs_beside_tools_compiles(oai):
    """A pydantic output type with a nested model ($defs / $ref) beside tools that use no
    $ref: the envelope had dropped the definitions ('Pointer /$defs/answer does not exist')."""
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str

    class Order(BaseModel):
        items: list[Item]

    schema = Order.model_json_schema()
    assert "$defs" in schema
    fmt = {"type": "json_schema", "json_schema": {"name": "Order", "schema": schema}}
    for seed in range(3):
        c = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                        response_format=fmt, max_tokens=60, seed=seed,
                                        temperature=1.0).choices[0]  # fmt: skip
        if c.finish_reason == "stop":
            Order.model_validate_json(c.message.content)


def test_anchor_refs_and_extension_keys_are_not_pointers():
    from tinyserve.entrypoints.tools import Tool, check_tools

    params = {"type": "object", "$defs": {"A": {"$anchor": "A", "type": "integer"}},
              "properties": {"a": {"$ref": "#A"}}, "x-meta": {"$ref": "#/nowhere"}}  # fmt: skip
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": params}}
    )
    assert check_tools([tool], "auto")


def test_earlier_calls_are_text_where_no_tools_are_offered(client):
    """After a tool round, ``tool_choice: "none"`` (or no tools) has no envelope to answer
    in: earlier calls rendered as envelope JSON were copied by the model as its answer, raw
    (content '{"tool_calls": [...]}'). They are text there; with tools, the envelope."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22C sunny"}]  # fmt: skip

    def prompt(**extra) -> str:
        ids = client.post("/tokenize", json={"model": MODEL, "messages": history, **extra})
        return client.post("/detokenize", json={"model": MODEL, "tokens": ids.json()["tokens"]}
                           ).json()["prompt"]  # fmt: skip

    plain = prompt()
    assert '{"tool_calls"' not in plain and '(called get_weather with {"city": "Paris"})' in plain
    assert '{"tool_calls": [{"name": "get_weather"' in prompt(tools=[WEATHER])


def test_text_beside_calls_stays_in_the_history(client):
    """An assistant turn with both content and tool calls: the envelope rendering kept the
    calls and dropped the text (what the assistant told the user before calling)."""
    said = "Let me look that up for you."
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": said, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22C sunny"}]  # fmt: skip
    ids = client.post("/tokenize", json={"model": MODEL, "messages": history, "tools": [WEATHER]})
    text = client.post("/detokenize", json={"model": MODEL, "tokens": ids.json()["tokens"]}
                       ).json()["prompt"]  # fmt: skip
    assert f'{said}\n{{"tool_calls": [{{"name": "get_weather"' in text


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_a_bad_response_format_beside_tools_names_itself(client, choice):
    """A format's schema that does not compile, beside tools: under auto the 400 named
    ``tools`` and quoted the envelope's internal ``$defs/answer__...`` name; under required
    (a call is forced, the format is for a later answer) it was not compiled at all: a 200."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$dynamicRef": "#m"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": choice, "response_format": fmt,
            "max_tokens": 8}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "'$dynamicRef'" in err["message"], err
    assert "answer__" not in err["message"]
    if choice == "required":  # the Responses API's text.format, the same way
        tool = {"type": "function", **WEATHER["function"]}
        r = client.post("/v1/responses", json={
            "model": MODEL, "input": "Weather in Paris?", "tools": [tool], "tool_choice": choice,
            "text": {"format": {"type": "json_schema", **fmt["json_schema"]}}})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


NOTE = "Bring an umbrella and a warm coat, the forecast for the whole week looks grey and wet."
ZURICH = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Zürich", "Malmö"]},
                                     "note": {"enum": [NOTE]}},
    "required": ["city", "note"], "additionalProperties": False}}}  # fmt: skip
LONG = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 500}},
    "required": ["city"]}}}  # fmt: skip


@pytest.mark.parametrize("tool, max_tokens, slack", [(ZURICH, 100, 0), (LONG, 64, 1)])
def test_the_next_turn_hits_the_cache_over_the_calls_tokens(client, tool, max_tokens, slack):
    """The next turn's prompt repeats a call's tokens as generated, so the prefix cache holds
    all of them: a call re-serialised diverged at a non-ASCII character (json.dumps's
    ``\\u00fc``) and, for a call cut by max_tokens, at its arguments (quoted as a string).
    ``slack``: a cut call's last token may merge with the envelope's closing text."""
    ask = [{"role": "user", "content": f"Weather in Zürich? {uuid.uuid4().hex}"}]  # uncached
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": MODEL, "tools": [tool], "tool_choice": choice, "temperature": 0}
    first = client.post("/v1/chat/completions", json={**body, "messages": ask,
                                                       "max_tokens": max_tokens}).json()  # fmt: skip
    message, usage = first["choices"][0]["message"], first["usage"]
    assert first["choices"][0]["finish_reason"] == ("length" if slack else "tool_calls")
    (call,) = message["tool_calls"]
    assert not call["function"]["arguments"].isascii() or slack  # Zürich or Malmö
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "12C, rain"}]  # fmt: skip
    second = client.post("/v1/chat/completions", json={**body, "messages": history,
                                                        "max_tokens": 4}).json()  # fmt: skip
    # Computed KV: the prompt and every generated token but the last (sampled, never fed).
    computed = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (computed // 16 - slack) * 16 and cached <= computed

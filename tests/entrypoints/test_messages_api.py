"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
official ``anthropic`` SDK against a real server on the default model: create, stream (its
``text_stream`` and final message, the raw event order), a tool round trip (also streamed:
``input_json_delta`` fragments add up to the call's input), stop sequences, count_tokens,
Anthropic's error shape, and ``x-api-key`` as well as Bearer when a key is set."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.support.api import MODEL
from tinyserve.testing.sse import iter_data

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_create_and_count_tokens(claude):
    msgs = [{"role": "user", "content": "Name a colour."}]
    m = claude.messages.create(model=MODEL, max_tokens=24, system="Be brief.", messages=msgs)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    (block,) = m.content
    assert block.type == "text" and block.text
    assert 0 < m.usage.output_tokens <= 24
    # Anthropic always reports its prompt-cache counts (0 where no cache_control is used)
    assert (m.usage.cache_read_input_tokens, m.usage.cache_creation_input_tokens) == (0, 0)
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=msgs)
    assert count.input_tokens == m.usage.input_tokens
    blocks = claude.messages.create(model=MODEL, max_tokens=24, messages=msgs,
                                    system=[{"type": "text", "text": "Be brief."}])  # fmt: skip
    assert blocks.usage.input_tokens == m.usage.input_tokens


def test_stream_text_and_events(claude, client):
    kw = dict(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": "Say hi."}],
        extra_body={"temperature": 0},
    )  # (this SDK has no temperature argument)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")
    whole = claude.messages.create(**kw)
    assert whole.content[0].text == text  # greedy: streamed or not, the same answer
    raw = {k: v for k, v in kw.items() if k != "extra_body"} | kw["extra_body"]
    with client.stream("POST", "/v1/messages", json={**raw, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(d)["type"] for d in iter_data(r.iter_lines())]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}


def test_tool_round_trip(claude):
    # Greedy: sampled at temperature 1 the model may write up to 8 parallel calls and run
    # out of max_tokens (seen once), which is not what this test is about.
    m = claude.messages.create(model=MODEL, max_tokens=120, tools=[WEATHER],
                               tool_choice={"type": "any"}, messages=ASK,
                               extra_body={"temperature": 0})  # fmt: skip
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id.startswith("toolu_") for u in uses)
    for u in uses:
        jsonschema.validate(u.input, WEATHER["input_schema"])
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                      "content": "18 C, sunny"} for u in uses]},
    ]  # fmt: skip
    answer = claude.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=history)  # fmt: skip
    assert answer.content and answer.content[0].type == "text"
    named = claude.messages.create(model=MODEL, max_tokens=120, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True},
                                   messages=ASK)  # fmt: skip
    assert [b.type for b in named.content] == ["tool_use"]


def test_tool_use_streams_as_input_json_deltas(claude):
    kw = dict(model=MODEL, max_tokens=120, tools=[WEATHER], tool_choice={"type": "any"},
              messages=ASK, extra_body={"temperature": 0})  # fmt: skip
    with claude.messages.stream(**kw) as stream:
        fragments = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"][:1]
    assert json.loads("".join(fragments))["city"] == use.input["city"]
    whole = claude.messages.create(**kw)
    assert [b.input for b in whole.content if b.type == "tool_use"][0] == use.input


def test_stop_sequences(claude):
    m = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        extra_body={"temperature": 0},
        stop_sequences=[" "],
        messages=[{"role": "user", "content": "Write a sentence."}],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " "
    assert " " not in m.content[0].text if m.content else True


def test_errors_are_anthropic_shaped(client):
    def post(body, **kw):
        return client.post("/v1/messages", json=body, **kw)

    base = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({k: v for k, v in base.items() if k != "max_tokens"}, 400, "invalid_request_error"),
        ({**base, "model": "claude-nope"}, 404, "not_found_error"),
        ({**base, "max_tokens": 0}, 400, "invalid_request_error"),
        ({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
         "invalid_request_error"),
        ({**base, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "x"}}]}]}, 400,
         "invalid_request_error"),
        ({**base, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "invalid_request_error"),
        ({**base, "temperature": 1.5}, 400, "invalid_request_error"),  # 0.0 to 1.0 there
    ]  # fmt: skip
    for body, status, kind in cases:
        r = post(body)
        assert r.status_code == status, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


def test_a_final_assistant_message_is_continued(claude, client, smollm2_tokenizer):
    """Anthropic's prefill: a last assistant message is left open and the answer continues
    it — the prompt is the template's with ``continue_final_message`` (no end of turn, no new
    assistant header), the answer the same greedy tokens as /v1/completions on those ids, and
    it holds only the continuation."""
    ask = {"role": "user", "content": "Count to 10"}
    msgs = [ask, {"role": "assistant", "content": "1, 2, 3,"}]
    ids = smollm2_tokenizer.apply_chat_template(msgs, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    kw = dict(model=MODEL, max_tokens=8, extra_body={"temperature": 0})
    m = claude.messages.create(messages=msgs, **kw)
    assert m.usage.input_tokens == len(ids)
    assert claude.messages.count_tokens(model=MODEL, messages=msgs).input_tokens == len(ids)
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 8,
                                                 "temperature": 0}).json()  # fmt: skip
    assert m.content[0].text == plain["choices"][0]["text"]
    with claude.messages.stream(messages=msgs, **kw) as stream:
        assert "".join(stream.text_stream) == m.content[0].text
    # An empty final assistant message is left out: the prompt is the user turn's.
    alone = claude.messages.count_tokens(model=MODEL, messages=[ask]).input_tokens
    empty = [ask, {"role": "assistant", "content": ""}]
    assert claude.messages.count_tokens(model=MODEL, messages=empty).input_tokens == alone


def test_a_prefill_a_grammar_would_restart_is_a_400(claude):
    """With tools on a template without tool support (the JSON envelope), or under
    output_config.format, the grammar starts the answer anew after a prefill: 'The answer is'
    came back followed by a fresh '2 + 2 = 4', and a text prefill even as a tool call. A
    400 says so; the same prefill without them is continued."""
    msgs = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "The answer is"}]  # fmt: skip
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for extra in ({"tools": [WEATHER]},
                  {"extra_body": {"output_config": {"format": {"type": "json_schema",
                                                               "schema": schema}}}}):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=MODEL, max_tokens=8, messages=msgs, **extra)
        assert "prefill" in str(e.value)
    m = claude.messages.create(model=MODEL, max_tokens=4, messages=msgs)
    assert m.content and m.content[0].type == "text"


def test_turns_as_anthropic_takes_them(claude, client):
    """Thinking blocks of an earlier answer are dropped (as Anthropic strips them), text
    blocks of a turn joined by newlines, empty turns and a prefill ending in whitespace 400s,
    and a known block with a bad field is that field's error."""

    def count(messages):
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    hi, again = {"role": "user", "content": "hi"}, {"role": "user", "content": "again"}
    think = [
        {"type": "thinking", "thinking": "hmm", "signature": "abc"},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "text", "text": "hello"},
    ]
    assert count([hi, {"role": "assistant", "content": think}, again]) == count(
        [hi, {"role": "assistant", "content": "hello"}, again]
    )
    two = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert count([{"role": "user", "content": two}]) == count(
        [{"role": "user", "content": "Hello\nworld"}]
    )
    base = {"model": MODEL, "max_tokens": 4}
    cases = [
        ([{"role": "user", "content": ""}], "non-empty"),
        ([{"role": "user", "content": []}], "non-empty"),
        ([hi, {"role": "assistant", "content": ""}, again], "non-empty"),
        ([hi, {"role": "assistant", "content": "1, 2, "}], "trailing whitespace"),
        # each the deepest error, the block's own path (no tag, no other union branch)
        ([{"role": "user", "content": [{"type": "text"}]}],
         "messages[0].content[0].text: Field required"),
        ([hi, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": None}]}], "content[0].input"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                        "content": None}]}], "content[0].content"),
        ([{"role": "user", "content": [{"text": "hi"}]}],
         "messages[0].content[0].type: Field required"),
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}],
         "'image' blocks are not supported in user turns"),
    ]  # fmt: skip
    for messages, words in cases:
        r = client.post("/v1/messages", json={**base, "messages": messages})
        assert r.status_code == 400, (messages, r.text)
        message = r.json()["error"]["message"]
        assert r.json()["type"] == "error" and words in message, r.text
        assert ".str" not in message and "other" not in message.lower(), message


def test_x_api_key_and_bearer(fake_server):
    body = {"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with fake_server(api_key="s3cret") as s:
        r = httpx.post(s.url("/v1/messages"), json=body)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"
        assert (
            httpx.post(s.url("/v1/messages"), json=body, headers={"x-api-key": "no"}).status_code
            == 401
        )
        assert (
            httpx.post(
                s.url("/v1/messages"), json=body, headers={"x-api-key": "s3cret"}
            ).status_code
            == 200
        )
        bearer = {"Authorization": "Bearer s3cret"}
        assert httpx.post(s.url("/v1/messages"), json=body, headers=bearer).status_code == 200
        c = anthropic.Anthropic(base_url=s.base_url, api_key="s3cret", max_retries=0)
        assert (
            c.messages.count_tokens(model="fake-model", messages=body["messages"]).input_tokens > 0
        )
        # Both headers (a client configured with a key and a token, e.g. Claude Code's
        # ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN): either may be the key; neither being
        # it is still a 401, and the message names both headers.
        for bearer, x_key, status in (("other", "s3cret", 200), ("s3cret", "other", 200),
                                      ("other", "nope", 401)):  # fmt: skip
            both = {"Authorization": f"Bearer {bearer}", "x-api-key": x_key}
            r = httpx.post(s.url("/v1/messages"), json=body, headers=both)
            assert r.status_code == status, (bearer, x_key)
            assert status == 200 or "x-api-key" in r.json()["error"]["message"]


def test_every_sdk_field_is_classified():
    """Each request field of the installed anthropic SDK's Messages type is declared (and
    followed) or IGNORED as metadata: a field a later SDK adds fails here until classified."""
    from anthropic.types import message_create_params

    from tinyserve.entrypoints import protocol_anthropic as A

    td = message_create_params.MessageCreateParamsBase
    fields = {k for cls in td.__mro__ for k in getattr(cls, "__annotations__", {})}
    assert len(fields) > 10
    assert not fields - set(A.MessagesRequest.model_fields) - A.IGNORED
    assert not A.IGNORED & set(A.MessagesRequest.model_fields)


def test_output_config_format_is_followed(claude, client):
    """Anthropic's structured outputs (``output_config.format``): the answer's text is JSON
    of the schema, streamed or not; ``effort`` is accepted; an unknown key of it, or a
    format beside tools, is a 400 in Anthropic's shape."""
    schema = {"type": "object", "properties": {"size": {"enum": ["small", "large"]},
              "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["size", "count"], "additionalProperties": False}  # fmt: skip
    kw = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "A box?"}],
              extra_body={"temperature": 0, "output_config": {
                  "format": {"type": "json_schema", "schema": schema}, "effort": "low"}})  # fmt: skip
    m = claude.messages.create(**kw)
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with claude.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == m.content[0].text
    base = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    extra = {"output_config": {"format": {"type": "json_schema", "schema": schema},
                               "colour": "red"}}  # fmt: skip
    r = client.post("/v1/messages", json={**base, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "output_config" in r.json()["error"]["message"], r.text


def test_output_config_format_beside_tools_is_a_call_or_that_json(claude):
    """A format beside tools (a 400 before): the answer is tool_use blocks or the format's
    JSON as text, streamed the same."""
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}},
              "required": ["sunny"], "additionalProperties": False}  # fmt: skip
    kinds = set()
    for ask in ("Is it sunny in Paris?", "Weather in Oslo?", "Is the sky blue?", "Say hi."):
        kw = dict(model=MODEL, max_tokens=60, tools=[WEATHER],
                  messages=[{"role": "user", "content": ask}],
                  extra_body={"temperature": 0, "output_config": {
                      "format": {"type": "json_schema", "schema": schema}}})  # fmt: skip
        m = claude.messages.create(**kw)
        if m.stop_reason == "tool_use":
            kinds.add("call")
            assert {b.type for b in m.content} == {"tool_use"}
            with claude.messages.stream(**kw) as stream:
                assert [b.input for b in stream.get_final_message().content] == [
                    b.input for b in m.content
                ]
        elif m.stop_reason == "end_turn":
            kinds.add("answer")
            (block,) = m.content
            jsonschema.validate(json.loads(block.text), schema)
            with claude.messages.stream(**kw) as stream:
                assert "".join(stream.text_stream) == block.text
    assert kinds == {"call", "answer"}, kinds


def test_a_stop_sequence_matches_text_never_a_calls_json(claude):
    """Stop sequences end the text the client sees; a tool_use block's JSON is not text: a
    stop sequence it holds cuts nothing (it cut the call, which came back half-written under
    stop_sequence), streamed the same."""
    kw = dict(model=MODEL, max_tokens=60, tools=[WEATHER], stop_sequences=['": "'],
              tool_choice={"type": "any"}, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Weather in Oslo?"}])  # fmt: skip
    m = claude.messages.create(**kw)
    assert (m.stop_reason, m.stop_sequence) == ("tool_use", None), m
    (call,) = m.content
    assert call.type == "tool_use" and isinstance(call.input.get("city"), str), m
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("tool_use", None)
    assert final.content[0].input == call.input


def test_a_tool_use_cut_by_max_tokens_has_the_same_input_streamed_and_not(claude):
    """A call cut by max_tokens: its whole part as input (the SDK reads the streamed
    input_json_delta in jiter's partial mode); not streamed it was ``{}``."""
    tools = [
        {
            "name": "get_weather",
            "description": "Get weather",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
        {
            "name": "search",
            "description": "Search web",
            "input_schema": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
            },
        },
    ]
    ask = "What's the weather in Paris and search for hotels?"
    kw = dict(model=MODEL, max_tokens=21, tools=tools, tool_choice={"type": "any"},
              messages=[{"role": "user", "content": ask}], extra_body={"temperature": 0})  # fmt: skip
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    uses = [[(b.name, b.input) for b in m.content if b.type == "tool_use"] for m in (whole, final)]
    assert uses[0] == uses[1] and uses[0] and any(inp for _, inp in uses[0])

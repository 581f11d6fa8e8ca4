"""Helpers for the HTTP API tests: the served model's id, the OpenAI error shape, a chat
tool whose arguments are grammar-checked, streamed and non-streamed tool calls compared."""

from __future__ import annotations

import uuid

import httpx

MODEL = "SmolLM2-135M-Instruct"

# A chat tool with two declared properties (a bounded string, an enum), nothing else.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def assert_error(r: httpx.Response, status: int, param: str | None = "-") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "-":
        assert err["param"] == param, err
    return err


def accumulate(client, **request):
    """A streamed chat completion through the SDK, read chunk by chunk: (content, [(name,
    arguments)], finish_reason, argument fragments per call), checking OpenAI's shape."""
    content, calls, finish, fragments = None, {}, None, {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for c in chunk.choices:
            if c.delta.content:
                assert not calls, "content after a tool call began"
                content = (content or "") + c.delta.content
            entries = c.delta.tool_calls or []
            assert len(entries) <= 1
            for e in entries:
                if e.id is not None:
                    assert e.type == "function" and e.function.arguments == ""
                    calls[e.index] = [e.function.name, ""]
                else:
                    assert e.function.name is None
                    calls[e.index][1] += e.function.arguments
                    fragments[e.index] = fragments.get(e.index, 0) + 1
            if c.finish_reason is not None:
                assert finish is None
                finish = c.finish_reason
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, fragments


def non_streamed(client, **request):
    (c,) = client.chat.completions.create(**request).choices
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    return c.message.content, calls, c.finish_reason


def same_when_streamed(client, seeds, raw_text=False, **request) -> int:
    """For each seed, stream=False then stream=True: the same finish reason, and when it is
    not ``length`` the same content and calls, a call's arguments (unless short) in several
    fragments. How many finished before max_tokens. ``raw_text``: the output's text is its
    content (Hermes), so text cut by ``length`` streams the same too."""
    finished = 0
    for seed in seeds:
        # Each its own cache_salt: the streamed answer is not drafted whole from the one just
        # given (suffix decoding, on by default, would send it in one fragment); salts change
        # no token.
        salted = [{**request, "extra_body": {**request.get("extra_body", {}),
                                             "cache_salt": f"{seed}-{mode}-{uuid.uuid4().hex}"}}
                  for mode in ("plain", "stream")]  # fmt: skip
        content, calls, finish = non_streamed(client, seed=seed, **salted[0])
        s_content, s_calls, s_finish, fragments = accumulate(client, seed=seed, **salted[1])
        assert s_finish == finish
        if finish == "length":  # streamed: what was sent; not streamed: the raw text
            if raw_text and not s_calls:
                assert s_content == content
            continue
        finished += 1
        assert (s_content or None, s_calls) == (content, calls)
        for i, (_, arguments) in enumerate(calls):
            assert len(arguments) < 12 or fragments[i] > 1, (arguments, fragments)
    return finished

"""Structured outputs over HTTP on the real server (SmolLM2): the official SDK's
``parse()`` with pydantic models, ``response_format`` and vLLM's ``structured_outputs`` on
chat and completions, streamed and not, and the 400s for bad specs."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.api import MODEL


class City(BaseModel):
    name: str
    country: str
    population: int


class Stop(BaseModel):
    city: str = Field(max_length=24)
    nights: int = Field(ge=1, le=14)


class Trip(BaseModel):  # nested, bounded: a 135M model still ends inside max_tokens
    origin: Stop
    destinations: list[Stop] = Field(min_length=1, max_length=3)
    mode: str = Field(pattern="^(car|train|plane)$")


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("model_cls", [City, Trip])
def test_sdk_parse_returns_a_validated_pydantic_object(oai, model_cls):
    for seed in range(3):
        completion = oai.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a trip between two cities."}],
            response_format=model_cls,
            max_tokens=300,
            temperature=0.8,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, model_cls)
        assert model_cls.model_validate_json(message.content) == message.parsed


def test_streamed_json_schema_and_completions_structured_outputs(server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
              "why": {"type": "string", "maxLength": 40}}, "required": ["answer", "why"]}  # fmt: skip
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "max_tokens": 200, "stream": True, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }  # fmt: skip
    text, finish = "", None
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    finish = c["finish_reason"] or finish
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)

    body = {"model": MODEL, "prompt": ["Phone:", "Code:"], "n": 2, "max_tokens": 30,
            "temperature": 1.0, "seed": 1,
            "structured_outputs": {"regex": r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"}}  # fmt: skip
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert (
            re.fullmatch(r"\+[0-9]{2} [0-9]{3}-[0-9]{4}", c["text"])
            and c["finish_reason"] == "stop"
        )


def test_choice_and_json_object(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick a fruit."}],
            "max_tokens": 20, "structured_outputs": {"choice": ["apple", "pear", "fig"]}}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] in ("apple", "pear", "fig")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give JSON with a key x."}],
            "max_tokens": 100, "response_format": {"type": "json_object"}}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" or isinstance(
        json.loads(choice["message"]["content"]), dict
    )


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as JSON.parse and most clients do."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_top_logprobs_of_a_constrained_answer_are_finite(server):
    """More top_logprobs than the grammar allows tokens: the masked ones read vLLM's -9999.0,
    not -Infinity (a 500 before, and a bare -Infinity in stream chunks), streamed or not, on
    chat and completions."""
    ask = [{"role": "user", "content": "Pick a fruit."}]
    chat = {
        "model": MODEL,
        "messages": ask,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "structured_outputs": {"choice": ["apple", "fig"]},
    }
    r = httpx.post(server.url("/v1/chat/completions"), json=chat, timeout=60)
    assert r.status_code == 200, r.text
    tokens = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert tokens and any(t["logprob"] == -9999.0 for e in tokens for t in e["top_logprobs"])
    with httpx.stream(
        "POST", server.url("/v1/chat/completions"), json={**chat, "stream": True}, timeout=60
    ) as s:
        chunks = [_strict_json(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert any(c["choices"] and c["choices"][0].get("logprobs") for c in chunks)
    plain = {
        "model": MODEL,
        "prompt": "Fruit:",
        "max_tokens": 4,
        "logprobs": 3,
        "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    r = httpx.post(server.url("/v1/completions"), json=plain, timeout=60)
    assert r.status_code == 200, r.text
    assert _strict_json(r.text)["choices"][0]["logprobs"]["top_logprobs"]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"$dynamicRef": "#meta"}}}}, "response_format", "'$dynamicRef'"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
         "structured_outputs", "not both"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_and_the_server_goes_on(server, extra, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(server.url("/v1/chat/completions"), json={**body, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and (err["param"] == param or param in err["message"])
    assert httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).status_code == 200


def test_an_answer_breaking_a_keyword_checked_after_is_a_400_streamed_or_not(server):
    """uniqueItems is no grammar's: the answer is checked after generation. This schema's
    grammar allows only [1, 1], so the check fails: a 400 naming the field and the keyword
    (not a 200 with an invalid answer); streamed, an error event after the tokens."""
    schema = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}  # fmt: skip
    # Greedy, room to finish: sampled, the answer once ran out of 20 tokens (a 200, cut).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "two ones"}],
            "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_schema",
            "json_schema": {"name": "pair", "schema": schema}}}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format") and "'uniqueItems'" in err["message"]
    with httpx.stream("POST", server.url("/v1/chat/completions"), json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "'uniqueItems'" in errors[0]["message"], events[-3:]
    plain = {k: v for k, v in body.items() if k != "response_format"}
    assert httpx.post(server.url("/v1/chat/completions"), json=plain, timeout=60).status_code == 200


def test_a_oneof_whose_branches_overlap_is_checked_after(server):
    """oneOf is compiled as anyOf: exact only where its branches are disjoint. Here the one
    answer the grammar allows, 1, is valid under both branches, so not under oneOf: a 400
    naming it (it was a 200: found sampling 100 real-world schemas, SchemaStore's
    bundleconfig.json answered [321, 1])."""
    schema = {"oneOf": [{"const": 1}, {"type": "integer", "minimum": 1, "maximum": 1}]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "one"}], "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "one", "schema": schema}}}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "'oneOf'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "invalid_value"  # as a 400 before generation (was null)
    either = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"const": "x"}]}
    body["response_format"]["json_schema"]["schema"] = either  # disjoint: every answer valid
    assert httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).status_code == 200

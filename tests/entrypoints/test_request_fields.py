"""No request field silently ignored (issue 39): every field of the installed openai SDK's
chat completions, completions and responses parameters is honoured (a field of our request
model), accepted and ignored as OpenAI treats metadata, or refused with a 400 naming it — the
test reads the SDK's own type definitions, so a field a later SDK adds fails here until it is
classified. vLLM's older ``guided_*`` keys (and llama.cpp server's ``grammar`` and
``json_schema``) constrain the output as ``structured_outputs`` does; an unknown field is
logged and ignored."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from openai.types import completion_create_params as completions
from openai.types.chat import completion_create_params as chat
from openai.types.responses import response_create_params as responses

from tests.support.api import MODEL, assert_error
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol_responses import ResponsesRequest
from tinyserve.entrypoints.request_fields import HARMLESS, IGNORED, REJECTED

SDK = {
    "chat": (chat.CompletionCreateParamsBase, P.ChatCompletionRequest),
    "completions": (completions.CompletionCreateParamsBase, P.CompletionRequest),
    "responses": (responses.ResponseCreateParamsBase, ResponsesRequest),
}
MSGS = [{"role": "user", "content": "hi"}]


def _sdk_fields(td) -> set[str]:
    return {k for cls in td.__mro__ for k in getattr(cls, "__annotations__", {})}


def _declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()} | set(model.model_fields)


@pytest.mark.parametrize("api", sorted(SDK))
def test_every_sdk_field_is_classified(api):
    td, model = SDK[api]
    fields = _sdk_fields(td)
    assert len(fields) > 10  # the SDK's types were read
    unclassified = fields - _declared(model) - IGNORED - set(REJECTED)
    assert not unclassified, f"{api}: classify {sorted(unclassified)} in request_fields.py"
    assert not (IGNORED & set(REJECTED))


def _value(name: str):
    """A value that asks for something (not null, false or empty)."""
    return {"modalities": ["audio"], "best_of": 3, "use_beam_search": True,
            "echo": True}.get(name, "x")  # fmt: skip


def test_rejected_fields_are_400s_naming_them_unless_they_ask_nothing(fake_server):
    apis = [  # each name goes where no model field takes it (top_logprobs: responses only)
        ("/v1/chat/completions", P.ChatCompletionRequest, {"messages": MSGS, "max_tokens": 2}),
        ("/v1/responses", ResponsesRequest, {"input": "hi", "max_output_tokens": 2}),
    ]
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        for name in REJECTED:
            path, _, body = next(a for a in apis if name not in _declared(a[1]))
            body = {"model": "fake-model", **body}
            err = assert_error(c.post(path, json={**body, name: _value(name)}), 400, name)
            assert err["message"].startswith(name)
            for harmless in (None, False, [], {}, HARMLESS.get(name)):
                r = c.post(path, json={**body, name: harmless})
                assert r.status_code == 200, (name, harmless, r.text)
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                            "max_tokens": 2, "n": 2, "best_of": 2})  # fmt: skip
        assert r.status_code == 200, r.text
        assert_error(
            c.post(
                "/v1/responses", json={"model": "fake-model", "input": "hi", "prompt_logprobs": 1}
            ),
            400,
            "prompt_logprobs",
        )


def test_null_is_the_default_for_every_field_that_has_one(fake_server):
    """OpenAI's types say ``| None`` for nearly every field and clients send explicit nulls:
    ``"stream": null`` and ``"parallel_tool_calls": null`` were 400s ("Input should be a
    valid boolean"). Every declared field with a default takes null as that default."""
    apis = [("/v1/chat/completions", P.ChatCompletionRequest, {"messages": MSGS}),
            ("/v1/completions", P.CompletionRequest, {"prompt": "hi"}),
            ("/v1/responses", ResponsesRequest, {"input": "hi"})]  # fmt: skip
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        for path, model, body in apis:
            nulls = {f.alias or name: None for name, f in model.model_fields.items()
                     if not f.is_required() and f.default is not None}  # fmt: skip
            assert {"stream", "n"} <= set(nulls), sorted(nulls)
            r = c.post(path, json={"model": "fake-model", **body, **nulls, "max_tokens": 2,
                                   "max_output_tokens": 2})  # fmt: skip
            assert r.status_code == 200, (path, r.text)
            assert "choices" in r.json() or r.json()["object"] == "response"
    # Where the type takes None, null is a value: completions' max_tokens null is all the
    # room left (the fake engine's 512-token window), not the default 16.
    assert (
        P.CompletionRequest.model_validate({"prompt": "hi", "max_tokens": None}).max_tokens is None
    )
    assert P.CompletionRequest.model_validate({"prompt": "hi"}).max_tokens == 16


def test_ignored_fields_pass_and_unknown_ones_are_logged(fake_server, caplog):
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        body = {"model": "fake-model", "messages": MSGS, "max_tokens": 2}
        for name in IGNORED:
            r = c.post("/v1/chat/completions", json={**body, name: "x"})
            assert r.status_code == 200, (name, r.text)
        with caplog.at_level(logging.WARNING, logger="tinyserve.entrypoints.request_fields"):
            r = c.post("/v1/chat/completions", json={**body, "frobnicate": 1})
        assert r.status_code == 200
        assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize(
    "guided, check",
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}},
                          "required": ["n"], "additionalProperties": False}},
         lambda t: isinstance(json.loads(t)["n"], int)),
        ({"guided_grammar": 'start: "a" ("b" | "c") "d"'}, lambda t: t in ("abd", "acd")),
        # llama.cpp server's top-level keys
        ({"grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
        ({"json_schema": {"type": "object", "properties": {"k": {"enum": ["p", "q"]}},
                          "required": ["k"], "additionalProperties": False}},
         lambda t: json.loads(t)["k"] in ("p", "q")),
    ],
)  # fmt: skip
def test_guided_aliases_constrain_the_output(client, guided, check):
    for path, body in (
        ("/v1/completions", {"prompt": "Answer:", "max_tokens": 40, "seed": 3}),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 40, "seed": 3}),
    ):
        r = client.post(path, json={"model": MODEL, **body, **guided})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert check(text), (guided, text)


def test_guided_and_structured_outputs_together_is_a_400(client):
    body = {"model": MODEL, "prompt": "x", "guided_choice": ["a"],
            "structured_outputs": {"choice": ["b"]}}  # fmt: skip
    err = assert_error(client.post("/v1/completions", json=body), 400, "guided_choice")
    assert "structured_outputs" in err["message"] and "Value error" not in err["message"]
    # Two aliases: named by the first sent (was structured_outputs, which was not sent)
    two = {"model": MODEL, "messages": MSGS, "guided_json": {"type": "object"},
           "guided_regex": "a+"}  # fmt: skip
    err = assert_error(client.post("/v1/chat/completions", json=two), 400, "guided_json")
    assert "guided_regex" in err["message"]
    # An option beside its constraint is no second constraint
    one = {"model": MODEL, "messages": MSGS, "max_tokens": 3, "guided_regex": "a+",
           "guided_whitespace_pattern": " "}  # fmt: skip
    assert client.post("/v1/chat/completions", json=one).status_code == 200

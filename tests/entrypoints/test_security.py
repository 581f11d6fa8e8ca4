"""Attacks a public endpoint meets, each answered with a 4xx before any work (issue 37): the API
key on every route (those the app has and those it does not), opt-outs only by the
operator's flags."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.api import assert_error
from tinyserve.config import ServerConfig
from tinyserve.entrypoints.api_server import API_KEY_ENV, server_config_from_namespace
from tinyserve.entrypoints.cli import build_parser
from tinyserve.testing.schemas import ref_chain, rule_chain

KEY = "sekret-4711"


def test_with_a_key_unknown_paths_and_other_schemes_get_401(fake_server):
    """Every route: test_http_errors.py walks the app's routes. Here what is not a route: no
    404 tells a caller without the key which paths exist; a Basic or empty scheme is no key."""
    with fake_server(api_key=KEY) as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        assert_error(c.get("/v1/secret-admin"), 401)
        assert_error(c.get("/metrics", headers={"Authorization": f"Basic {KEY}"}), 401)
        assert_error(c.get("/metrics", headers={"Authorization": "Bearer"}), 401)
        assert_error(
            c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer x"}), 401
        )
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/secret-admin", headers=auth).status_code == 404
        assert_error(c.post("/v1/chat/completions", json={}, headers=auth), 400)  # then checked
        assert c.get("/metrics", headers=auth).status_code == 200


@pytest.mark.parametrize(
    "options,open_paths",
    [({"metrics_no_key": True}, {"/health", "/metrics", "/", "/playground/app.js"}),
     ({"open_routes": ("/metrics",)}, {"/metrics"}),
     ({"open_routes": ()}, set())],
)  # fmt: skip
def test_routes_are_opened_only_by_the_operator(fake_server, options, open_paths):
    with fake_server(api_key=KEY, server_options=options) as s:
        with httpx.Client(base_url=s.base_url, timeout=30) as c:
            for path in ("/health", "/metrics", "/", "/tokenize", "/playground/app.js"):
                r = c.get(path) if path != "/tokenize" else c.post(path, json={})
                assert (r.status_code != 401) == (path in open_paths), (path, r.status_code)


def test_without_a_key_nothing_asks_for_one(fake_server):
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        for path in ("/metrics", "/health", "/v1/models", "/openapi.json"):
            assert c.get(path).status_code == 200, path


def test_open_route_flags(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def config(*args: str) -> ServerConfig:
        return server_config_from_namespace(build_parser().parse_args(["serve", *args]))

    assert config().routes_without_key == ("/health", "/", "/playground/*")
    assert config("--metrics-no-key").routes_without_key[-1] == "/metrics"
    assert config("--open-routes", "/metrics, /health").open_routes == ("/metrics", "/health")
    assert config("--metrics-require-key").routes_without_key == ServerConfig().open_routes
    for bad in ("/*", "metrics", "/a*b"):
        with pytest.raises(ValueError, match="open_routes"):
            config("--open-routes", bad)


REDOS = "^(?:a{1000}){1000}$"  # a million states once unrolled: it failed mid-answer with a 500


@pytest.mark.parametrize(
    "extra,param",
    [({"structured_outputs": {"regex": REDOS}}, "structured_outputs"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"a": {"type": "string", "pattern": REDOS}}}}}},
      "response_format"),
     ({"structured_outputs": {"json": {"type": "object", "patternProperties": {
         "(?:x{300}){300}": {"type": "string"}}}}}, "structured_outputs"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"q": {"type": "string", "pattern": REDOS}}}}}],
       "tool_choice": "required"}, "tools")],
)  # fmt: skip
def test_regexes_that_blow_up_are_a_400_before_any_token(fake_server, extra, param):
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
        err = assert_error(c.post("/v1/chat/completions", json=body), 400, param)
        assert "states" in err["message"] and "limit" in err["message"]
        assert s.engine.num_steps == 0  # refused before it reached the engine
        assert c.get("/health").status_code == 200


def test_regex_size_estimate():
    from tinyserve.utils.regex_size import MAX_REGEX_STATES, regex_states

    assert regex_states(REDOS) > 10 * MAX_REGEX_STATES
    assert regex_states("((a{10}){10}){10}") == 1000
    # What people send stays far below the limit.
    for pattern in (r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]{1,64}", r"(?:[a-z]+\.){2,3}com",
                    r"\p{L}{3,8}", r"[\]\[]{5}", r"^\+?[0-9 ()-]{7,20}$", r".{0,5000}"):  # fmt: skip
        assert regex_states(pattern) <= 5000, pattern


def test_a_regex_that_is_not_a_string_is_refused_by_name():
    """Sized only once it is known to be a string (an int once raised a TypeError there)."""
    from tinyserve.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(ValueError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{")


def test_grammars_that_crashed_the_server_are_served(client):
    """A 3,000-rule Lark chain and a 1,000-$ref schema (49 and 75 KB) overflowed the compile
    thread's stack inside the grammar library and killed the server (issue 37; the premise is
    checked in tests/structured/test_sandbox.py). Now compiled with room, in a sandbox first."""
    bodies = [{"structured_outputs": {"grammar": rule_chain(3000)}},
              {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "chain", "schema": ref_chain(1000)}}}]  # fmt: skip
    for extra in bodies:
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 6}
        r = client.post("/v1/chat/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        assert client.get("/health").status_code == 200
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith('{"x"') or text.startswith("{")


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "extra,words",
    [({"structured_outputs": {"grammar": 'start: "a"' + ' | "b"' * 60_000}}, ["grammar", "256,000"]),
     ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"enum": ["x" * 300_000]}}}}},
      ["JSON schema", "256,000"]),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {
         "type": "array", "items": json.loads("[" * 120 + "]" * 120)}}}}, ["nests", "at most 100"]),
     # a tool's parameters: a 500 (the envelope's size check was not caught)
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(60)}}]},
      ["nests", "at most 100"]),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 1000}
                                         for i in range(300)}}}}]}, ["JSON schema", "256,000"])],
)  # fmt: skip
def test_specs_past_the_size_limits_are_a_400_naming_the_limit(fake_server, extra, words):
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
        err = assert_error(c.post("/v1/chat/completions", json=body), 400, next(iter(extra)))
        assert all(w in err["message"] for w in words), err["message"]
        assert s.engine.num_steps == 0


def test_a_grammar_past_the_parser_limit_is_a_400_and_the_server_goes_on(client):
    """A Lark rule of 3,000 alternatives compiles, then the parser refuses the first token its
    own mask allowed (over 2,000 Earley items in a row): that was a 500 mid-answer; it is the
    request's fault, a 400 naming its field (an error event when streamed)."""
    words = " | ".join(f'"w{i}"' for i in range(3000))
    body = {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 8,
            "structured_outputs": {"grammar": f"start: {words}"}}  # fmt: skip
    err = assert_error(client.post("/v1/chat/completions", json=body, timeout=120), 400,
                       "structured_outputs")  # fmt: skip
    assert "too complex" in err["message"] and "2000" in err["message"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-2][6:])["error"]
    assert error["param"] == "structured_outputs" and "too complex" in error["message"]
    assert events[-1] == "data: [DONE]"
    # The same words as a choice list are one terminal: served.
    choice = {**body, "structured_outputs": {"choice": [f"w{i}" for i in range(3000)]}}
    r = client.post("/v1/chat/completions", json=choice, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in choice[
        "structured_outputs"]["choice"]  # fmt: skip

"""Attacks a public endpoint meets, each answered with a 4xx before any work (issue 37): the API
key on every route (those the app has and those it does not), opt-outs only by the
operator's flags."""

from __future__ import annotations

import httpx
import pytest
from test_http_errors import assert_error

from tinyserve.config import ServerConfig
from tinyserve.entrypoints.api_server import API_KEY_ENV, server_config_from_namespace
from tinyserve.entrypoints.cli import build_parser

KEY = "sekret-4711"


def test_with_a_key_unknown_paths_and_other_schemes_get_401(fake_server):
    """Every route: test_http_errors.py walks the app's routes. Here what is not a route: no
    404 tells a caller without the key which paths exist; a Basic or empty scheme is no key."""
    with fake_server(api_key=KEY) as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        assert_error(c.get("/v1/secret-admin"), 401)
        assert_error(c.get("/metrics", headers={"Authorization": f"Basic {KEY}"}), 401)
        assert_error(c.get("/metrics", headers={"Authorization": "Bearer"}), 401)
        assert_error(c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer x"}), 401)
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

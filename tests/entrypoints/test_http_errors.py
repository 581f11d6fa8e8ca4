"""Every bad input gets its 4xx and the OpenAI error shape; the server stays healthy."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support.api import MODEL, WEATHER, assert_error
from tinyserve.entrypoints.api_server import API_KEY_ENV, server_config_from_namespace
from tinyserve.entrypoints.cli import build_parser
from tinyserve.testing.server import wait_until
from tinyserve.testing.sse import iter_data, sse_events

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}


BAD_REQUESTS = [
    (CHAT, {"model": MODEL}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "-"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "-"),
    (CHAT, {"messages": MSGS, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MSGS, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSGS, "min_p": 2}, "min_p"),
    (CHAT, {"messages": MSGS, "n": 0}, "n"),
    (CHAT, {"messages": MSGS, "n": 1000}, "n"),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    # the field the request sent (the SDK sends max_completion_tokens): max_tokens before
    (CHAT, {"messages": MSGS, "max_completion_tokens": -5}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 9000}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 9000}, "max_tokens"),
    # too long for the context: chat has no prompt field (named prompt before)
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hello " * 9000}], "max_tokens": 5},
        "messages",
    ),
    # the Responses API in its own words: its prompt field is its own (named input before),
    # and max_tokens inside min_tokens' message is max_output_tokens
    ("/v1/responses", {"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ("/v1/responses", {"input": "hello " * 9000}, "input"),
    (CHAT, {"messages": MSGS, "presence_penalty": 5}, "presence_penalty"),
    (CHAT, {"messages": MSGS, "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": MSGS, "logit_bias": {"abc": 1}}, "logit_bias"),
    (CHAT, {"messages": MSGS, "logit_bias": {"99999999": 1}}, "logit_bias"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "stop": [""]}, "stop"),
    (CHAT, {"messages": MSGS, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    (CHAT, {"messages": MSGS, "stream_options": {"include_usage": "maybe"}}, "-"),
    (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSGS, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0]"),  # rendered as an empty turn
    (CHAT, {"messages": [{"role": "system", "content": None}, *MSGS]}, "messages[0]"),
    # a union's branches: the deepest error, the branch names out ("content.str" before)
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
    ),
    # A grammar the library refuses names its field (param was null).
    (
        CHAT,
        {
            "messages": MSGS,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {"properties": {"a": {"$ref": "#/$defs/No"}}},
                },
            },
        },
        "response_format",
    ),
    (CHAT, {"messages": MSGS, "tools": [TOOL, TOOL]}, "tools"),  # which would a call mean?
    # Named by the parameters' own ref, not the envelope's relocated one ('t0__No').
    (
        CHAT,
        {
            "messages": MSGS,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"a": {"$ref": "#/$defs/No"}}},
                    },
                }
            ],
        },
        "tools",
    ),
    (COMP, {}, "prompt"),
    (COMP, {"prompt": []}, "prompt"),
    (COMP, {"prompt": ""}, "prompt"),
    (COMP, {"prompt": [1, -2]}, "prompt"),
    (COMP, {"prompt": [10**9]}, "prompt"),
    (COMP, {"prompt": ["a", 1]}, "-"),
    (COMP, {"prompt": "hi", "logprobs": 50}, "logprobs"),
    (COMP, {"prompt": "hi", "seed": "x"}, "seed"),
    (COMP, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (COMP, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "-"),  # was token 1
    (COMP, {"prompt": [[1], [2.0]]}, "-"),  # was token 2
    (CHAT, {"messages": MSGS, "stop_token_ids": [True]}, "-"),
    ("/tokenize", {}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_values_are_400(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param)
    assert client.get("/health").status_code == 200


def test_malformed_bodies_are_400(client):
    json_header = {"content-type": "application/json"}
    err = assert_error(client.post(CHAT, content=b"{not json", headers=json_header), 400)
    assert "JSON" in err["message"]
    assert_error(client.post(CHAT, json=[1, 2]), 400)
    assert_error(client.post(COMP, content=b"", headers={"content-type": "application/json"}), 400)


def test_context_window_overflow_names_both_numbers(client, server):
    max_len = server.async_engine.max_model_len
    r = client.post(COMP, json={"prompt": [1, 2, 3], "max_tokens": max_len})
    err = assert_error(r, 400, "max_tokens")
    assert str(max_len) in err["message"] and "3 tokens" in err["message"]
    r = client.post(COMP, json={"prompt": [1] * (max_len + 5)})
    assert str(max_len) in assert_error(r, 400, "prompt")["message"]


def test_unknown_model_is_404(client):
    err = assert_error(client.post(CHAT, json={"model": "gpt-9", "messages": MSGS}), 404, "model")
    assert "gpt-9" in err["message"]


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get(CHAT), 405)


def test_unknown_fields_ignored_and_health_still_ok(client):
    r = client.post(COMP, json={"prompt": "hi", "max_tokens": 2, "frobnicate": True, "best_of": 1})
    assert r.status_code == 200
    assert client.get("/health").status_code == 200


def test_tokenize_detokenize_roundtrip(client, server):
    r = client.post("/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == server.async_engine.max_model_len
    r = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json()["prompt"] == "Hello world"
    chat = client.post("/tokenize", json={"messages": MSGS}).json()
    assert chat["count"] > body["count"]
    # A chat with tools counts what a chat completion with them prompts (the template or
    # tools.py renders them), and return_token_strs gives each id's token string.
    tools = [WEATHER]
    with_tools = client.post("/tokenize", json={"messages": MSGS, "tools": tools}).json()
    done = client.post(CHAT, json={"messages": MSGS, "tools": tools, "max_tokens": 1}).json()
    assert with_tools["count"] == done["usage"]["prompt_tokens"] > chat["count"]
    # tool_choice renders the prompt too ("You must call a function.", or no tools): ignored
    # by /tokenize before, 100 tokens for chat's 93 (required) and 31 (none)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", "none", named):
        asked = {"messages": MSGS, "tools": tools, "tool_choice": choice}
        counted = client.post("/tokenize", json=asked).json()["count"]
        done = client.post(CHAT, json={**asked, "max_tokens": 1}).json()
        assert counted == done["usage"]["prompt_tokens"], choice
    strs = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    want = server.engine.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert strs.json()["token_strs"] == want and body["token_strs"] is None
    for bad in (
        {"prompt": "hi", "tools": tools},
        {"prompt": "hi", "tool_choice": "required"},
        {"messages": MSGS, "continue_final_message": True},
    ):
        name = next(n for n in ("tools", "tool_choice", "continue_final_message") if n in bad)
        assert_error(client.post("/tokenize", json=bad), 400, name)


def test_openapi_schema_describes_requests(client):
    schema = client.get("/openapi.json").json()
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_tokens", "temperature", "stream_options", "logprobs"} <= set(props)


# -- servers over the fake engine: auth, 429, dead engine, one request failing ---------------


def test_api_key(fake_server):
    with fake_server(api_key="s3cret") as s:
        body = {"prompt": "hi", "max_tokens": 2}
        err = assert_error(httpx.post(s.url(COMP), json=body), 401)
        assert err["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer nope"}
        assert_error(httpx.post(s.url(COMP), json=body, headers=wrong), 401)
        assert_error(httpx.get(s.url("/v1/models")), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(s.url(COMP), json=body, headers=good).status_code == 200
        assert httpx.get(s.url("/health")).status_code == 200
        with openai.OpenAI(base_url=s.url("/v1"), api_key="s3cret", max_retries=0) as c:
            assert c.completions.create(model="fake-model", prompt="hi", max_tokens=2).choices
        with openai.OpenAI(base_url=s.url("/v1"), api_key="bad", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()


def test_api_key_guards_every_route_but_health_and_the_page(fake_server):
    """/metrics included (issue 37: it was open under a key); test_security.py: the flags."""
    from starlette.routing import Route

    def all_routes(routes):  # FastAPI keeps an included router's routes on the router
        for r in routes:
            inner = getattr(r, "original_router", None)
            yield from all_routes(inner.routes) if inner is not None else [r]

    with fake_server(api_key="s3cret") as s:
        checked = []
        for route in all_routes(s.app.routes):
            if not isinstance(route, Route):
                continue
            for method in sorted(route.methods - {"HEAD"}):
                r = httpx.request(method, s.url(route.path), json={})
                if route.path in ("/health", "/"):
                    assert r.status_code == 200, (method, route.path)
                elif route.path == "/playground/{name}":  # the page's files: no key, no such file
                    assert_error(r, 404)
                elif route.path.startswith("/v1/messages"):  # Anthropic's API, its error shape
                    assert r.status_code == 401
                    assert r.json()["error"]["type"] == "authentication_error"
                    checked.append(f"{method} {route.path}")
                else:
                    assert_error(r, 401)
                    checked.append(f"{method} {route.path}")
        assert {"POST /v1/chat/completions", "GET /openapi.json", "GET /docs",
                "POST /v1/responses", "GET /v1/responses/{response_id}", "POST /v1/messages",
                "POST /v1/messages/count_tokens"} <= set(checked)  # fmt: skip
        assert {"GET /v1/engine/events", "GET /v1/engine/snapshot", "GET /metrics"} <= set(checked)
        assert len(checked) == 15, checked  # GET /v1/models/{model_id:path} among them
        good = {"Authorization": "Bearer s3cret"}
        schema = httpx.get(s.url("/openapi.json"), headers=good).json()
        assert "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
        assert "swagger" in httpx.get(s.url("/docs"), headers=good).text.lower()


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    ns = build_parser().parse_args(["serve"])
    assert server_config_from_namespace(ns).api_key == "from-env"
    ns = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert server_config_from_namespace(ns).api_key == "flag"


def test_queue_full_is_429(fake_server):
    with fake_server(max_queued_requests=1, max_num_seqs=1, step_delay=0.01) as s:
        body = {"prompt": "hi", "max_tokens": 400, "stream": True}
        with httpx.Client(base_url=s.base_url, timeout=10) as c:
            with c.stream("POST", COMP, json=body) as r1, c.stream("POST", COMP, json=body) as r2:
                assert r1.status_code == r2.status_code == 200  # one running, one waiting
                r = httpx.post(s.url(COMP), json={"prompt": "hi", "max_tokens": 2})
                err = assert_error(r, 429)
                assert r.headers["retry-after"] == "1" and err["code"] == "queue_full"
        # One request fanning out past running + waiting together: a 400 on an idle server.
        err = assert_error(httpx.post(s.url(COMP), json={"prompt": ["a", "b", "c"]}), 400)
        assert "at most 2 at once" in err["message"]
        assert httpx.get(s.url("/health")).status_code == 200


def test_one_failing_request_fails_alone(fake_server):
    with fake_server() as s:
        failing = {"prompt": [13, 14], "max_tokens": 4}
        err = assert_error(httpx.post(s.url(COMP), json=failing), 500)
        assert "fake failure" in err["message"]
        with httpx.stream("POST", s.url(COMP), json={**failing, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert "fake failure" in json.loads(events[-2])["error"]["message"]
        ok = httpx.post(s.url(COMP), json={"prompt": [14], "max_tokens": 3})
        assert ok.json()["choices"][0]["text"] == "t0 t1 t2 "
        assert httpx.get(s.url("/health")).status_code == 200


def test_dead_engine_is_503(fake_server):
    with fake_server(step_delay=0.01) as s:
        body = {"prompt": "hi", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", s.url(COMP), json=body, timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            s.engine.explode = True
            t0 = time.monotonic()
            dead = wait_until(lambda: httpx.get(s.url("/health")).status_code == 503, 1.0)
            assert dead and time.monotonic() - t0 < 1.0  # within a second of the thread dying
            rest = list(iter_data(lines))
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
        assert_error(httpx.get(s.url("/health")), 503)
        assert_error(httpx.post(s.url(COMP), json={"prompt": "hi"}), 503)
        metrics = httpx.get(s.url("/metrics")).text
        assert 'tinyserve:engine_healthy{model_name="fake-model"} 0.0' in metrics


def test_body_over_max_request_bytes_is_413(fake_server):
    """Both with a Content-Length header and with a chunked body of unknown length."""
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        limit = s.app.state.max_request_bytes
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (limit + 10)}]})
        r = c.post(CHAT, content=big, headers={"Content-Type": "application/json"})
        err = assert_error(r, 413)
        assert str(limit) in err["message"]

        def chunks():
            for i in range(0, len(big), 65536):
                yield big[i : i + 65536].encode()

        r = c.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
        assert assert_error(r, 413)["code"] == err["code"] == "request_too_large"
        # A body under the limit still works, and the server stays healthy.
        ok = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert c.get("/health").status_code == 200


def test_max_request_bytes_flag(fake_server, monkeypatch):
    ns = build_parser().parse_args(["serve", "--max-request-bytes", "2048"])
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert server_config_from_namespace(ns).max_request_bytes == 2048
    with pytest.raises(ValueError, match="max_request_bytes"):
        server_config_from_namespace(
            build_parser().parse_args(["serve", "--max-request-bytes", "1"])
        )


@pytest.mark.parametrize("log_requests", [False, True])
def test_prompts_and_key_stay_out_of_logs(fake_server, caplog, log_requests):
    """Prompts are logged only with --log-requests; the API key never is."""
    secret_prompt = "my-private-prompt-4711"
    opts = {"log_requests": log_requests}
    with caplog.at_level("DEBUG"), fake_server(api_key="sekret-key-99", server_options=opts) as s:
        with httpx.Client(base_url=s.base_url, timeout=30) as c:
            headers = {"Authorization": "Bearer sekret-key-99"}
            body = {"messages": [{"role": "user", "content": secret_prompt}], "max_tokens": 2}
            assert c.post(CHAT, json=body, headers=headers).status_code == 200
            assert (
                c.post(CHAT, json=body, headers={"Authorization": "Bearer wrong"}).status_code
                == 401
            )
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "sekret-key-99" not in text and "wrong" not in text
    assert (secret_prompt in text) == log_requests


def test_a_lone_surrogate_in_a_tools_description_is_its_fields_400(client):
    """The tools' models did not check their strings: the template failed on it, a 400
    blamed on messages ("TextEncodeInput must be Union[...]")."""
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "x Y y"}}],
    }
    raw = json.dumps(body).replace("x Y y", "x \\ud83d y")  # the escape, as JSON sends it
    r = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, "tools[0].function.description")
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("args, field", [('{"a": "x Y y"}', "arguments"), ('"x Y y"', "arguments"),
                                         ("{}", "name")])  # fmt: skip
def test_a_lone_surrogate_in_a_past_call_is_its_fields_400(client, args, field):
    """A past call's arguments go into the prompt as sent: a lone surrogate there failed the
    template (a 400 blamed on messages, "TextEncodeInput must be Union[...]")."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "x Y y" if field == "name" else "f", "arguments": args}}  # fmt: skip
    body = {"model": MODEL, "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}  # fmt: skip
    raw = json.dumps(body).replace("x Y y", "x \\ud83d y")
    r = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, f"messages[1].tool_calls[0].function.{field}")
    assert "surrogate" in err["message"]


def test_errors_speak_the_apis_words(client):
    """min_tokens' message names max_output_tokens on the Responses API and
    max_completion_tokens where chat sent it (max_tokens before: neither request's field)."""
    r = client.post("/v1/responses", json={"input": "hi", "min_tokens": 50,
                                           "max_output_tokens": 10})  # fmt: skip
    err = assert_error(r, 400, "min_tokens")
    assert "max_output_tokens (10)" in err["message"] and "max_tokens" not in err["message"]
    r = client.post(CHAT, json={"messages": MSGS, "min_tokens": 50, "max_completion_tokens": 10})
    assert "max_completion_tokens (10)" in assert_error(r, 400, "min_tokens")["message"]
    long = [{"role": "user", "content": "hello " * 9000}]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": long})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: ")

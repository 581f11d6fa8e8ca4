"""vLLM's options of ``structured_outputs`` (issue 39: no field silently ignored): before,
``disable_any_whitespace``, ``whitespace_pattern`` and ``disable_additional_properties``
were dropped without a word and ``guided_whitespace_pattern`` was a 400. Now each shapes the
JSON answer (checked on the grammar and on real answers), and a key vLLM does not define
is a 400 naming it."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.api import MODEL, assert_error
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.api_server import server_config_from_namespace
from tinyserve.entrypoints.cli import build_parser
from tinyserve.entrypoints.protocol import StructuredOutputsField
from tinyserve.entrypoints.serving import OpenAIServing, response_format
from tinyserve.entrypoints.structured_options import with_json_options
from tinyserve.entrypoints.tools import TOOL_JSON_OPTIONS
from tinyserve.sampling_params import StructuredOutputsParams
from tinyserve.structured.backend import GrammarBackend
from tinyserve.structured.schema_approx import final_check, needs_final_check
from tinyserve.structured.spec import StructuredOutputSpec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer",
                   "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
}  # fmt: skip
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def _options(**kw) -> StructuredOutputsField:
    return StructuredOutputsField(**kw)


def _takes(backend, schema, text: str, tokenizer) -> bool:
    m = backend.matcher(backend.compile(StructuredOutputSpec.json_schema(schema)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.accept_tokens(ids) and m.accept_tokens([backend.eos_token_ids[0]])


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    return GrammarBackend(smollm2_tokenizer, len(smollm2_tokenizer))


def test_options_reach_the_grammar(backend, smollm2_tokenizer):
    """Each option changes what the compiled grammar takes, against the default layout."""
    plain = StructuredOutputsParams(json=SCHEMA)
    spaced, tight = '{"name": "ab", "n": 5}', '{"name":"ab","n":5}'
    extra = '{"name": "ab", "n": 5, "x": 1}'
    assert _takes(backend, plain.json, spaced, smollm2_tokenizer)
    assert _takes(backend, plain.json, extra, smollm2_tokenizer)  # the schema allows others

    none = with_json_options(plain, _options(disable_any_whitespace=True)).json
    assert _takes(backend, none, tight, smollm2_tokenizer)
    assert not _takes(backend, none, spaced, smollm2_tokenizer)

    # The library makes each gap's whitespace optional: the pattern says what it may be.
    lines = with_json_options(plain, _options(whitespace_pattern="\n")).json
    assert _takes(backend, lines, '{\n"name"\n:\n"ab"\n,\n"n"\n:\n5\n}', smollm2_tokenizer)
    assert _takes(backend, lines, tight, smollm2_tokenizer)
    assert not _takes(backend, lines, spaced, smollm2_tokenizer)

    closed = with_json_options(plain, _options(disable_additional_properties=True)).json
    assert _takes(backend, closed, spaced, smollm2_tokenizer)
    assert not _takes(backend, closed, extra, smollm2_tokenizer)


def test_json_object_and_a_schemas_own_layout():
    """json_object becomes the object schema in the asked layout; a schema's own
    x-guidance keys win; a regex defines its own whitespace and is left as it is, and so is
    a boolean schema (it raised AttributeError, a 500, before)."""
    out = with_json_options(StructuredOutputsParams(json_object=True),
                            _options(disable_any_whitespace=True))  # fmt: skip
    assert out.json_object is None and out.json["type"] == "object"
    assert out.json["x-guidance"]["whitespace_flexible"] is False
    own = {**SCHEMA, "x-guidance": {"item_separator": ", "}}
    out = with_json_options(StructuredOutputsParams(json=json.dumps(own)),
                            _options(disable_any_whitespace=True))  # fmt: skip
    assert out.json["x-guidance"]["item_separator"] == ", "
    assert out.json["x-guidance"]["whitespace_flexible"] is False
    regex = StructuredOutputsParams(regex="[a-z]+")
    assert with_json_options(regex, _options(disable_any_whitespace=True)) is regex
    anything = StructuredOutputsParams(json="true")  # a boolean schema: nothing to shape
    assert with_json_options(anything, _options(disable_any_whitespace=True)) is anything


def _outside_strings(text: str) -> str:
    return STRINGS.sub('""', text)


def test_served_answers_follow_the_options(client):
    """Real answers of the default model: no whitespace at all; newlines only (guided_*
    aliases); and options alone shaping a response_format schema. The default layout is
    '", "' and '": "' (structured/backend.py), so each check fails where the option is
    dropped."""
    msgs = [{"role": "user", "content": "Give a name and a number as JSON."}]
    base = {"model": MODEL, "messages": msgs, "max_tokens": 80, "temperature": 0}
    closed = {**SCHEMA, "additionalProperties": False}
    cases = [
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                                 "disable_additional_properties": True}}, "none"),
        ({"guided_json": closed, "guided_whitespace_pattern": "\n"}, "newlines"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
          "schema": SCHEMA}}, "structured_outputs": {"disable_any_whitespace": True}}, "none"),
    ]  # fmt: skip
    for extra, layout in cases:
        r = client.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        text = choice["message"]["content"]
        value = json.loads(text)
        assert set(value) == {"name", "n"}, text
        gaps = _outside_strings(text)
        assert " " not in gaps, text
        if layout == "none":
            assert not re.search(r"\s", gaps), text


def test_options_at_their_defaults_beside_a_response_format(client):
    """A client that writes every field sends the options at their defaults: that was a 400
    ("give exactly one of json, ...", no mode); it is the response format alone. An empty
    structured_outputs is still a 400 (no constraint and no option)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "JSON."}],
            "max_tokens": 40, "temperature": 0, "response_format": fmt}  # fmt: skip
    alone = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    for options in ({"disable_any_whitespace": False}, {"disable_additional_properties": False},
                    {"whitespace_pattern": None, "disable_fallback": False}):  # fmt: skip
        r = client.post("/v1/chat/completions", json={**body, "structured_outputs": options})
        assert r.status_code == 200, (options, r.text)
        assert r.json()["choices"][0]["message"] == alone["message"], options
    r = client.post("/v1/chat/completions", json={**body, "structured_outputs": {}})
    assert r.status_code == 400


def test_llama_cpps_json_object_with_a_schema(client):
    """llama.cpp's server takes ``response_format: {"type": "json_object", "schema": ...}``:
    the schema is followed (it was dropped: any JSON object came back)."""
    schema = {"type": "object", "properties": {"color": {"enum": ["teal", "plum"]}},
              "required": ["color"]}  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A color as JSON."}],
            "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_object", "schema": schema}}  # fmt: skip
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"]) in ({"color": "teal"}, {"color": "plum"})


def test_a_clients_whitespace_pattern_is_checked_on_the_answer(client, smollm2_tokenizer):
    """A client's pattern may match more than JSON's whitespace: such an answer is parsed
    and validated before it is sent. With "x" allowed in the gaps and pushed by logit_bias,
    the answer is not JSON: a 400 naming the field, not a 200."""
    lax = with_json_options(StructuredOutputsParams(json=SCHEMA),
                            _options(whitespace_pattern="x")).json  # fmt: skip
    assert needs_final_check(json.dumps(lax)) and not needs_final_check(json.dumps(SCHEMA))
    assert final_check(json.dumps(lax), '{"name":"ab","n":5}') is None
    assert "not JSON" in final_check(json.dumps(lax), '{x"name":"ab","n":5}')
    odd = {**SCHEMA, "x-guidance": {"item_separator": "x", "whitespace_flexible": True}}
    assert needs_final_check(json.dumps(odd))
    for safe in (
        TOOL_JSON_OPTIONS,
        {"coerce_one_of": True, "whitespace_flexible": True},
        with_json_options(
            StructuredOutputsParams(json=SCHEMA), _options(disable_any_whitespace=True)
        ).json["x-guidance"],
    ):
        assert not needs_final_check(json.dumps({**SCHEMA, "x-guidance": safe})), safe
    (x,) = smollm2_tokenizer.encode("x", add_special_tokens=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "JSON please."}],
            "max_tokens": 60, "temperature": 0, "logit_bias": {str(x): 100},
            "structured_outputs": {"json": {**SCHEMA, "additionalProperties": False},
                                   "whitespace_pattern": "x"}}  # fmt: skip
    err = assert_error(client.post("/v1/chat/completions", json=body), 400, "structured_outputs")
    assert "not JSON" in err["message"], err


@pytest.mark.parametrize(
    "so, param, words",
    [
        ({"json": SCHEMA, "frob": 1}, "structured_outputs.frob", "Extra inputs"),
        ({"structural_tag": {"type": "x"}}, "structured_outputs.structural_tag", "not supported"),
        ({"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": " "},
         "structured_outputs.whitespace_pattern", "not both"),
        ({"json": SCHEMA, "whitespace_pattern": "(?:a{1000}){1000}"},
         "structured_outputs.whitespace_pattern", "states"),
        ({"json": SCHEMA, "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern",
         "non-empty"),
        ({}, "structured_outputs", "exactly one"),
    ],
)  # fmt: skip
def test_bad_options_are_400s_naming_them(fake_server, so, param, words):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "structured_outputs": so}  # fmt: skip
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        err = assert_error(c.post("/v1/chat/completions", json=body), 400, param)
        assert words in err["message"], err
        # options alone with no JSON to shape change nothing: a plain answer
        plain = {**body, "structured_outputs": {"disable_any_whitespace": True}}
        assert c.post("/v1/chat/completions", json=plain).status_code == 200
        # beside tools (written on one line whatever they ask) they are a 400, not dropped
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        err = assert_error(c.post("/v1/chat/completions", json={**plain, "tools": [tool]}),
                           400, "tools")  # fmt: skip
        assert "structured_outputs" in err["message"]


def test_the_servers_pretty_layout(backend, smollm2_tokenizer):
    """`tinyserve serve --json-pretty`: a JSON constraint without a layout of the request's
    own may be pretty-printed within bounds (by default: one line); a request's layout wins;
    a regex stays as it is."""
    ns = build_parser().parse_args(["serve", "--json-pretty"])
    assert server_config_from_namespace(ns).json_pretty
    assert not server_config_from_namespace(build_parser().parse_args(["serve"])).json_pretty
    engine = type("E", (), {"tokenizer": smollm2_tokenizer})()
    pretty, default = OpenAIServing(engine, "m", json_pretty=True), OpenAIServing(engine, "m")
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    req = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], response_format=fmt)
    spaced, indented = '{"name": "ab", "n": 5}', '{\n  "name": "ab",\n  "n": 5\n}'
    for serving, takes_indented in ((pretty, True), (default, False)):
        params = serving.constraint(req, response_format(req), "response_format", [])
        assert _takes(backend, params.json, spaced, smollm2_tokenizer)
        assert _takes(backend, params.json, indented, smollm2_tokenizer) is takes_indented
    own = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                  structured_outputs={"json": SCHEMA, "whitespace_pattern": "\n"})  # fmt: skip
    params = pretty.constraint(own, None, "response_format", [])
    assert not _takes(backend, params.json, spaced, smollm2_tokenizer)  # its own: no spaces
    assert not needs_final_check(json.dumps(pretty.constraint(req, response_format(req),
                                 "response_format", []).json))  # fmt: skip
    regex = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                    structured_outputs={"regex": "[a-z]+"})  # fmt: skip
    assert pretty.constraint(regex, None, "response_format", []).regex == "[a-z]+"

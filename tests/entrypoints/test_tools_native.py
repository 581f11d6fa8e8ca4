"""Tool calling with a template that supports tools (Hermes / Qwen2.5 style): the template
renders the tools and past calls, forced calls come out as grammar-enforced ``<tool_call>``
blocks that parse and validate, and the parsers read Hermes blocks and Llama-3 JSON calls.
The model is a 2-layer random Llama with SmolLM2's tokenizer and this template."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest

from tests.support.api import same_when_streamed
from tests.support.structured import allowed_ids
from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.tool_formats import hermes_grammar
from tinyserve.structured.backend import GrammarBackend
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.testing.server import serve

HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Return each call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def hermes_server(smollm2_gguf_path, tmp_path_factory):
    from tinyserve.models.default_model import tokenizer_dir_for
    from tinyserve.testing.checkpoints import build_fuzz_model

    path = build_fuzz_model(
        tmp_path_factory.mktemp("hermes") / "m", tokenizer_dir_for(smollm2_gguf_path)
    )
    cfg = path / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": HERMES}))
    (path / "chat_template.jinja").write_text(HERMES)  # transformers 5 reads this one first
    # Speculation off: the formats' streams are checked token by token (a verified draft run
    # would send a short call's arguments in one fragment).
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", num_blocks=256,
                                  speculative_config=None))  # fmt: skip
    assert T.hermes_template(engine.tokenizer)
    with serve(AsyncEngine(engine), ServerConfig()) as s:
        yield s


def test_template_renders_tools_and_past_calls(hermes_server):
    from tinyserve.entrypoints import protocol as P

    serving = hermes_server.app.state.serving_chat
    call = T.ToolCall(
        id="call_1", function=T.FunctionCall(name="get_weather", arguments='{"city": "Oslo"}')
    )
    messages = [
        P.ChatMessage(role="user", content="Weather in Oslo?"),
        P.ChatMessage(role="assistant", content=None, tool_calls=[call]),
        P.ChatMessage(role="tool", content='{"temp": 3}', tool_call_id="call_1"),
    ]
    tools = [T.Tool.model_validate(WEATHER)]
    text = serving.tokenizer.decode(serving.chat_prompt_ids(messages, True, tools, "auto"))
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert '<tool_response>\n{"temp": 3}' in text


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_are_hermes_blocks_that_validate(hermes_server, parallel):
    finished = 0
    with openai.OpenAI(base_url=hermes_server.url("/v1"), api_key="x", max_retries=0) as c:
        for seed in range(3):
            r = c.chat.completions.create(
                model=hermes_server.async_engine.info.model_name,
                messages=[{"role": "user", "content": "Weather and time?"}],
                tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel,
                max_tokens=200, temperature=1.0, seed=seed,
            )  # fmt: skip
            choice = r.choices[0]
            if choice.finish_reason == "length":
                continue  # a random model may fill max_tokens inside a string
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                jsonschema.validate(
                    json.loads(call.function.arguments), spec["function"]["parameters"]
                )
            finished += 1
    assert finished  # JSON whitespace is bounded: calls end well within max_tokens


def test_native_parsers():
    content, calls = T.parse_native(
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert content == "Sure." and [c.function.name for c in calls] == ["a", "b"]
    assert [c.function.arguments for c in calls] == ['{"x": 1}', "{}"]  # the text as generated
    # Text outside the blocks is content: the grammar makes every call a <tool_call> block.
    bare = '{"name": "f", "parameters": {"q": "z"}}'
    assert T.parse_native(bare) == (bare, [])
    assert T.parse_native("plain text") == ("plain text", [])
    assert T.parse_native("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )


def _matcher(tokenizer, choice, parallel=True):
    backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer))
    grammar = hermes_grammar([T.Tool.model_validate(t) for t in (WEATHER, TIME)], choice,
                               parallel)  # fmt: skip
    compiled = backend.compile(StructuredOutputSpec("grammar", grammar, "tools"))
    return backend, lambda: backend.matcher(compiled)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("text, eos, parallel, ok", [
    ("Just text, <tool> and <tool_ca", True, True, True),
    ("Let me look. " + CALL, True, True, True),
    (CALL + "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Oslo"', '"tz": "UTC"'),
     True, True, True),
    (CALL + "\n" + CALL, False, False, False),  # parallel_tool_calls=false: one call
    (CALL + ("\n" + CALL) * 7, True, True, True),  # at most 8, as the envelope's maxItems
    (CALL + ("\n" + CALL) * 8, False, True, False),
    ("Hi <tool_call>\nnot a call", False, True, False),
    ('Hi <tool_call>\n{"name": "send_mail"', False, True, False),  # not one of the tools
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}', False, True, False),
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}', False, True, False),
    ("Hi <tool_call>", True, True, False),  # a call begun must be finished
    ("<tool_call>\n{" + " " * 41, False, True, False),  # whitespace is bounded
    (CALL + " and more text", False, True, False),
])  # fmt: skip
def test_auto_grammar_enforces_a_call_once_the_tag_is_written(
    smollm2_tokenizer, text, eos, parallel, ok
):
    _, matcher = _matcher(smollm2_tokenizer, "auto", parallel)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert matcher().accept_tokens(ids + ([smollm2_tokenizer.eos_token_id] if eos else [])) == ok


def test_auto_walks_that_write_the_tag_end_in_valid_calls(smollm2_tokenizer):
    """Random walks through the ``auto`` grammar: some text, then the tag fed token by token
    (the text branch must let it through), then random allowed tokens (closers preferred so
    strings end): every walk ends in calls that validate, and no tag is left in the content."""
    backend, matcher = _matcher(smollm2_tokenizer, "auto")
    tag = smollm2_tokenizer.encode("<tool_call>", add_special_tokens=False)
    closers = [t for t in range(len(smollm2_tokenizer))
               if any(c in smollm2_tokenizer.decode([t]) for c in '"}],')
               and len(smollm2_tokenizer.decode([t])) <= 2]  # fmt: skip
    closers.append(smollm2_tokenizer.eos_token_id)
    bitmask = backend.allocate_bitmask(1)
    for seed in range(12):
        rng = random.Random(seed)
        m, ids = matcher(), []
        for _ in range(rng.randrange(6)):
            ids.append(rng.randrange(len(smollm2_tokenizer)))
        ids += tag
        assert m.accept_tokens(ids), smollm2_tokenizer.decode(ids)
        for _ in range(400):
            if m.is_terminated():
                break
            m.fill_bitmask(bitmask, 0)
            allowed = set(allowed_ids(bitmask))
            pool = [t for t in closers if t in allowed] if rng.random() < 0.6 else []
            token = rng.choice(pool or sorted(allowed))
            assert m.accept_tokens([token])
            ids.append(token)
        assert m.is_terminated(), "the walk did not end"
        text = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
        content, calls = T.parse_native(text)
        assert calls and "<tool_call>" not in (content or ""), text
        for call in calls:
            spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])


# The tag's tokens ("<", " <", "tool", "_", "call", ">") made likelier, so that text near the
# tag comes up; a random model still almost never writes it whole (the walks above do).
TAG_BIAS = {str(t): 8 for t in (44, 2067, 19324, 79, 4350, 46)}


def test_auto_on_the_model_is_text_or_valid_calls(hermes_server):
    with openai.OpenAI(base_url=hermes_server.url("/v1"), api_key="x", max_retries=0) as c:
        for seed in range(4):
            r = c.chat.completions.create(
                model=hermes_server.async_engine.info.model_name,
                messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME],
                max_tokens=150, temperature=1.0, seed=seed, logit_bias=TAG_BIAS,
            )  # fmt: skip
            (choice,) = r.choices
            if choice.finish_reason == "length":
                continue
            assert "<tool_call>" not in (choice.message.content or ""), choice
            assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
            for call in choice.message.tool_calls or []:
                spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                jsonschema.validate(
                    json.loads(call.function.arguments), spec["function"]["parameters"]
                )


@pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True),
                                              ("auto", True)])  # fmt: skip
def test_streamed_calls_equal_the_non_streamed_ones(hermes_server, choice, parallel):
    """Same seed, stream=False and stream=True: the same content and calls once the stream's
    deltas are added up; a call's arguments arrive in several fragments."""
    request = dict(
        model=hermes_server.async_engine.info.model_name, tools=[WEATHER, TIME],
        messages=[{"role": "user", "content": "Weather and time?"}], tool_choice=choice,
        parallel_tool_calls=parallel, max_tokens=120, temperature=1.0, logit_bias=TAG_BIAS,
    )  # fmt: skip
    with openai.OpenAI(base_url=hermes_server.url("/v1"), api_key="x", max_retries=0) as c:
        finished = same_when_streamed(c, range(4), raw_text=True, **request)
    assert finished or choice == "auto"  # a random model's text rarely ends before max_tokens

"""Tool calls in each family's own format (tool_formats.py), with the templates the models
publish (tests/data/chat_templates): the format is read from the template, past calls render as
the template wants them, the grammar takes the form the model writes and nothing else, the
streamed parser agrees with the whole-answer parse at every split, and forced calls come back
through a real server as OpenAI tool calls that validate, streamed and not. The model is a
2-layer random Llama with SmolLM2's tokenizer and each template."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.support.api import accumulate, non_streamed, same_when_streamed
from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.chat_template import render_chat
from tinyserve.entrypoints.llm import LLM
from tinyserve.entrypoints.tool_formats import HermesFormat, MarkedFormat, calls_check, tool_format
from tinyserve.entrypoints.tool_stream_marked import collect_calls
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tinyserve.structured.backend import GrammarBackend
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.testing.server import serve

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
FAMILIES = {  # template file -> the format it writes calls in
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "Qwen-Qwen3-0.6B": "hermes",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",  # v11+: name[ARGS]{...} each
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip
SPECS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [T.Tool.model_validate(t) for t in (WEATHER, TIME)]


@pytest.fixture
def templated(smollm2_tokenizer):
    original = smollm2_tokenizer.chat_template

    def use(name: str):
        smollm2_tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        return smollm2_tokenizer

    yield use
    smollm2_tokenizer.chat_template = original


def test_each_family_template_gives_its_format(templated, smollm2_tokenizer):
    assert tool_format(smollm2_tokenizer) is None  # ChatML without tools: the JSON envelope
    for name, expected in FAMILIES.items():
        assert tool_format(templated(name)).name == expected, name
    assert tool_format(templated(SMALL)).id_marker == "[CALL_ID]"  # past calls carry their ids
    assert tool_format(templated(NAMED)).id_marker == ""


def _past_call_prompt(tokenizer) -> str:
    call = T.ToolCall(id="call_0123456789abcdef",
                      function=T.FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'))  # fmt: skip
    messages = [
        P.ChatMessage(role="user", content="Weather in Oslo?"),
        P.ChatMessage(role="assistant", content=None, tool_calls=[call]),
        P.ChatMessage(role="tool", content='{"temp": 3}', tool_call_id=call.id),
    ]
    return tokenizer.decode(render_chat(tokenizer, messages, True, TOOLS, "auto"))


def test_templates_render_tools_and_past_calls_in_their_format(templated):
    mistral = _past_call_prompt(templated("mistralai-Mistral-Nemo-Instruct-2407"))
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in mistral
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "' in mistral
    # Mistral's template takes 9-alphanumeric ids only: mapped, the same in call and result.
    call_id = mistral.split('"id": "')[1][:9]
    assert call_id.isalnum() and f'"call_id": "{call_id}"' in mistral
    granite = _past_call_prompt(templated("ibm-granite-granite-3.3-2B-Instruct"))
    assert "<|start_of_role|>available_tools<|end_of_role|>" in granite
    # Its template renders an assistant turn's content only: the call is written there.
    assert '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]' in granite
    for name in ("mistralai-Ministral-3-14B-Reasoning-2512", "Mistral-Small-3.2-24B-Instruct-2506"):
        named = _past_call_prompt(templated(name))
        assert "[/INST][TOOL_CALLS]get_weather" in named and '[ARGS]{"city": "Oslo"}' in named
    for name in ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"):
        llama = _past_call_prompt(templated(name))
        assert 'Respond in the format {"name": function name, "parameters"' in llama
        assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in llama
        assert "<|start_header_id|>ipython<|end_header_id|>" in llama


def test_tool_results_reach_templates_without_a_tool_role(templated, smollm2_tokenizer):
    """Templates without tool support take the JSON envelope; a ``tool`` turn was left out
    by Phi-3.5's (the result never reached the model) and broke Gemma 2's alternation (a 400
    on every tool round). There results are user turns, with the user turns beside them."""
    from tinyserve.entrypoints.chat_template import renders_tool_role

    call = T.ToolCall(id="call_1", function=T.FunctionCall(name="get_weather",
                                                            arguments='{"city": "Oslo"}'))  # fmt: skip
    messages = [P.ChatMessage(role="user", content="Weather in Oslo and Paris?"),
                P.ChatMessage(role="assistant", content=None, tool_calls=[call, call]),
                P.ChatMessage(role="tool", content="OSLO_3C", tool_call_id="call_1"),
                P.ChatMessage(role="tool", content="PARIS_9C", tool_call_id="call_2"),
                P.ChatMessage(role="user", content="And tomorrow?")]  # fmt: skip
    assert renders_tool_role(smollm2_tokenizer)  # ChatML writes any role: as it was
    plain = smollm2_tokenizer.decode(render_chat(smollm2_tokenizer, messages, True, TOOLS, "auto"))
    assert "<|im_start|>tool\nResult of call call_1: OSLO_3C" in plain
    phi = templated("microsoft-Phi-3.5-mini-instruct")
    assert not renders_tool_role(phi)
    text = phi.decode(render_chat(phi, messages, True, TOOLS, "auto"))
    assert "<|user|>\nResult of call call_1: OSLO_3C\n\nResult of call call_2: PARIS_9C" in text
    assert "PARIS_9C\n\nAnd tomorrow?<|end|>" in text
    chat = [P.ChatMessage(role="user", content="One."), P.ChatMessage(role="user", content="Two.")]
    text = phi.decode(render_chat(phi, chat, True, [], "none"))  # no result: as the client sent
    assert "<|user|>\nOne.<|end|>\n<|user|>\nTwo.<|end|>" in text
    gemma = templated("google-gemma-2-2b-it")  # its template refuses a system turn: no tools
    text = gemma.decode(render_chat(gemma, messages, True, [], "none"))
    assert text.count("<start_of_turn>user") == 2 and "OSLO_3C" in text and "PARIS_9C" in text


MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
TWO = ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
       '{"name": "get_time", "arguments": {"tz": "UTC"}}]')  # fmt: skip
LLAMA_CALL = '{"name": "get_time", "parameters": {"tz": "CET"}}'
NAMED = "mistralai-Ministral-3-14B-Reasoning-2512"
NAMED_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
SMALL = "Mistral-Small-3.2-24B-Instruct-2506"
ID_CALL = '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "UTC"}'
GRAMMAR_CASES = [  # (template, choice, parallel, text, ends with eos, accepted)
    ("mistralai-Mistral-Nemo-Instruct-2407", "auto", True, "Some text [TOOL_CALL", True, True),
    ("mistralai-Mistral-Nemo-Instruct-2407", "auto", True, "Let me see." + MISTRAL_CALL, True, True),
    ("mistralai-Mistral-Nemo-Instruct-2407", "required", True, "[TOOL_CALLS]" + TWO, True, True),
    ("mistralai-Mistral-Nemo-Instruct-2407", "required", False, "[TOOL_CALLS]" + TWO, False, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "required", True, "Hi" + MISTRAL_CALL, False, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "auto", True, "[TOOL_CALLS][]", False, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "auto", True,
     '[TOOL_CALLS][{"name": "send_mail"', False, False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "auto", True, "x [TOOL_CALLS]", True, False),
    ("ibm-granite-granite-3.3-2B-Instruct", "required", True, "<|tool_call|>" + TWO, True, True),
    ("ibm-granite-granite-3.3-2B-Instruct", "auto", True, "Hello there", True, True),
    ("ibm-granite-granite-3.3-2B-Instruct", "required", True,
     '<|tool_call|>[{"name": "get_time", "arguments": {"tz": "PST"}}]', False, False),
    (NAMED, "auto", True, "Checking." + NAMED_CALL, True, True),
    (NAMED, "required", True, NAMED_CALL + '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', True, True),
    (NAMED, "required", False, NAMED_CALL + NAMED_CALL, False, False),
    (NAMED, "required", True, NAMED_CALL * 8, True, True),
    (NAMED, "required", True, NAMED_CALL * 9, False, False),  # at most 8, as the arrays' maxItems
    (NAMED, "required", True, '[TOOL_CALLS]get_time[ARGS]{"tz": "PST"}', False, False),
    (NAMED, "required", True, '[TOOL_CALLS]send_mail[ARGS]{}', False, False),
    (NAMED, "auto", True, "[TOOL_CALLS]get_weather", True, False),
    (NAMED, "required", True, ID_CALL, True, False),  # Ministral 3's template writes no ids
    (SMALL, "required", True, ID_CALL, True, True),  # Mistral Small 3.2's does: the model may
    (SMALL, "required", True, NAMED_CALL + ID_CALL, True, True),  # or may not
    (SMALL, "required", True, ID_CALL.replace("a1B2c3D4e", "a1B2"), False, False),  # 9 or none
    (SMALL, "required", True, ID_CALL.replace("a1B2c3D4e", "a1B2c3D4_"), False, False),
    ("meta-llama-Llama-3.2-3B-Instruct", "required", True, LLAMA_CALL, True, True),
    ("meta-llama-Llama-3.2-3B-Instruct", "auto", True, LLAMA_CALL, True, True),
    ("meta-llama-Llama-3.2-3B-Instruct", "auto", True, "It is sunny {really}.", True, True),
    ("meta-llama-Llama-3.2-3B-Instruct", "auto", True, '{"name": "nope"', False, False),
    ("meta-llama-Llama-3.2-3B-Instruct", "required", True, "Sure: " + LLAMA_CALL, False, False),
    ("meta-llama-Llama-3.2-3B-Instruct", "required", True,
     '{"name": "get_time", "arguments": {"tz": "CET"}}', False, False),  # its key is parameters
]  # fmt: skip


@pytest.mark.parametrize("name, choice, parallel, text, eos, ok", GRAMMAR_CASES)
def test_grammar_takes_the_family_form_only(templated, name, choice, parallel, text, eos, ok):
    tokenizer = templated(name)
    grammar = tool_format(tokenizer).grammar(TOOLS, choice, parallel, False)
    backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer))
    matcher = backend.matcher(backend.compile(StructuredOutputSpec("grammar", grammar, "tools")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.accept_tokens(ids + ([tokenizer.eos_token_id] if eos else [])) == ok


MISTRAL = MarkedFormat("mistral", "[TOOL_CALLS]", True)
LLAMA = MarkedFormat("llama3", "", False, "parameters")
V11 = MarkedFormat("mistral", "[TOOL_CALLS]", False, args_marker="[ARGS]")
V11_IDS = MarkedFormat("mistral", "[TOOL_CALLS]", False, id_length=9, args_marker="[ARGS]",
                       id_marker="[CALL_ID]")  # fmt: skip
PARSE_CASES = [  # (format, text, content, [(name, arguments)])
    (MISTRAL, "Let me see. " + MISTRAL_CALL, "Let me see.", [("get_weather", '{"city": "Oslo"}')]),
    (MISTRAL, "[TOOL_CALLS]" + TWO, None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "UTC"}')]),
    (MISTRAL, "No tools needed [TOOL", "No tools needed [TOOL", []),
    (MISTRAL, "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    (MISTRAL, '[TOOL_CALLS][{"x": 1}] tail', '[TOOL_CALLS][{"x": 1}] tail', []),
    (MISTRAL, '[TOOL_CALLS][{"name": "f"}]', None, [("f", "{}")]),
    (V11, "Checking. " + NAMED_CALL + '[TOOL_CALLS]f[ARGS]{"a": [1]}', "Checking.",
     [("get_weather", '{"city": "Oslo"}'), ("f", '{"a": [1]}')]),
    (V11, "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
    (V11, "[TOOL_CALLS]f[ARGS]nope", "[TOOL_CALLS]f[ARGS]nope", []),
    (V11, NAMED_CALL + " done", "done", [("get_weather", '{"city": "Oslo"}')]),
    (V11_IDS, "Checking. " + ID_CALL + NAMED_CALL, "Checking.",
     [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]),
    (V11_IDS, "[TOOL_CALLS]f[CALL_ID]a-b[ARGS]{}", "[TOOL_CALLS]f[CALL_ID]a-b[ARGS]{}", []),
    (V11_IDS, "[TOOL_CALLS]f[CALL_ID][ARGS]{}", "[TOOL_CALLS]f[CALL_ID][ARGS]{}", []),
    (V11, ID_CALL, ID_CALL, []),  # no ids in the format: not a call
    (LLAMA, "  " + LLAMA_CALL, None, [("get_time", '{"tz": "CET"}')]),
    (LLAMA, "<|python_tag|>" + LLAMA_CALL, None, [("get_time", '{"tz": "CET"}')]),
    (LLAMA, "The answer is {x}.", "The answer is {x}.", []),
    (LLAMA, '{"a": 1}', '{"a": 1}', []),
    (LLAMA, '{"name": "f", "parameters": {"k": [1, {"z": "}"}]}}', None,
     [("f", '{"k": [1, {"z": "}"}]}')]),
]  # fmt: skip


@pytest.mark.parametrize("fmt, text, content, calls", PARSE_CASES)
def test_parse_and_stream_agree_at_every_split(fmt, text, content, calls):
    got_content, got = fmt.parse(text)
    assert (got_content, [(c.function.name, c.function.arguments) for c in got]) == (
        content, calls)  # fmt: skip
    for cut in range(len(text) + 1):
        for step in (1, 3):  # the text in pieces: one split point, or every few characters
            stream = fmt.stream()
            pieces = [text[:cut]] + [text[i : i + step] for i in range(cut, len(text), step)]
            events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish("stop")
            s_content, s_calls = collect_calls(events)
            assert s_content == content and [
                (c.function.name, c.function.arguments) for c in s_calls] == calls, (cut, step)  # fmt: skip
            assert events[-1][1] == ("tool_calls" if calls else "stop")


def test_a_special_token_marker_is_named_in_the_grammar_and_kept(smollm2_gguf_path, tmp_path):
    """Where the marker is one special token (Mistral's [TOOL_CALLS]), the grammar must name
    the token (text cannot spell it) and the answer must keep it for the parser. SmolLM2's
    ``<|im_start|>`` stands in for it here."""
    from tinyserve.models.default_model import tokenizer_dir_for
    from tinyserve.testing.checkpoints import build_fuzz_model

    path = build_fuzz_model(tmp_path / "m", tokenizer_dir_for(smollm2_gguf_path))
    llm = LLM(engine=LLMEngine(EngineArgs(model=str(path), dtype="float32", num_blocks=64)))
    marker_id = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    fmt = MarkedFormat("special", "<|im_start|>", True, marker_id=marker_id)
    assert fmt.keeps_special_tokens and f"<[{marker_id}]>" in fmt.grammar(
        TOOLS, "required", True, False
    )
    for skip in (False, True):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, skip_special_tokens=skip,
                                structured_outputs=StructuredOutputsParams(
                                    grammar=fmt.grammar(TOOLS, "required", True, False)))  # fmt: skip
        (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert out.outputs[0].token_ids[0] == marker_id
        content, calls = fmt.parse(out.outputs[0].text)
        if out.outputs[0].finish_reason == "length":
            continue
        assert bool(calls) != skip, out.outputs[0].text  # skipped: the marker is gone


@pytest.fixture(scope="module", params=["mistralai-Mistral-Nemo-Instruct-2407",
                                        "ibm-granite-granite-3.3-2B-Instruct",
                                        "meta-llama-Llama-3.2-3B-Instruct",
                                        "mistralai-Ministral-3-14B-Reasoning-2512",
                                        SMALL])  # fmt: skip
def family_server(request, smollm2_gguf_path, tmp_path_factory):
    from tinyserve.models.default_model import tokenizer_dir_for
    from tinyserve.testing.checkpoints import build_fuzz_model

    base = build_fuzz_model(tmp_path_factory.mktemp("fuzz") / "m",
                            tokenizer_dir_for(smollm2_gguf_path))  # fmt: skip
    path = tmp_path_factory.mktemp(request.param) / "m"
    shutil.copytree(base, path)
    template = (TEMPLATES / f"{request.param}.jinja").read_text()
    cfg = path / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": template}))
    (path / "chat_template.jinja").write_text(template)  # transformers 5 reads this one first
    # Speculation off: the formats' streams are checked token by token (a verified draft run
    # would send a short call's arguments in one fragment).
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", num_blocks=256,
                                  speculative_config=None))  # fmt: skip
    with serve(AsyncEngine(engine), ServerConfig()) as s:
        yield FAMILIES[request.param], s


# Mistral Small 3.2's template writes a 680-token default system prompt where none is given:
# past the test model's 512-token context.
SYSTEM = [{"role": "system", "content": "You call tools."}]


def _tools_request(server, ask: str, **extra) -> dict:
    """A sampled chat request to a family server with WEATHER and TIME."""
    return dict(model=server.async_engine.info.model_name, tools=[WEATHER, TIME],
                messages=[*SYSTEM, {"role": "user", "content": ask}], temperature=1.0, **extra)  # fmt: skip


def test_forced_calls_come_back_as_tool_calls_that_validate(family_server):
    name, server = family_server
    finished = 0
    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0) as c:
        request = _tools_request(server, "Weather and time?", tool_choice="required",
                                 max_tokens=120)  # fmt: skip
        finished = same_when_streamed(c, range(3), **request)
        for seed in range(3):
            choice = c.chat.completions.create(seed=seed, **request).choices[0]
            if choice.finish_reason == "length":
                continue  # a random model may fill max_tokens inside a string
            assert choice.finish_reason == "tool_calls", (name, choice)
            assert choice.message.content is None
            assert len(choice.message.tool_calls) == 1 or name != "llama3"
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments),
                                    SPECS[call.function.name]["function"]["parameters"])  # fmt: skip
    assert finished, name  # compact JSON: calls end well within max_tokens


def test_auto_beside_a_response_format_is_a_call_or_that_json(family_server):
    name, server = family_server
    finished = 0
    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0) as c:
        request = _tools_request(server, "Weather?", max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT, "strict": True}})  # fmt: skip
        for seed in range(4):
            choice = c.chat.completions.create(seed=seed, **request).choices[0]
            if choice.finish_reason == "length":
                continue
            finished += 1
            if choice.finish_reason == "stop":
                assert not choice.message.tool_calls, (name, choice)
                jsonschema.validate(json.loads(choice.message.content), VERDICT)
            else:
                assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for seed in range(2):  # streamed: the same answers (Llama 3.x's in one piece: read
            want = non_streamed(c, seed=seed, **request)  # whole beside a JSON answer)
            assert accumulate(c, seed=seed, **request)[:3] == want
    assert finished, name


# uniqueItems is no grammar's: dropped from the call's grammar, checked on the finished call.
PAIR = {"type": "function", "function": {"name": "pair", "parameters": {
    "type": "object", "properties": {"xs": {"type": "array", "items": {"const": 1},
    "minItems": 2, "maxItems": 2, "uniqueItems": True}}, "required": ["xs"]}}}  # fmt: skip


def test_calls_check_finds_what_the_grammar_dropped():
    either = json.loads(json.dumps(PAIR).replace('{"const": 1}', '{"enum": [1, 2]}'))
    tools = [T.Tool.model_validate(t) for t in (WEATHER, either)]
    check = calls_check(MISTRAL, tools)
    assert check('[TOOL_CALLS][{"name": "pair", "arguments": {"xs": [1, 2]}}]') is None
    why = check('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "pair", "arguments": {"xs": [1, 1]}}]')  # fmt: skip
    assert "'pair'" in why and "'uniqueItems'" in why
    assert calls_check(MISTRAL, TOOLS) is None  # nothing dropped: nothing to check


def test_a_call_breaking_a_dropped_keyword_is_a_400_streamed_or_not(family_server):
    """The grammar of PAIR's call allows only ``[1, 1]``: the check after generation fails,
    so the answer is a 400 naming ``tools`` and the keyword, streamed an error event."""
    name, server = family_server
    body = {"model": server.async_engine.info.model_name, "max_tokens": 150, "tools": [PAIR],
            "seed": 0,
            "messages": [*SYSTEM, {"role": "user", "content": "two ones"}],
            "tool_choice": "required"}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == "tools" and "'uniqueItems'" in err["message"], err
    with httpx.stream("POST", server.url("/v1/chat/completions"), json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "'uniqueItems'" in errors[0]["message"], events[-3:]


# Tools beside a JSON response format (the OpenAI Agents SDK's agent with an output type):
# under ``auto`` the answer without calls is that JSON, in each family's form; calls as before.
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}  # fmt: skip
ANSWER_CASES = [  # (template or "hermes", text, accepted)
    *[(name, text, ok)
      for name, call in (("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL_CALL),
                         ("ibm-granite-granite-3.3-2B-Instruct", "<|tool_call|>" + TWO),
                         (NAMED, NAMED_CALL), ("meta-llama-Llama-3.2-3B-Instruct", LLAMA_CALL),
                         ("hermes", '<tool_call>\n{"name": "get_time", "arguments": '
                                    '{"tz": "UTC"}}\n</tool_call>'))
      for text, ok in (('{"ok": true}', True), (call, True), ("Hello there", False),
                       ('{"ok": 1}', False), ('{"ok": true, "why": "x"}', False))],
]  # fmt: skip


@pytest.mark.parametrize("name, text, ok", ANSWER_CASES)
def test_auto_with_a_json_answer_takes_that_json_or_calls(templated, smollm2_tokenizer, name,
                                                          text, ok):  # fmt: skip
    tokenizer = smollm2_tokenizer if name == "hermes" else templated(name)
    fmt = tool_format(tokenizer) if name != "hermes" else HermesFormat()
    grammar = fmt.grammar(TOOLS, "auto", True, False, VERDICT)
    backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer))
    matcher = backend.matcher(backend.compile(StructuredOutputSpec("grammar", grammar, "tools")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.accept_tokens(ids + [tokenizer.eos_token_id]) == ok, grammar
    if ok:  # the answer parses back as content (the JSON) or as the calls
        content, calls = fmt.parse(text)
        assert (content, calls == []) == (text, True) or (calls and not content)
    required = backend.matcher(backend.compile(StructuredOutputSpec(
        "grammar", fmt.grammar(TOOLS, "required", True, False, None), "tools")))  # fmt: skip
    assert not required.accept_tokens(
        tokenizer.encode('{"ok": true}', add_special_tokens=False) + [tokenizer.eos_token_id]
    )


def test_calls_check_checks_a_json_answer_without_calls():
    """A response format's keyword the grammar drops (uniqueItems) is checked on the answer
    that is not a call; calls are checked by their own tools' schemas."""
    pair = PAIR["function"]["parameters"]
    check = calls_check(MISTRAL, TOOLS, answer=pair)
    why = check('{"xs": [1, 1]}')
    assert why is not None and "'uniqueItems'" in why
    assert check(MISTRAL_CALL) is None
    assert calls_check(MISTRAL, TOOLS, answer=VERDICT) is None  # nothing dropped


@pytest.mark.parametrize("text, is_call", [
    ('{"name": "Alice", "age": 30}', False),  # a Person answer: a "name", no tool
    ('{"name": "get_time", "parameters": {"tz": "CET"}}', True),
    ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', True),
    ('{"name": "get_time", "parameters": {}, "x": 1}', False),
])  # fmt: skip
def test_llama_calls_beside_a_json_answer_are_read_whole(text, is_call):
    """Llama 3.x calls are bare JSON objects, like the answer a response format asks for:
    read piecewise, an answer with a "name" became a call of a tool that does not exist.
    Beside a JSON answer the text is read whole, the same streamed and not."""
    names = ["get_weather", "get_time"]
    rng = random.Random(0)
    for _ in range(5):
        stream, events, i = LLAMA.stream(names), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            events += stream.feed(text[i : i + n])
            i += n
        events += stream.finish("stop")
        content, calls = collect_calls(events)
        assert bool(calls) == is_call and (content is None) == is_call, (content, calls)
        assert events[-1][1] == ("tool_calls" if is_call else "stop")
        if not is_call:
            assert content == text
    check = calls_check(LLAMA, TOOLS, answer={"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "uniqueItems": True}}})  # fmt: skip
    assert "'uniqueItems'" in check('{"name": "Alice", "tags": [1, 1]}')


def test_a_bad_response_format_beside_tools_names_itself_in_a_template_format(family_server):
    """With the template's own call format the format's schema is built into the calls'
    grammar, and a schema the rewrites refuse (multipleOf <= 0) was a 400 naming ``tools``."""
    name, server = family_server
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": -2}}}}}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                   json=_tools_request(server, "Weather?", max_tokens=8, response_format=fmt))  # fmt: skip
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == "response_format", (name, err)
    assert err["message"].startswith("response_format: invalid JSON schema: multipleOf"), err

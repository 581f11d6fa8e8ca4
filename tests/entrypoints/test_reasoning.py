"""Thinking output (issue 41): the <think> block to reasoning_content, split exactly at the
tags, streamed and non-streamed alike; chat_template_kwargs reaches the template and
enable_thinking: false turns the split off. A scripted engine writes the answers."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.api import assert_error
from tinyserve.entrypoints.reasoning import ReasoningSplitter, split_reasoning, template_thinks

ANSWERS = [
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "It is 4."),
    ("  <think>a < b, </thin not yet</think>ok", "a < b, </thin not yet", "ok"),
    ("No thinking here: <think> later is content", None, "No thinking here: <think> later is content"),
    ("<think>cut before it closed", "cut before it closed", None),
    ("<think></think>\n\n", "", None),
    ("<thin", None, "<thin"),
    ("<think>", "", None),  # max_tokens 1: the block opened, nothing in it yet
    ("", None, None),
]  # fmt: skip


@pytest.mark.parametrize("text, reasoning, content", ANSWERS)
def test_split_at_the_tags(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_streamed_deltas_concatenate_to_the_finished_split(seed, opened):
    """Any cut of the text into deltas (tags split across them included) gives the split of
    the whole text."""
    rng = random.Random(seed)
    text = rng.choice(ANSWERS)[0] if not opened else "still thinking</think>\n answer"
    cuts = sorted(rng.sample(range(1, len(text) + 1), min(len(text), rng.randint(1, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    s = ReasoningSplitter(thinking=opened)
    fed = [s.feed(p) for p in pieces] + [s.finish()]
    reasoning, content = split_reasoning(text, thinking=opened)
    assert "".join(r for r, _ in fed) == (reasoning or "")
    assert "".join(c for _, c in fed) == (content or "")


def test_a_prompt_that_opens_the_block_starts_in_reasoning():
    assert split_reasoning("weighing it</think>\n\nyes", thinking=True) == ("weighing it", "yes")


SCRIPT = ["<think>", "\nThe user", " wants 2+2.", "</", "think>", "\n\n", "It is", " 4."]
ASK = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 50}


def test_served_split_streamed_and_not(fake_server):
    with fake_server(script=SCRIPT, server_options={"reasoning_parser": "think"}) as s:
        with httpx.Client(base_url=s.base_url, timeout=30) as c:
            msg = c.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
            assert msg["reasoning_content"] == "\nThe user wants 2+2."
            assert msg["content"] == "It is 4."
            reasoning, content = "", ""
            with c.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        reasoning += delta.get("reasoning_content") or ""
                        content += delta.get("content") or ""
            assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
            off = {**ASK, "chat_template_kwargs": {"enable_thinking": False}}
            msg = c.post("/v1/chat/completions", json=off).json()["choices"][0]["message"]
            assert msg["content"] == "".join(SCRIPT) and msg["reasoning_content"] is None
            bad = {**ASK, "chat_template_kwargs": {"add_generation_prompt": False}}
            err = assert_error(c.post("/v1/chat/completions", json=bad), 400)
            assert "chat_template_kwargs" in err["message"]


def test_the_openai_sdk_reads_the_reasoning(fake_server):
    with fake_server(script=SCRIPT, server_options={"reasoning_parser": "think"}) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x")
        out = client.chat.completions.create(model="fake-model", **ASK)
        assert out.choices[0].message.content == "It is 4."
        assert out.choices[0].message.model_extra["reasoning_content"] == "\nThe user wants 2+2."


def test_auto_splits_only_where_the_template_thinks(fake_server, smollm2_tokenizer):
    assert not template_thinks(smollm2_tokenizer)  # SmolLM2's ChatML: no <think>
    with fake_server(script=SCRIPT) as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        msg = c.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
        assert msg["content"] == "".join(SCRIPT) and msg["reasoning_content"] is None


def test_template_kwargs_reach_the_template(smollm2_tokenizer):
    """A Qwen3-style template: enable_thinking false writes an empty think block into the
    prompt; the kwargs pass through chat_prompt_ids."""
    from tinyserve.entrypoints import protocol as P
    from tinyserve.entrypoints.serving import OpenAIServing

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
        "{% endif %}"
    )
    assert template_thinks(tok)
    serving = OpenAIServing(type("E", (), {"tokenizer": tok})(), "m")
    msgs = [P.ChatMessage(role="user", content="hi")]
    on = tok.decode(serving.chat_prompt_ids(msgs))
    off = tok.decode(serving.chat_prompt_ids(msgs, template_kwargs={"enable_thinking": False}))
    assert "<think>" not in on and off.endswith("<think>\n\n</think>\n\n")
    assert serving.thinks(None) and not serving.thinks({"enable_thinking": False})


def test_responses_api_gives_the_thinking_a_reasoning_item(fake_server):
    with fake_server(script=SCRIPT, server_options={"reasoning_parser": "think"}) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x")
        out = client.responses.create(model="fake-model", input="2+2?", max_output_tokens=50)
        kinds = [item.type for item in out.output]
        assert kinds == ["reasoning", "message"], kinds
        assert out.output[0].content[0].text == "\nThe user wants 2+2."
        assert out.output_text == "It is 4."
        events = list(client.responses.create(model="fake-model", input="2+2?", stream=True,
                                              max_output_tokens=50))  # fmt: skip
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (thinking, text) == ("\nThe user wants 2+2.", "It is 4.")
        done = [e for e in events if e.type == "response.completed"][0].response
        assert [i.type for i in done.output] == ["reasoning", "message"]


def test_a_reasoning_item_sent_back_is_the_next_assistant_turns_thinking():
    from tinyserve.entrypoints.protocol_responses import chat_messages

    items = [{"type": "message", "role": "user", "content": "weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "use the tool"}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]  # fmt: skip
    messages = chat_messages(items, None)
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].reasoning_content == "use the tool" and messages[1].tool_calls


def test_the_fields_only_chat_takes_are_400s_elsewhere(fake_server):
    with fake_server() as s, httpx.Client(base_url=s.base_url, timeout=30) as c:
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
        r = c.post("/v1/responses", json={"input": "hi", **kwargs})
        assert_error(r, 400, "chat_template_kwargs")
        r = c.post("/v1/completions", json={"prompt": "hi", **kwargs})
        assert_error(r, 400, "chat_template_kwargs")
        r = c.post("/v1/responses", json={"input": "hi", "prediction": {"type": "content",
                                                                          "content": "x"}})  # fmt: skip
        assert_error(r, 400, "prediction")

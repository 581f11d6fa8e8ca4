"""The official openai SDK against the real server (default SmolLM2 model)."""

from __future__ import annotations

import openai
import pytest

from tests.support.api import MODEL

MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as c:
        yield c


def test_models(oai, server):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == server.async_engine.max_model_len
    one = oai.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert one.id == MODEL and one.model_extra["max_model_len"] == server.async_engine.max_model_len
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("org/other-model")  # an id with a slash reaches the route too


def test_chat_stream_matches_non_stream_greedy(oai):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    full = oai.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.object == "chat.completion"
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content and text
    assert [c.choices[0].finish_reason for c in chunks][-1] == choice.finish_reason


def test_completion_stream_matches_non_stream_greedy(oai):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    full = oai.completions.create(**kwargs)
    assert full.object == "text_completion"
    chunks = list(oai.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_n2_and_seed_reproducible(oai):
    kwargs = dict(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, n=2, seed=1234,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    a = oai.chat.completions.create(**kwargs)
    b = oai.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 16
    assert all(c.finish_reason == "length" for c in a.choices)


def test_stop_string(oai):
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0)
    text = oai.completions.create(**kwargs).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    stopped = oai.completions.create(**kwargs, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    streamed = list(oai.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text


def test_logprobs(oai):
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content

    comp = oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(d) >= 1 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_logprob_bytes_add_up_to_the_text_across_split_characters(oai, server):
    """An emoji spans several byte tokens, each decoding to U+FFFD alone: ``bytes`` are the
    tokens' own, so they join to the content (OpenAI's reason for the field); they were
    U+FFFD's three bytes each. Streamed the same."""
    text = "🎉é🎉 ok"
    ids = server.async_engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # some character is split across tokens
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=20, logprobs=True,
                   top_logprobs=1, extra_body={"structured_outputs": {"choice": [text]}})  # fmt: skip
    chat = oai.chat.completions.create(**request)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == text
    assert bytes(b for t in content for b in t.bytes).decode("utf-8") == text
    streamed = [t for c in oai.chat.completions.create(**request, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [t.bytes for t in streamed] == [t.bytes for t in content]


def test_echo(oai):
    comp = oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True)
    assert comp.choices[0].text.startswith("Hello there")


def test_max_tokens_1(oai):
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 1
    assert chat.choices[0].finish_reason == "length"
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1)
    assert chat.usage.completion_tokens == 1


def test_include_usage(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_batch_prompts_and_token_ids(oai, server):
    ids = server.engine.tokenizer.encode("The sky is")
    comp = oai.completions.create(
        model=MODEL, prompt=["The sky is", "Once upon a time"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == comp.choices[0].text
    nested = oai.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in nested.choices] == [by_ids.choices[0].text] * 2
    assert nested.usage.prompt_tokens == 2 * len(ids)


def test_sampling_knobs_accepted(oai):
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
        ],
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"42": -5},
        seed=7,
        extra_body={
            "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
            "stop_token_ids": [2], "some_unknown_field": 1,
        },
    )  # fmt: skip
    assert chat.usage.completion_tokens >= 2


def test_the_developer_role_is_the_system_role_where_the_template_has_none(oai, server):
    """OpenAI's ``developer`` messages (its SDK's examples use them) are its system messages:
    SmolLM2's template, which does not name the role, rendered "<|im_start|>developer" and
    added its own default system prompt as well. The Responses API's items alike."""

    def prompt_tokens(role: str) -> tuple[int, int]:
        chat = oai.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": role, "content": "Answer in French."},
            {"role": "user", "content": "Hello"}])  # fmt: skip
        resp = oai.responses.create(model=MODEL, max_output_tokens=1, input=[
            {"role": role, "content": "Answer in French."},
            {"role": "user", "content": "Hello"}])  # fmt: skip
        return chat.usage.prompt_tokens, resp.usage.input_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")

"""Scoring prompts over HTTP, as lm-evaluation-harness and OpenAI's legacy API do it:
``echo`` with ``logprobs`` returns the prompt tokens' logprobs (the first null), ``max_tokens:
0`` scores without generating, vLLM's ``prompt_logprobs`` on completions and chat; streamed
the same as not; a scored prompt's last token has the logprob the sampler gave it when it
was generated; bad values are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.api import MODEL, assert_error

COMP = "/v1/completions"
TEXT = "The capital of France is Paris, and the capital of Japan is"


def _tokens(client, text: str) -> list[int]:
    r = client.post("/tokenize", json={"model": MODEL, "prompt": text})
    return r.json()["tokens"]


def test_echo_scores_the_prompt_without_generating(client):
    ids = _tokens(client, TEXT)
    r = client.post(COMP, json={"model": MODEL, "prompt": TEXT, "echo": True, "logprobs": 2,
                                "max_tokens": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) == body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    # The top 2, and the prompt's own token where it is not among them (OpenAI's "up to
    # logprobs + 1"): some position of this text is not the model's top-2 choice.
    tops = lp["top_logprobs"][1:]
    assert all(2 <= len(top) <= 3 for top in tops) and any(len(top) == 3 for top in tops)
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], tops, strict=True):
        assert top[tok] == v
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == TEXT
    assert "prompt_logprobs" not in choice or choice["prompt_logprobs"] is None

    # The same prompt again (its blocks are cached now): the same numbers.
    again = client.post(COMP, json={"model": MODEL, "prompt": TEXT, "echo": True,
                                    "logprobs": 2, "max_tokens": 0}).json()  # fmt: skip
    assert again["choices"][0]["logprobs"] == lp
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_generated_tokens_logprob_is_its_score(client):
    ids = _tokens(client, TEXT)
    gen = client.post(COMP, json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                  "temperature": 0, "logprobs": 1}).json()  # fmt: skip
    token_lp = gen["choices"][0]["logprobs"]["token_logprobs"][0]
    text = gen["choices"][0]["text"]
    scored = client.post(
        COMP,
        json={
            "model": MODEL,
            "prompt": ids + _tokens(client, text)[-1:],
            "echo": True,
            "logprobs": 1,
            "max_tokens": 0,
        },
    ).json()
    assert abs(scored["choices"][0]["logprobs"]["token_logprobs"][-1] - token_lp) <= 1e-5


@pytest.mark.parametrize(
    "extra",
    [{"echo": True, "max_tokens": 4},
     {"echo": True, "max_tokens": 8, "prompt": "Crème brûlée in 東京 costs 🎉"},  # offsets carried
     # a stop string held back the text of tokens already sent: their streamed text_offset
     # counted the characters sent ([0, 0, 1, 0, 1, 4, 0, ...] for [0, 6, 7, 8, 9, 12, ...])
     {"max_tokens": 10, "stop": ["QQQQQQQQQQQQQQQQQQQQ"]}],
)  # fmt: skip
def test_echo_streams_the_same_as_not(client, extra):
    body = {"model": MODEL, "prompt": TEXT, "logprobs": 1, "temperature": 0, **extra}
    whole = client.post(COMP, json=body).json()["choices"][0]
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with client.stream("POST", COMP, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c["text"]
                for k in merged:
                    merged[k] += c["logprobs"][k] if c["logprobs"] else []
    assert text == whole["text"]
    assert merged == whole["logprobs"]


def test_vllm_prompt_logprobs_on_completions_and_chat(client):
    ids = _tokens(client, TEXT)
    comp = client.post(COMP, json={"model": MODEL, "prompt": ids, "max_tokens": 0,
                                   "prompt_logprobs": 1}).json()  # fmt: skip
    (choice,) = comp["choices"]
    plp = choice["prompt_logprobs"]
    assert choice["text"] == "" and choice["logprobs"] is None
    assert len(plp) == len(ids) and plp[0] is None
    for t, entry in zip(ids[1:], plp[1:], strict=True):
        assert str(t) in entry and len(entry) <= 2  # the token, and the top one if another
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and entry[str(t)]["rank"] >= 1
    # The echoed legacy object and vLLM's field agree.
    echo = client.post(COMP, json={"model": MODEL, "prompt": ids, "max_tokens": 0,
                                   "echo": True, "logprobs": 0}).json()  # fmt: skip
    lps = echo["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[1:] == [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plp[1:], strict=True)]

    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                       "max_tokens": 2, "prompt_logprobs": 0}).json()  # fmt: skip
    plp = chat["prompt_logprobs"]
    assert len(plp) == chat["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(entry) == 1 for entry in plp[1:])
    plain = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                        "max_tokens": 1}).json()  # fmt: skip
    assert plain["prompt_logprobs"] is None


def test_bad_scoring_requests_are_400(client):
    def post(**kw):
        return client.post(COMP, json={"model": MODEL, "prompt": TEXT, **kw})

    assert_error(post(max_tokens=0), 400, "max_tokens")
    assert_error(post(max_tokens=-1, echo=True), 400, "max_tokens")
    assert_error(post(prompt_logprobs=21), 400, "prompt_logprobs")
    assert_error(post(echo=True, logprobs=21, max_tokens=0), 400, "logprobs")
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                    "max_tokens": 0})  # fmt: skip
    assert_error(r, 400, "max_tokens")
    assert httpx.get(str(client.base_url) + "/health").status_code == 200


MULTIBYTE = "Crème brûlée in 東京 costs 🎉 ¥1200, naïve"


def test_text_offsets_and_token_names_over_characters_split_into_tokens(client):
    """Where a character's bytes span tokens, each token's ``text_offset`` is the character
    its bytes start or continue (its U+FFFD text counted one character each: every later
    offset ran ahead), and a part token is named ``bytes:\\xe6\\x9d`` as OpenAI names it (as
    U+FFFD, different tokens were one key of a ``top_logprobs`` dict: vLLM's
    ``prompt_logprobs``, keyed by id, counted more alternatives)."""
    body = {"model": MODEL, "prompt": MULTIBYTE, "echo": True, "logprobs": 5,
            "prompt_logprobs": 5, "max_tokens": 0}  # fmt: skip
    choice = client.post(COMP, json=body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert text == MULTIBYTE and any(t.startswith("bytes:") for t in lp["tokens"])
    chars = 0  # (the offsets, derived from the token ids' bytes independently)
    raw = b""
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert offset == chars
        if token.startswith("bytes:"):
            raw += bytes.fromhex(token[6:].replace("\\x", ""))
        else:
            assert text[offset : offset + len(token)] == token
            raw += token.encode()
        chars = len(raw.decode("utf-8", errors="ignore"))
    assert raw.decode() == text
    for top, by_id in zip(lp["top_logprobs"][1:], choice["prompt_logprobs"][1:], strict=True):
        assert len(top) == len(by_id)


def test_skipped_special_tokens_take_no_text_offset(client, smollm2_tokenizer):
    """Special tokens inside the answer (ignore_eos) are left out of its text, so they move
    no offset (each moved the next by len("<|im_end|>")); shown, they do."""
    eos = smollm2_tokenizer.eos_token_id
    body = {"model": MODEL, "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3,
            "ignore_eos": True, "logit_bias": {str(eos): 100}}  # fmt: skip
    choice = client.post(COMP, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == TEXT and lp["tokens"][-3:] == [smollm2_tokenizer.eos_token] * 3
    assert lp["text_offset"][-3:] == [len(TEXT)] * 3
    shown = client.post(COMP, json={**body, "skip_special_tokens": False}).json()["choices"][0]
    step = len(smollm2_tokenizer.eos_token)
    assert shown["logprobs"]["text_offset"][-3:] == [len(TEXT) + i * step for i in range(3)]

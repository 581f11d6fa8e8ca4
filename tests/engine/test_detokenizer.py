"""IncrementalDetokenizer against the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from tinyserve.engine.detokenizer import IncrementalDetokenizer
from tinyserve.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"

TEXTS = [
    "Hello world, this is the END of it.",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 and 🤖!",
    "中文测试：你好，世界。日本語のテキストも。한국어 문장.",
    "Accents: café, naïve, façade, Ærøskøbing, Ångström, São Paulo.",
    "Mixed 混合 text 😀 with\nnewlines\tand  double  spaces ✓ ∑ ∞.",
]


def run(tok, prompt_ids, output_ids, params, chunk_sizes=(1,), seed=0):
    """Feed output_ids in chunks; returns (detokenizer, deltas, matched stop string)."""
    det = IncrementalDetokenizer(tok, prompt_ids, params)
    rng = random.Random(seed)
    deltas: list[str] = []
    i = 0
    while i < len(output_ids):
        n = rng.choice(chunk_sizes)
        chunk = output_ids[i : i + n]
        i += len(chunk)
        delta, stop = det.update(chunk, finished=i >= len(output_ids))
        deltas.append(delta)
        assert "".join(deltas) == det.output_text
        if stop is not None:
            return det, deltas, stop
    return det, deltas, None


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(PROMPT)


@pytest.mark.parametrize("chunk_sizes", [(1,), (3,), (1, 2, 5, 8)])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(smollm2_tokenizer, prompt_ids, text, chunk_sizes):
    tok = smollm2_tokenizer
    out = tok.encode(text)
    det, deltas, stop = run(tok, prompt_ids, out, SamplingParams(), chunk_sizes)
    assert stop is None
    assert det.output_text == tok.decode(out, skip_special_tokens=True) == text
    # Valid text never shows a replacement character, not even transiently.
    assert not any("\ufffd" in d for d in deltas)


def test_random_token_sequences_match_full_decode(smollm2_tokenizer, prompt_ids):
    """Shuffled tokens of emoji/CJK/accented text and uniform random ids: many of them are
    bytes of a multi-byte character, so the decode is full of broken UTF-8 sequences."""
    tok = smollm2_tokenizer
    pool = sorted({t for text in TEXTS for t in tok.encode(text)})
    rng = random.Random(1234)
    for trial in range(150):
        n = rng.randint(1, 40)
        if trial % 3 == 0:
            out = [rng.randrange(len(tok)) for _ in range(n)]
        else:
            out = [rng.choice(pool) for _ in range(n)]
        skip = trial % 2 == 0
        params = SamplingParams(skip_special_tokens=skip)
        det, deltas, _ = run(tok, prompt_ids, out, params, (1, 1, 2, 3), seed=trial)
        assert det.output_text == tok.decode(out, skip_special_tokens=skip), out
        # Only the final flush may end inside a character.
        assert not any(d.endswith("\ufffd") for d in deltas[:-1]), (out, deltas)


def test_incomplete_character_held_until_completed(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    out = tok.encode("😀")
    assert len(out) > 1  # the emoji's bytes span several tokens
    det = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    for t in out[:-1]:
        assert det.update([t], finished=False) == ("", None)
    assert det.update([out[-1]], finished=False) == ("😀", None)


def test_finish_flushes_incomplete_character(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    out = tok.encode("ok 😀")[:-1]
    det = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    assert det.update(out[:-1], finished=False)[0] == "ok"
    delta, stop = det.update(out[-1:], finished=True)
    assert stop is None
    assert det.output_text == tok.decode(out) and det.output_text.endswith("\ufffd")


def test_prompt_ending_inside_a_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi 😀 there")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    det, _, _ = run(tok, ids[:split], ids[split:], SamplingParams())
    assert det.output_text == tok.decode(ids[split:])


def test_leading_space_of_first_token_is_kept(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world")
    det, deltas, _ = run(tok, ids[:1], ids[1:], SamplingParams())
    assert deltas[0] == " world"


def test_empty_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    out = tok.encode("中文 text")
    det, _, _ = run(tok, [], out, SamplingParams())
    assert det.output_text == "中文 text"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm2_tokenizer, prompt_ids, skip):
    tok = smollm2_tokenizer
    out = tok.encode("Done.<|im_end|>\nMore<|endoftext|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in out
    det, deltas, _ = run(tok, prompt_ids, out, SamplingParams(skip_special_tokens=skip))
    expected = "Done.\nMore" if skip else "Done.<|im_end|>\nMore<|endoftext|>"
    assert det.output_text == expected == tok.decode(out, skip_special_tokens=skip)


STOP_TEXT = "Hello world, this is the END of it"


@pytest.mark.parametrize("chunk_sizes", [(1,), (4,), (1, 3, 7)])
@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        ("the EN", False, "Hello world, this is "),
        ("END", False, "Hello world, this is the "),
        ("END", True, "Hello world, this is the END"),
        ("the EN", True, "Hello world, this is the EN"),
        ("o w", False, "Hell"),  # spans the "Hello" / " world" boundary
        ("of it", True, STOP_TEXT),  # completed by the last token
    ],
)
def test_stop_string_across_token_boundaries(
    smollm2_tokenizer, prompt_ids, stop, include, expected, chunk_sizes
):
    tok = smollm2_tokenizer
    out = tok.encode(STOP_TEXT)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    det, deltas, matched = run(tok, prompt_ids, out, params, chunk_sizes)
    assert matched == stop
    assert det.output_text == expected


def test_stop_string_never_partially_emitted(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    out = tok.encode(STOP_TEXT)
    det = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["the END", "x"]))
    for i, t in enumerate(out):
        _, matched = det.update([t], finished=i == len(out) - 1)
        # Nothing past the cut point is ever emitted, not even "t", "th", "the ", "the E".
        assert "Hello world, this is ".startswith(det.output_text)
        if matched:
            break
    assert matched == "the END"
    assert det.output_text == "Hello world, this is "


@pytest.mark.parametrize("stops", [["of it", "this"], ["this", "of it"], ["is the", "this"]])
def test_earliest_stop_string_wins(smollm2_tokenizer, prompt_ids, stops):
    tok = smollm2_tokenizer
    out = tok.encode(STOP_TEXT)
    det, _, matched = run(tok, prompt_ids, out, SamplingParams(stop=stops), (1, 50))
    assert matched == "this"
    assert det.output_text == "Hello world, "


def test_same_position_ties_go_to_first_listed(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    out = tok.encode(STOP_TEXT)
    params = SamplingParams(stop=["the E", "the END"], include_stop_str_in_output=True)
    det, _, matched = run(tok, prompt_ids, out, params, (50,))
    assert matched == "the E"
    assert det.output_text == "Hello world, this is the E"


def test_stop_string_in_prompt_is_ignored(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("the END")
    out = tok.encode(" and more")
    det, _, matched = run(tok, prompt, out, SamplingParams(stop=["END"]))
    assert matched is None
    assert det.output_text == " and more"


def test_held_back_text_flushed_on_finish(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    out = tok.encode("abc def ghi")
    det = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["a stop string"]))
    held = "".join(det.update([t], finished=False)[0] for t in out)
    assert held == "" and det.output_text == ""  # shorter than the longest stop string - 1
    assert det.update([], finished=True) == ("abc def ghi", None)
    assert det.output_text == "abc def ghi"


def test_stop_strings_do_not_change_text_without_a_match(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    for text in TEXTS:
        out = tok.encode(text)
        params = SamplingParams(stop=["NOPE", "🙈🙉"])
        det, deltas, matched = run(tok, prompt_ids, out, params, (1, 2))
        assert matched is None and det.output_text == text
        assert not any("\ufffd" in d for d in deltas)


def test_update_after_stop_raises(smollm2_tokenizer, prompt_ids):
    tok = smollm2_tokenizer
    det = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["world"]))
    assert det.update(tok.encode("Hello world again"), finished=False) == ("Hello ", "world")
    with pytest.raises(RuntimeError):
        det.update([42], finished=False)


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.max_decode_len = 0

    def decode(self, ids, **kwargs):
        self.max_decode_len = max(self.max_decode_len, len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decode_window_stays_small(smollm2_tokenizer, prompt_ids):
    tok = _CountingTokenizer(smollm2_tokenizer)
    out = smollm2_tokenizer.encode(" ".join(TEXTS) * 4)
    det, _, _ = run(tok, prompt_ids, out, SamplingParams(stop=["never"]))
    assert det.output_text == smollm2_tokenizer.decode(out)
    assert len(out) > 200
    assert tok.max_decode_len <= 10  # an emoji's bytes plus one token of context


def test_stop_strings_wait_for_min_tokens(smollm2_tokenizer, prompt_ids):
    """A stop string inside the first min_tokens output tokens does not end the request (as
    EOS and stop ids do not in the scheduler); one completed after them does."""
    tok = smollm2_tokenizer
    out = tok.encode("stop here, then go on and stop again.")
    first = tok.decode(out[:3])
    assert "stop" in first  # the first stop string lies inside the first 3 tokens
    det, _, stop = run(tok, prompt_ids, out, SamplingParams(stop=["stop"], min_tokens=3))
    assert stop == "stop"
    assert det.output_text == "stop here, then go on and "
    det, _, stop = run(tok, prompt_ids, out, SamplingParams(stop=["stop"]))
    assert stop == "stop" and det.output_text == ""
    det, _, stop = run(tok, prompt_ids, out, SamplingParams(stop=["stop"], min_tokens=len(out)))
    assert stop is None and det.output_text == tok.decode(out)


def test_a_stop_string_completed_by_the_min_tokens_th_token_does_not_count(
    smollm2_tokenizer, prompt_ids
):
    """As EOS and stop ids (masked for the first min_tokens tokens) and vLLM's check
    (len(output) > min_tokens): the k-th token completing a stop string ends the request
    only with min_tokens < k (min_tokens 1 and a first token "1" with stop "1" gave "")."""
    tok = smollm2_tokenizer
    out = tok.encode("1. 1\n2")
    k = next(i for i in range(1, len(out) + 1) if "1" in tok.decode(out[:i]))  # (1)
    det, _, stop = run(tok, prompt_ids, out, SamplingParams(stop=["1"], min_tokens=k - 1))
    assert stop == "1" and det.output_text == ""
    det, _, stop = run(tok, prompt_ids, out, SamplingParams(stop=["1"], min_tokens=k))
    assert stop == "1" and det.output_text == tok.decode(out[:k]) + ". "

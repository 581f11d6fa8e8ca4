"""Token names and text offsets of the logprobs objects on a SentencePiece tokenizer (Llama 2,
Phi 3, Mistral v1 style: ``▁`` for a space, ``<0xE2>`` byte pieces, a text's first space
dropped on decoding), built here from a toy vocabulary. SmolLM2's byte-level BPE is tested
over HTTP (test_prompt_logprobs_api.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from tinyserve.entrypoints import protocol_logprobs as L
from tinyserve.outputs import TokenLogprob

WORDS = ["▁the", "the", "▁cat", "cat", "▁"]


@pytest.fixture(scope="module")
def sp():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(WORDS)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")  # fmt: skip
    return tok, vocab


def _logprobs(tok, ids, top):
    def name(t):
        return L.token_text(tok, t)

    lps = [TokenLogprob(token_id=t, logprob=-1.0, top=top) for t in ids[1:]]
    return L.completion_logprobs([], name, lambda t: L.token_bytes(tok, t, name(t)),
                                 L.TextOffsets(), ids, [None, *lps], tok.decode(ids))  # fmt: skip


@pytest.mark.parametrize("bos", [False, True])
def test_sentencepiece_names_keep_their_space_and_offsets_index_the_text(sp, bos):
    """``decode([▁the])`` is "the" (the first space dropped): the echoed offsets lost a
    character a word and ``▁the`` and ``the`` were one top_logprobs key. Offsets from each
    token's text, the first token's space (not in the decoded text) left out."""
    tok, v = sp
    ids = [v["▁the"], v["▁cat"], v["<0xE2>"], v["<0x80>"], v["<0x99>"], v["▁the"], v["cat"]]
    ids = [v["<s>"], *ids] if bos else ids
    text = tok.decode(ids)  # "the cat’ thecat", "<s> the cat’ thecat" with BOS
    out = _logprobs(tok, ids, [(v["▁the"], -1.0), (v["the"], -2.0)])
    assert [L.token_text(tok, v[w]) for w in WORDS] == [" the", "the", " cat", "cat", " "]
    if bos:  # "<s> the cat’ thecat": the space after <s> is in the text
        assert text == "<s> the cat’ thecat"
        assert out["text_offset"] == [0, 3, 7, 11, 11, 11, 12, 16]
    else:  # "the cat’ thecat": the first token's is not
        assert text == "the cat’ thecat" and out["text_offset"] == [0, 3, 7, 7, 7, 8, 12]
    for token, offset in zip(out["tokens"][1:], out["text_offset"][1:], strict=True):
        if not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token
    for token_id, top in zip(ids[1:], out["top_logprobs"][1:], strict=True):  # a key an id
        assert len(top) == len({v["▁the"], v["the"], token_id})

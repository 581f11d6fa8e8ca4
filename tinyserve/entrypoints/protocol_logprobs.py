"""The API's logprobs objects, from the engine's TokenLogprob lists: chat's ``logprobs``,
the legacy completions object (echoed prompt tokens first) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from typing import Any

from tinyserve.entrypoints.protocol import PromptLogprobs
from tinyserve.outputs import TokenLogprob


def chat_logprobs(
    lps: list[TokenLogprob],
    token_str: Callable[[int], str],
    token_bytes: Callable[[int], bytes] | None = None,
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    ``bytes`` the token's own (``token_bytes``), which add up to the text where a character
    spans tokens (the token's text then is U+FFFD)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = token_str(token_id)
        raw = token_bytes(token_id) if token_bytes is not None else s.encode("utf-8")
        return {"token": s, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


class TextOffsets:
    """A choice's ``text_offset`` run: the character of its text where each token's text
    starts, from the tokens' bytes. A token holding part of a character adds nothing until
    one completes it (counting its U+FFFD text put every later offset one character ahead
    per character split over tokens). Kept across a streamed choice's chunks."""

    def __init__(self) -> None:
        self.offset = 0
        self.lead = 0  # leading spaces of the next token's text that the text lacks
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, raw: bytes) -> int:
        start, text = self.offset, self._decoder.decode(raw)
        lead, self.lead = self.lead, 0
        self.offset += len(text) - (lead if text[:lead].isspace() else 0)
        return start


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text alone: ``decode([id])``, with a SentencePiece piece's leading space
    (``▁the``: Llama 2's, Phi 3's, Mistral v1's tokenizers drop a text's first space, so it
    read "the", one ``top_logprobs`` key with the piece ``the``)."""
    s = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith("\u2581") and not s.startswith(" "):
        return " " + s
    return s


def completion_logprobs(
    lps: list[TokenLogprob],
    token_str: Callable[[int], str],
    token_bytes: Callable[[int], bytes],
    offsets: TextOffsets,
    prompt_ids: list[int] | None = None,
    prompt_lps: list[TokenLogprob | None] | None = None,
    echo_text: str = "",
    unshown: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object, its ``text_offset`` from ``offsets``
    (``echo_text``: the prompt's text, where SentencePiece's first ``▁the`` is "the";
    ``unshown``: generated tokens the text leaves out, special ones it skips).
    Echoed prompt tokens (``prompt_ids``) come first, with their logprobs from ``prompt_lps``
    (the first token's null, as OpenAI's). Each ``top_logprobs`` dict holds the chosen token
    too where it is not among the top ones (OpenAI's and vLLM's up to N + 1). A token that is
    part of a character is named as OpenAI names it, ``bytes:\\xe2\\x80`` (its U+FFFD text
    made different tokens one key of a ``top_logprobs`` dict)."""

    def name(token_id: int) -> str:
        s = token_str(token_id)
        if "\ufffd" not in s:
            return s
        raw = token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                            "top_logprobs": []}  # fmt: skip
    prompt_lps = prompt_lps or [None] * len(prompt_ids or [])
    entries = [
        (t, None, None, True) if lp is None else (t, lp.logprob, lp.top, True)
        for t, lp in zip(prompt_ids or [], prompt_lps, strict=True)
    ]
    entries += [(lp.token_id, lp.logprob, lp.top, lp.token_id not in unshown) for lp in lps]
    if prompt_ids and not echo_text[:1].isspace():
        offsets.lead = 1  # (no space there: a first token's space is not in the text)
    for token_id, logprob, top, shown in entries:
        s = name(token_id)
        out["text_offset"].append(offsets.advance(token_bytes(token_id) if shown else b""))
        out["tokens"].append(s)
        out["token_logprobs"].append(logprob)
        if top is not None:  # OpenAI: the chosen token always, so up to logprobs + 1 entries
            top = {name(t): v for t, v in top}
            top.setdefault(s, logprob)
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(
    lps: list[TokenLogprob | None] | None, token_str: Callable[[int], str]
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token, the token and its top alternatives, each
    ``{"logprob", "rank", "decoded_token"}`` under its id (None for the first token)."""
    if lps is None:
        return None
    out: PromptLogprobs = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): _entry(lp.token_id, lp.logprob, lp.rank, token_str)}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), _entry(t, v, rank, token_str))
        out.append(entry)
    return out


def _entry(token_id: int, logprob: float, rank: int | None, token_str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_str(token_id)}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Llama 3, Qwen2, SmolLM2): its character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: b for b in bs}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + n
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The bytes of one token whose decoded ``text`` is known: that text's where it is whole,
    else (part of a character: U+FFFD) read from the vocabulary's own piece: a byte-level
    BPE piece or SentencePiece's ``<0xE2>``."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and (m := _BYTE_FALLBACK.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    if isinstance(piece, str) and piece and all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return text.encode("utf-8")

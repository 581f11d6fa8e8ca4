"""The API's logprobs objects, from the engine's TokenLogprob lists: chat's ``logprobs``,
the legacy completions object (echoed prompt tokens first) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinyserve.entrypoints.protocol import PromptLogprobs
from tinyserve.outputs import TokenLogprob


def chat_logprobs(lps: list[TokenLogprob], token_str: Callable[[int], str]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def completion_logprobs(
    lps: list[TokenLogprob],
    token_str: Callable[[int], str],
    offset: int,
    prompt_ids: list[int] | None = None,
    prompt_lps: list[TokenLogprob | None] | None = None,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset`` is the text offset of the first
    token. Echoed prompt tokens (``prompt_ids``) come first, with their logprobs from
    ``prompt_lps`` (the first token's null, as OpenAI's). Each ``top_logprobs`` dict holds the
    chosen token too where it is not among the top ones (OpenAI's and vLLM's up to N + 1)."""
    out: dict[str, list] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    prompt_lps = prompt_lps or [None] * len(prompt_ids or [])
    entries = [
        (t, None, None) if lp is None else (t, lp.logprob, lp.top)
        for t, lp in zip(prompt_ids or [], prompt_lps, strict=True)
    ]
    entries += [(lp.token_id, lp.logprob, lp.top) for lp in lps]
    for token_id, logprob, top in entries:
        s = token_str(token_id)
        out["text_offset"].append(offset)
        out["tokens"].append(s)
        out["token_logprobs"].append(logprob)
        if top is not None:  # OpenAI: the chosen token always, so up to logprobs + 1 entries
            top = {token_str(t): v for t, v in top}
            top.setdefault(s, logprob)
        out["top_logprobs"].append(top)
        offset += len(s)
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

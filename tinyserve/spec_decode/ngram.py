"""Prompt-lookup n-gram proposals (vLLM's ``ngram`` method, llama.cpp's lookup decoding).
Torch-free.

For a request whose tokens end in ``... a b c``, find the latest earlier occurrence of the
longest suffix (``prompt_lookup_max`` tokens down to ``prompt_lookup_min``) in the prompt and
output so far, and propose the tokens that followed it there, up to ``k``. The proposal is a
point mass: verification (worker/model_runner.py) accepts each token exactly as plain
decoding would have produced it, so a bad proposal costs compute, never correctness.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("i").itemsize  # bytes per token id in the packed sequence


def propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens``, or [] when no suffix of length
    ``lookup_min..lookup_max`` occurred earlier.

    Runs on the scheduler's per-step path for every drafting request, so the search is
    ``bytes.rfind`` over the packed ids (C speed), not a Python loop over the context; a
    hit at a byte offset inside a token is skipped."""
    n = len(tokens)
    if k < 1 or n < lookup_min + 1:
        return []
    data = array("i", tokens).tobytes()
    for size in range(min(lookup_max, n - 1), lookup_min - 1, -1):
        suffix = data[(n - size) * _WIDTH :]
        # An earlier occurrence starts at token s <= n - size - 1, so it ends by token n - 1
        # and at least one token follows it.
        end = (n - 1) * _WIDTH
        pos = data.rfind(suffix, 0, end)
        while pos > 0 and pos % _WIDTH:  # latest match first; skip misaligned hits
            pos = data.rfind(suffix, 0, pos + len(suffix) - 1)
        if pos >= 0 and pos % _WIDTH == 0:
            start = pos // _WIDTH + size
            return list(tokens[start : start + k])
    return []

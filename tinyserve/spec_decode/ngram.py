"""Prompt-lookup n-gram proposals (vLLM's ``ngram`` method, llama.cpp's lookup decoding).
Torch-free.

For a request whose tokens end in ``... a b c``, find the latest earlier occurrence of the
longest suffix (``prompt_lookup_max`` tokens down to ``prompt_lookup_min``) in the prompt and
output so far, and propose the tokens that followed it there, up to ``k``. The proposal is a
point mass: verification (worker/model_runner.py) accepts each token exactly as plain
decoding would have produced it, so a bad proposal costs compute, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens``, or [] when no suffix of length
    ``lookup_min..lookup_max`` occurred earlier."""
    n = len(tokens)
    if k < 1 or n < lookup_min + 1:
        return []
    for size in range(min(lookup_max, n - 1), lookup_min - 1, -1):
        suffix = list(tokens[n - size :])
        first = suffix[0]
        # Latest match first: recent context predicts the continuation best.
        for start in range(n - size - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + size]) == suffix:
                follow = tokens[start + size : start + size + k]
                if follow:
                    return list(follow)
    return []

"""Grammar helpers for tests/structured: unpacking a token bitmask, a random walk through a
grammar until it ends."""

from __future__ import annotations

import random

import torch


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    """The token ids whose bit is set in ``bitmask[row]`` (reference unpacking, per bit)."""
    words = bitmask[row].tolist()
    return [w * 32 + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1]


def random_walk(backend, compiled, seed: int, prefer=None, max_steps: int = 800):
    """Token ids from the start state to termination, each drawn among the allowed ones."""
    rng = random.Random(seed)
    matcher = backend.matcher(compiled)
    bitmask = backend.allocate_bitmask(1)
    ids: list[int] = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return ids
        matcher.fill_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten().nonzero().flatten()  # [num_allowed]
        assert len(allowed), "a live grammar state with no allowed token"
        preferred = allowed[prefer[allowed]] if prefer is not None else allowed[:0]
        pool = preferred if len(preferred) and rng.random() < 0.5 else allowed
        token = int(pool[rng.randrange(len(pool))])
        assert matcher.accept_tokens([token]), token
        ids.append(token)
    raise AssertionError(f"no termination in {max_steps} steps")

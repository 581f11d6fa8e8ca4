"""The grammar backend over SmolLM2's tokenizer (vocab 49,152), built once per session, and a
random walk: sample allowed tokens until the grammar ends."""

from __future__ import annotations

import random

import pytest
import torch

from tinyserve.structured.backend import GrammarBackend


@pytest.fixture(scope="session")
def backend(smollm2_tokenizer):
    return GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer))


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    """The token ids whose bit is set in ``bitmask[row]`` (reference unpacking, per bit)."""
    words = bitmask[row].tolist()
    return [w * 32 + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1]


@pytest.fixture(scope="session")
def closing_ids(smollm2_tokenizer):
    """Tokens that end a value or a container: walks prefer them half the time so that
    unbounded strings and arrays end in a few dozen steps instead of thousands. A bool mask
    over the vocabulary."""
    closers = ('"', "}", "]", ",")
    ids = set()
    for t in range(len(smollm2_tokenizer)):
        text = smollm2_tokenizer.decode([t])
        short = any(c in text for c in closers) and len(text) <= 3
        if short or text.strip() in ("null", "true", "0"):  # leaves end recursive values
            ids.add(t)
    ids.add(smollm2_tokenizer.eos_token_id)
    mask = torch.zeros(len(smollm2_tokenizer), dtype=torch.bool)
    mask[list(ids)] = True
    return mask


@pytest.fixture(scope="session")
def walk():
    return random_walk


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

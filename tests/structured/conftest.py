"""The grammar backend over SmolLM2's tokenizer (vocab 49,152), built once per session, and a
random walk: sample allowed tokens until the grammar ends."""

from __future__ import annotations

import pytest
import torch

from tests.support.structured import random_walk
from tinyserve.structured.backend import GrammarBackend


@pytest.fixture(scope="session")
def backend(smollm2_tokenizer):
    return GrammarBackend(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer))


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

"""Shared fixtures. The default model (SmolLM2-135M GGUF) is fetched once into the cache
folder by scripts/fetch_default_model.sh (CI does this before the tests)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    from tinyserve.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from transformers import AutoTokenizer

    from tinyserve.models.default_model import tokenizer_dir_for

    return AutoTokenizer.from_pretrained(str(tokenizer_dir_for(smollm2_gguf_path)))

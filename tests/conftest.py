"""Shared fixtures. The default model (SmolLM2-135M GGUF) is fetched once into the cache
folder by scripts/fetch_default_model.sh (CI does this before the tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# benchmarks/soak.py and benchmarks/fuzz.py hold the soak, overload and fuzz drivers; the
# tests run them smaller, so the figures in docs/reliability.md and the suite share one code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    from tinyserve.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from transformers import AutoTokenizer

    from tinyserve.models.default_model import tokenizer_dir_for

    return AutoTokenizer.from_pretrained(str(tokenizer_dir_for(smollm2_gguf_path)))

"""Fixtures for the engine acceptance tests (CPU, fp32); the helpers they use live in
tests/support/engine.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import build_llm
from tinyserve.engine.llm_engine import LLMEngine

# ---------------------------------------------------------------- models


@pytest.fixture(scope="session")
def smol_path(smollm2_gguf_path) -> str:
    return str(smollm2_gguf_path)


@pytest.fixture(scope="session")
def fuzz_model(smollm2_gguf_path, tmp_path_factory) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer: fast, and it samples nonsense, so
    every well-formed constrained output is the grammar's doing."""
    from tinyserve.models.default_model import tokenizer_dir_for
    from tinyserve.testing.checkpoints import build_fuzz_model

    dest = tmp_path_factory.mktemp("fuzz_model") / "model"
    return str(build_fuzz_model(dest, tokenizer_dir_for(smollm2_gguf_path)))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory) -> str:
    """A tiny random Qwen2 (q/k/v bias, GQA, untied head) written by transformers."""
    from tinyserve.testing.checkpoints import engine_qwen2

    return str(engine_qwen2(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def tiny_qwen2_hf(tiny_qwen2_path):
    """The same checkpoint as a transformers model: an independent dense reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_llm(smol_path):
    """The SmolLM2 ``LLM`` most tests share: block 16, 256 blocks, prefix caching on."""
    return build_llm(model=smol_path, num_blocks=256, block_size=16, max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def smol_engine(smol_llm) -> LLMEngine:
    return smol_llm.engine

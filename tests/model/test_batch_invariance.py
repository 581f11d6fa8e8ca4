"""A request's logits are bitwise the same alone, batched with 1-63 others (in its prefill
step and in every decode step), and after a prefix-cache hit: one numeric path per layer
whatever the row count (the CPU kernels' contract; docs/architecture.md). SmolLM2, the
default configuration (fp32 activations, the GGUF's blocks, the block-table attention)."""

from __future__ import annotations

import random

import pytest
import torch
from paged_runner import PagedRunner

from tinyserve.kernels import attention, gemm
from tinyserve.models.loader import load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not gemm.available() or attention.library() is None,
        reason="the batch-invariant path needs the AVX2 kernels (x86 CPU with AVX2/FMA/F16C)",
    ),
]

PROMPT_LEN, DECODE_STEPS, BLOCK = 40, 6, 16


@pytest.fixture(scope="module")
def model(smollm2_gguf_path):
    net, _ = load_model(smollm2_gguf_path, torch.float32, "cpu")
    assert net.attention_backend == "kernel"
    return net


@pytest.fixture(scope="module")
def target():
    rng = random.Random(0)
    return [rng.randrange(100, 49000) for _ in range(PROMPT_LEN + DECODE_STEPS)]


@pytest.fixture(scope="module")
def alone(model, target):
    return PagedRunner(model, BLOCK, num_blocks=16).prefill_then_decode(target, PROMPT_LEN)


@pytest.mark.parametrize("batch", [1, 7, 33, 64])
def test_logits_alone_equal_logits_batched(model, target, alone, batch):
    rng = random.Random(batch)
    others = {f"o{i}": [rng.randrange(100, 49000) for _ in range(rng.randint(2, 20))]
              for i in range(batch - 1)}  # fmt: skip
    runner = PagedRunner(model, BLOCK, num_blocks=8 * batch + 16, seed=batch)
    # One step prefills everyone (the target's chunk among the others' prompts) ...
    order = list(others.items())
    at = rng.randrange(len(order) + 1)
    chunks = order[:at] + [("t", target[:PROMPT_LEN])] + order[at:]
    rows = [runner.step(chunks)[at]]
    # ... then every sequence decodes one token per step: `batch` rows per step.
    for tok in target[PROMPT_LEN:]:
        step = [(seq, [rng.randrange(100, 49000)]) for seq, _ in order]
        step.insert(at, ("t", [tok]))
        rows.append(runner.step(step)[at])
    batched = torch.cat(rows)
    assert torch.equal(batched, alone), f"max |diff| {(batched - alone).abs().max():.3g}"


def test_logits_alone_equal_logits_after_a_prefix_cache_hit(model, target, alone):
    runner = PagedRunner(model, BLOCK, num_blocks=16, seed=3)
    cached = 2 * BLOCK  # two whole blocks computed by an earlier request
    runner.step([("earlier", target[:cached] + [7, 8, 9])])
    runner.share_prefix("t", "earlier", cached)
    rows = [runner.step([("t", target[cached:PROMPT_LEN])])[0]]
    for tok in target[PROMPT_LEN:]:
        rows.append(runner.step([("t", [tok])])[0])
    hit = torch.cat(rows)
    assert torch.equal(hit, alone[cached:])

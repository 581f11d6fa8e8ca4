"""The sampler's grammar bitmask stage against a per-token reference: only allowed tokens are
ever sampled, greedy picks the best allowed token, logprobs are those of the masked
distribution, and unconstrained rows of the same batch are untouched."""

from __future__ import annotations

import math

import torch

from tinyserve.sampling_params import SamplingParams
from tinyserve.worker.sampler import (
    LOGPROB_FLOOR,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    unpack_bitmask,
)

V = 100  # not a multiple of 32: the last word is partial


def _bitmask(allowed: list[set[int]], words: int = 4) -> torch.Tensor:
    out = torch.zeros(len(allowed), words, dtype=torch.int32)
    for r, toks in enumerate(allowed):
        for t in toks:
            word, bit = divmod(t, 32)
            value = int(out[r, word]) & 0xFFFFFFFF | (1 << bit)
            out[r, word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32
    return out


def test_unpack_matches_a_per_bit_reference():
    g = torch.Generator().manual_seed(0)
    allowed = [set(torch.randperm(V, generator=g)[:k].tolist()) for k in (1, 7, 50, 99)]
    allowed.append({31, 63, 95})  # sign bits of the int32 words
    bits = unpack_bitmask(_bitmask(allowed), V)
    assert bits.shape == (len(allowed), V)
    for r, toks in enumerate(allowed):
        assert {i for i in range(V) if bits[r, i]} == toks
    # a mask narrower than the vocabulary allows nothing past its width
    assert not unpack_bitmask(_bitmask([{3}], words=1), V)[0, 32:].any()


def _rows(params_list, masks):
    return [
        SamplingRow(
            params=p,
            prompt_token_ids=[1, 2],
            output_token_ids=[],
            grammar_bitmask=m,
        )
        for p, m in zip(params_list, masks, strict=True)
    ]


def test_masked_rows_sample_only_allowed_tokens_and_others_are_untouched():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 3
    allowed = {5, 17, 40, 99}
    mask = _bitmask([allowed])[0]
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    hot = SamplingParams(temperature=1.5, seed=3, logprobs=2)
    rows = _rows([greedy, hot, greedy], [mask, mask, None])
    out = Sampler()(logits, SamplingMetadata.build(rows, V, torch.device("cpu")))
    tokens = out.sampled_token_ids.tolist()
    best_allowed = max(allowed, key=lambda t: float(logits[0, t]))
    assert tokens[0] == best_allowed
    assert tokens[1] in allowed
    assert tokens[2] == int(logits[2].argmax())  # the unconstrained row
    # logprobs of the masked distribution: a softmax over the allowed tokens only
    ref = torch.log_softmax(logits[0, sorted(allowed)], dim=-1)
    assert math.isclose(float(out.logprobs[0]), float(ref.max()), rel_tol=1e-5)
    assert set(out.top_token_ids[0].tolist()) <= allowed
    # More top logprobs than allowed tokens: the rest are masked ones, at vLLM's floor, never
    # -inf (a JSON body cannot hold it).
    six = _rows([SamplingParams(temperature=0.0, logprobs=6)], [mask])
    out6 = Sampler()(logits[:1], SamplingMetadata.build(six, V, torch.device("cpu")))
    top = out6.top_logprobs[0].tolist()
    assert set(out6.top_token_ids[0, :4].tolist()) == allowed and top[4:] == [LOGPROB_FLOOR] * 2
    assert all(math.isfinite(v) for v in top)
    assert math.isclose(
        float(out.logprobs[2]), float(torch.log_softmax(logits[2], -1).max()), rel_tol=1e-5
    )


def test_random_draws_respect_the_mask_over_many_seeds():
    logits = torch.zeros(1, V)  # uniform: any leak would show quickly
    allowed = {0, 33, 64, 98}
    for seed in range(200):
        p = SamplingParams(temperature=1.0, seed=seed, top_p=0.9, top_k=50, min_p=0.01)
        meta = SamplingMetadata.build(_rows([p], [_bitmask([allowed])[0]]), V, torch.device("cpu"))
        assert int(Sampler()(logits, meta).sampled_token_ids[0]) in allowed


def test_extreme_penalties_and_temperatures_never_leave_the_mask():
    """A repetition penalty of 5.7e-60 (valid: (0, 10]) was 0 in float32: -inf * 0 made the
    masked tokens NaN and argmax took one (found by schemathesis as a 500, "the grammar
    rejected token"); a tiny temperature made allowed logits +inf and softmax NaN. Every row
    still samples an allowed token, greedy or not."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, V, generator=g) * 8
    allowed = {3, 20, 41}
    mask = _bitmask([allowed])[0]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=5.684763150790571e-60),
        SamplingParams(temperature=1.0, repetition_penalty=5.684763150790571e-60, seed=1),
        SamplingParams(temperature=1e-30, seed=2),
        SamplingParams(temperature=1e-30, repetition_penalty=1e-45, min_p=0.85, seed=3),
    ]
    rows = [SamplingRow(params=p, prompt_token_ids=list(range(V)), output_token_ids=[3, 20],
                        grammar_bitmask=mask) for p in params]  # fmt: skip
    for _ in range(5):
        out = Sampler()(logits, SamplingMetadata.build(rows, V, torch.device("cpu")))
        assert set(out.sampled_token_ids.tolist()) <= allowed

"""Speculative decoding keeps the sampling distribution: on a toy model with 8 tokens the
emitted tokens' distribution at each position, and the joint of the first two, match plain
sampling (two-sample chi-squared, 10,000 samples a side), while drafts are both accepted and
rejected often; and the verification rule itself, on hand-made sampler outputs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.support.engine import assert_no_leaks, build_engine, drain
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing.checkpoints import llama_config, write_checkpoint
from tinyserve.worker.model_runner import ModelRunner
from tinyserve.worker.sampler import SamplerOutput

pytestmark = pytest.mark.slow

V, N, STEPS = 8, 10_000, 4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # the proposer drafts 3, 1, 2 ... from the start
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch_size": 100_000, "adaptive": False}  # fmt: skip
# Suffix decoding: the drafts also come from earlier requests' sampled outputs (the global
# cache), the most frequent continuation first.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "max_batch_size": 100_000,
          "adaptive": False}  # fmt: skip


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory) -> str:
    # Small weights: soft distributions, so every token is likely enough to show up.
    cfg = llama_config(vocab_size=V, initializer_range=0.15, num_hidden_layers=2,
                       bos_token_id=None, eos_token_id=None)  # fmt: skip
    return str(write_checkpoint(tmp_path_factory.mktemp("toy") / "m", cfg, seed=5))


def _samples(path: str, spec) -> list[tuple[int, ...]]:
    engine = build_engine(model=path, speculative_config=spec, load_tokenizer=False,
                          num_blocks=4096, block_size=4, max_num_seqs=512,
                          max_num_batched_tokens=4096)  # fmt: skip
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=STEPS, ignore_eos=True)
    for i in range(N):
        engine.add_request(f"q{i}", PROMPT, params)
    out = drain(engine)
    assert_no_leaks(engine)
    stats = engine.core.proposer.stats if spec else None
    if stats is not None:
        rate = stats.num_accepted_tokens / stats.num_draft_tokens
        assert stats.num_drafts > N and 0.1 < rate < 0.9, stats  # both outcomes, often
    return [tuple(out[f"q{i}"].token_ids) for i in range(N)]


def _p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-squared test of equal distributions (equal sample sizes)."""
    cells = [c for c in set(a) | set(b)]
    stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
    df = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def plain_samples(toy_model) -> list[tuple[int, ...]]:
    return _samples(toy_model, None)


@pytest.mark.parametrize("spec_config", [SPEC, SUFFIX], ids=["ngram", "suffix"])
def test_emitted_tokens_follow_the_plain_sampling_distribution(
    toy_model, plain_samples, spec_config
):
    plain, spec = plain_samples, _samples(toy_model, spec_config)
    for pos in range(STEPS):
        p = _p_value(Counter(s[pos] for s in plain), Counter(s[pos] for s in spec))
        assert p > 0.01, (pos, p)
    assert _p_value(Counter(s[:2] for s in plain), Counter(s[:2] for s in spec)) > 0.01
    # The test can tell distributions apart: the first token is far from uniform, and the
    # second depends on the first.
    uniform = Counter({t: N // V for t in range(V)})
    assert _p_value(Counter(s[0] for s in plain), uniform) < 1e-6
    shifted = Counter((s[0], s[2]) for s in plain)
    assert _p_value(Counter(s[:2] for s in plain), shifted) < 1e-6


class _Req:
    def __init__(self, rid, logprobs=None):
        self.request_id = rid
        self.sampling_params = SamplingParams(logprobs=logprobs)


def test_verification_keeps_drafts_while_they_match_then_the_sampled_token():
    ys = [5, 6, 7, 9, 1, 2, 3, 4, 8]  # rows: a (3 drafts + bonus), b (no drafts), c (3 + 1)
    out = SamplerOutput(torch.tensor(ys), torch.arange(9.0), torch.tensor([[t] for t in ys]),
                        torch.zeros(9, 1))  # fmt: skip
    sampling = [(_Req("a", 1), [5, 6, 0]), (_Req("b"), []), (_Req("c", 1), [2, 3, 4])]
    res = ModelRunner._to_host(sampling, out)
    assert res.sampled_token_ids == {"a": [5, 6, 7], "b": [1], "c": [2, 3, 4, 8]}
    assert [lp.logprob for lp in res.logprobs["a"]] == [0.0, 1.0, 2.0]
    assert [lp.token_id for lp in res.logprobs["c"]] == [2, 3, 4, 8]
    assert "b" not in res.logprobs

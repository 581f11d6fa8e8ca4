"""The n-gram proposer, its config and the adaptive policy, against a brute-force reference."""

from __future__ import annotations

import random

import pytest

from tinyserve.request import Request
from tinyserve.sampling_params import SamplingParams
from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.ngram import propose
from tinyserve.spec_decode.proposer import NgramProposer, acceptance_threshold


def reference(tokens, k, lo, hi):
    """Longest suffix first, then its latest earlier occurrence with a continuation."""
    n = len(tokens)
    for size in range(hi, lo - 1, -1):
        if size >= n:
            continue
        suffix = tokens[n - size :]
        starts = [s for s in range(n - size) if tokens[s : s + size] == suffix]
        for s in reversed(starts):
            if tokens[s + size : s + size + k]:
                return tokens[s + size : s + size + k]
    return []


def test_matches_the_reference_on_random_sequences():
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        tokens = [rng.randrange(6) for _ in range(rng.randint(0, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        got = propose(tokens, k, lo, hi)
        assert got == reference(tokens, k, lo, hi), (tokens, k, lo, hi)
        hits += bool(got)
    assert 500 < hits < 2900  # both outcomes are exercised


def test_longest_and_latest_match_wins():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 9, 5, 1, 2, 3, 4, 1, 2]
    assert propose(tokens, 3, 1, 2) == [3, 4, 1]  # [1, 2] last seen at 5, then 3 4 1
    assert propose([5, 1, 2, 8, 0, 5, 1, 2, 6, 1, 5, 1, 2], 2, 2, 3) == [6, 1]  # [5, 1, 2]
    assert propose([1, 2, 3], 4, 2, 4) == []
    assert propose([4, 4], 3, 1, 1) == [4]


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"method": "eagle"}', "method must be 'ngram'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min (5) is larger"),
        ('{"lookahead": 3}', "unknown key(s) 'lookahead'"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_name_the_field(value, message):
    with pytest.raises(ValueError, match="speculative_config") as e:
        SpeculativeConfig.parse(value)
    assert message in str(e.value)


def test_vllm_json_parses():
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}'
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 2)
    assert SpeculativeConfig.parse(None) is None


def _request(tokens, max_tokens=100, max_model_len=1000):
    req = Request(
        "r", tokens[:2], SamplingParams(max_tokens=max_tokens), max_model_len=max_model_len
    )
    for t in tokens[2:]:
        req.append_output_token(t)
    return req


def test_drafts_respect_max_tokens_context_budget_and_batch_size():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, max_batch_size=4))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert p.drafts(_request(tokens), budget=100, num_running=1) == [3, 4, 5, 6]
    # max_tokens: 6 outputs so far of 9: at most 9 - 6 - 1 = 2 drafts (room for the bonus).
    assert p.drafts(_request(tokens, max_tokens=9), 100, 1) == [3, 4]
    assert p.drafts(_request(tokens, max_model_len=10), 100, 1) == [3]
    assert p.drafts(_request(tokens), budget=3, num_running=1) == [3, 4]
    assert p.drafts(_request(tokens), budget=100, num_running=5) == []


def test_low_acceptance_backs_off_then_probes():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.3))
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    for _ in range(3):
        p.record("r", 4, 0)
    assert p.drafts(req, 100, 1) == []  # backed off
    drafted = [bool(p.drafts(req, 100, 1)) for _ in range(8)]
    assert drafted.count(True) == 1  # probes once in a while
    assert p.stats.num_drafts == 3 and p.stats.num_accepted_tokens == 0
    p.record("r", 4, 4)
    p.record("r", 4, 4)
    assert p.drafts(req, 100, 1)  # recovered
    assert p.stats.accepted_per_pos == [2, 2, 2, 2]


def test_the_acceptance_bar_rises_with_the_batch():
    assert acceptance_threshold(0.2, 1) == pytest.approx(0.2)
    assert acceptance_threshold(0.2, 4) == pytest.approx(0.5)
    assert acceptance_threshold(0.2, 8) == pytest.approx(2 / 3)
    assert acceptance_threshold(0.0, 8) == 0.0 and acceptance_threshold(1.0, 8) == 1.0
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.2))
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    p.record("r", 4, 2)  # acceptance average 0.75
    p.record("r", 4, 1)  # 0.5
    assert p.drafts(req, 100, num_running=1) == [3, 4, 5, 6]  # 0.5 >= 0.2
    assert p.drafts(req, 100, num_running=3) == [3, 4, 5, 6]  # 0.5 >= 0.43
    assert p.drafts(req, 100, num_running=8) == []  # 0.5 < 0.67: backs off

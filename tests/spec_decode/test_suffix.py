"""Suffix decoding's sources (spec_decode/suffix.py) and its config, without a model."""

from __future__ import annotations

from array import array

import pytest

from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.suffix import SuffixCache, SuffixParams, best_draft, speculate

PARAMS = SuffixParams(max_depth=24, max_spec_factor=4.0, min_token_prob=0.1)


def _own(tokens, k=8, factor=4.0, min_prob=0.0):
    data = array("i", tokens).tobytes()
    return speculate(data, tokens, tokens, k, 24, factor, min_prob)


def test_longest_suffix_then_the_most_frequent_continuation():
    # "1 2" is followed by 3 twice and by 4 once: 3 wins although 4 is the latest.
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    draft = _own(tokens, k=1)
    assert draft.tokens == [3] and draft.score == pytest.approx(2 / 3)
    # A longer match decides over a more frequent short one: "5 1 2" occurred once, with 4.
    tokens = [1, 2, 3, 1, 2, 3, 5, 1, 2, 4, 6, 5, 1, 2]
    assert _own(tokens, k=2).tokens == [4, 6]
    # Ties go to the latest occurrence (as prompt lookup does).
    assert _own([1, 2, 3, 1, 2, 4, 1, 2], k=1).tokens == [4]


def test_path_probability_and_the_limits():
    tokens = [7, 1, 2, 3, 4, 8, 7, 1, 2, 3, 5, 9, 7, 1, 2, 3, 5, 6, 7]
    draft = _own(tokens, k=8, factor=8.0)
    # After "7" (the longest match): "1 2 3" three times, then 5 two of three times, then
    # 9 or 6 (the latest wins the tie), then 7 and on as the draft itself goes: path
    # probabilities 1, 1, 1, 2/3, 1/3, 1/3, 1/3, 1/3.
    assert draft.tokens == [1, 2, 3, 5, 6, 7, 1, 2]
    assert draft.score == pytest.approx(3 + 2 / 3 + 4 / 3)
    assert _own(tokens, k=8, factor=8.0, min_prob=0.5).tokens == [1, 2, 3, 5]  # min_token_prob
    assert _own(tokens, k=2, factor=8.0).tokens == [1, 2]  # k
    assert _own(tokens, k=8, factor=3.0).tokens == [1, 2, 3]  # max_spec_factor x match length
    # A repeating text repeats on past the request's end (the latest match is 3 back).
    assert _own([1, 2, 3, 1, 2, 3], k=7, factor=8.0).tokens == [1, 2, 3, 1, 2, 3, 1]
    assert _own([1, 2, 3], k=4).tokens == []  # nothing occurred before
    assert _own([5], k=4).tokens == []


def test_global_outputs_draft_and_never_span_two_outputs():
    cache = SuffixCache(max_requests=10, max_tokens=100)
    cache.add(None, [10, 11, 12, 13])
    cache.add(None, [14, 15])
    assert best_draft([1, 2, 10, 11], cache, None, 8, PARAMS) == [12, 13]  # not into 14
    # Its own tokens win where they score higher.
    tokens = [10, 11, 20, 21, 22, 10, 11, 20, 21, 22, 10, 11]
    assert best_draft(tokens, cache, None, 3, PARAMS) == [20, 21, 22]


def test_salts_are_separate_namespaces():
    cache = SuffixCache(max_requests=10, max_tokens=100)
    cache.add("alice", [10, 11, 12, 13])
    assert best_draft([10, 11], cache, "alice", 4, PARAMS) == [12, 13]
    assert best_draft([10, 11], cache, "bob", 4, PARAMS) == []
    assert best_draft([10, 11], cache, None, 4, PARAMS) == []
    cache.add(None, [10, 11, 30])
    assert best_draft([10, 11], cache, None, 4, PARAMS) == [30]
    assert best_draft([10, 11], cache, "alice", 4, PARAMS) == [12, 13]


def test_oldest_outputs_are_evicted_past_either_cap():
    cache = SuffixCache(max_requests=3, max_tokens=10)
    for i in range(4):
        cache.add("s" if i % 2 else None, [100 + i] * 3)
    assert len(cache) == 3 and cache.num_tokens == 9  # the first went (max_requests)
    assert list(cache.corpus(None)[0]) == [102, 102, 102, -1]
    cache.add(None, [7] * 5)  # 14 tokens: the two oldest go (max_tokens)
    assert len(cache) == 2 and cache.num_tokens == 8
    assert cache.corpus(None) is not None and list(cache.corpus("s")[0]) == [103] * 3 + [-1]
    cache.add(None, list(range(50)))  # longer than the cap: its last 10 tokens, alone
    assert len(cache) == 1 and list(cache.corpus(None)[0]) == list(range(40, 50)) + [-1]
    assert cache.corpus("s") is None


def test_suffix_config_and_bad_values_name_the_field():
    cfg = SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 16}')
    assert cfg.suffix and cfg.num_speculative_tokens == 16
    assert cfg.suffix_decoding_max_tree_depth == 16
    assert SpeculativeConfig.parse('{"method": "ngram"}').num_speculative_tokens == 4
    for value, message in [
        ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "max_tree_depth must be"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "min_token_prob must be"),
        ('{"method": "suffix", "suffix_decoding_max_spec_factor": -1}', "max_spec_factor must"),
        ('{"method": "suffix", "suffix_decoding_max_cached_tokens": "x"}', "max_cached_tokens"),
        ('{"method": "eagle"}', "method must be 'ngram' or 'suffix'"),
    ]:
        with pytest.raises(ValueError, match="speculative_config") as e:
            SpeculativeConfig.parse(value)
        assert message in str(e.value)

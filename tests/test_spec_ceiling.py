"""benchmarks/spec_ceiling.py's replay and pricing (the model-free half of the ceiling
argument for issue 14's one-stream target), on token sequences built so that the right
answer can be worked out by hand."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ceiling():
    from benchmarks import spec_ceiling

    return spec_ceiling


CFG = {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_replay_of_an_output_that_copies_its_prompt(ceiling):
    prompt = list(range(100, 140))  # 40 distinct tokens
    out = prompt[:30]  # the answer repeats the prompt
    steps = ceiling.replay(prompt, out, "ngram", CFG)
    # out[0] comes from the prefill; at out[1] the context ends (139, 100): no earlier
    # 2-gram, a plain step. From then on every step drafts 4 that all hold (5 tokens a
    # step) until the last, capped by max_tokens: 2 drafts for the last 3 tokens.
    assert steps == [(0, 0)] + [(4, 4)] * 5 + [(2, 2)]
    assert sum(a + 1 for _, a in steps) == len(out) - 1


def test_the_oracle_finds_the_earlier_match_the_latest_one_misses(ceiling):
    prompt = [5, 1, 2, 3, 9, 9, 9, 6, 1, 2, 3, 7, 7, 7, 8]
    out = [1, 2, 3, 9, 9, 9]
    ngram = ceiling.replay(prompt, out, "ngram", CFG)
    oracle = ceiling.replay(prompt, out, "oracle", CFG)
    # The proposer (2-grams and up): no match after (8, 1), a plain step; after (1, 2), with
    # room for 3 drafts (max_tokens), the latest earlier occurrence continues 3, 7, 7: one
    # holds. The oracle matches single tokens too: after 1, the prompt's first 1 continues
    # 2, 3, 9, 9 — all 4 drafts the room allows.
    assert ngram[:2] == [(0, 0), (3, 1)]
    assert oracle == [(4, 4)]
    for steps in (ngram, oracle):
        assert sum(a + 1 for _, a in steps) == len(out) - 1


def test_pricing_orders_the_bounds(ceiling):
    from tinyserve.spec_decode.cost import PRIOR_ROW_COST, StepCostModel

    cost = StepCostModel()
    for rows, seconds in ((1, 0.010), (2, 0.014), (5, 0.026)):
        cost.observe(rows, seconds)
    steps = [(0, 0), (4, 4), (4, 1), (2, 0), (4, 3)]
    n = 1 + sum(a + 1 for _, a in steps)
    p = ceiling.price(steps, cost, ttft=0.2, n=n)
    assert p["bound_free_rows"] > p["bound"] > p["full"]
    plain = 0.2 + (n - 1) * 0.010
    t4 = 0.014 + (0.026 - 0.014) * 2 / 3  # between the measured 2 and 5 rows
    assert p["bound"] == pytest.approx(plain / (0.2 + 0.010 + 0.026 + 0.014 + 0.010 + t4))
    # rows past the measured ones: the engine's own estimate (the prior's price a row)
    t7 = 0.026 + 2 * PRIOR_ROW_COST * 0.010
    t3 = 0.014 + (0.026 - 0.014) / 3
    assert p["full"] == pytest.approx(plain / (0.2 + 0.010 + 0.026 + 0.026 + t3 + 0.026))
    assert ceiling.price([(6, 6)], cost, ttft=0.2, n=8)["bound"] == pytest.approx(
        (0.2 + 7 * 0.010) / (0.2 + t7)
    )
    # nothing drafted: no gain whatever the price
    assert ceiling.price([(0, 0)] * 9, cost, ttft=0.2, n=10)["bound_free_rows"] == pytest.approx(
        1.0
    )


def test_earliest_and_vote_pick_other_matches_than_the_latest(ceiling):
    from tinyserve.spec_decode.ngram import propose

    # the suffix (1, 2) occurs three times before the end: continued by 3 (first), 4, 4
    ctx = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 4, 5, 1, 2]
    assert propose(ctx, 2, 2, 4) == [4, 5]  # the latest occurrence, at 8
    assert ceiling.propose_earliest(ctx, 2, 2, 4) == [3, 0]
    # vote: after (1, 2) the continuations are 3, 4, 4 -> 4; then the longest suffix with an
    # earlier occurrence is (1, 2, 4) (at 4 and 8), continued by 0 and 5 once each: the
    # tie goes to the later, 5
    assert ceiling.propose_vote(ctx, 2, 2, 4) == [4, 5]
    assert ceiling.propose_vote([7, 8, 9], 3, 2, 4) == []  # no earlier (8, 9)
    assert ceiling.propose_earliest([7, 8, 9], 3, 2, 4) == []


def test_vote_drafts_past_the_end_of_one_match(ceiling):
    from tinyserve.spec_decode.ngram import propose

    # (5, 6) occurred once, at 0: its continuation runs into the context's end after 3
    # tokens. The vote searches again after each token it drafts, so it goes on: after
    # 7 the suffix (5, 6, 7, 5) occurred at 0 (-> 6), then (6, 7, 5, 6) at 1 (-> 7).
    ctx = [5, 6, 7, 5, 6]
    assert propose(ctx, 4, 2, 4) == [7, 5, 6]
    assert ceiling.propose_vote(ctx, 4, 2, 4) == [7, 5, 6, 7]
    out = [6, 7, 5, 6, 7, 5]  # after the prompt [5, 6, 7, 5]; out[0] from the prefill
    assert ceiling.replay([5, 6, 7, 5], out, "vote", CFG) == [(4, 4)]
    assert ceiling.replay([5, 6, 7, 5], out, "ngram", CFG) == [(3, 3), (0, 0)]


def test_a_suffix_tree_keeps_the_branch_the_chain_drops(ceiling):
    from tinyserve.spec_decode.suffix import SuffixCache

    # The context ends (1, 2), which continued 10, 11 once and 20, 21 later: a tie, so the
    # chain drafts the latest (20, 21) and the output (10, 11) rejects it; the next step's
    # (2, 10) has one continuation, 11. A 4-node tree holds both branches: 2 accepted at once.
    prompt, out = [1, 2, 10, 11, 1, 2, 20, 21, 1], [2, 10, 11, 5]
    chain = ceiling.replay_suffix(prompt, out, SuffixCache(10, 100), None)
    assert chain == [(2, 0), (1, 1)]
    tree = ceiling.replay_suffix(prompt, out, SuffixCache(10, 100), 4)
    assert tree == [(4, 2)]
    assert ceiling.tree_proposal(prompt + out[:1], SuffixCache(10, 100), 2, 4,
                                 ceiling.SuffixParams()) == {(10,), (10, 11), (20,), (20, 21)}  # fmt: skip
    # Earlier outputs are a source too: with (1, 2, 30) in the cache, a third branch.
    cache = SuffixCache(10, 100)
    cache.add(None, [1, 2, 30])
    assert (30,) in ceiling.tree_proposal(prompt + out[:1], cache, 2, 8, ceiling.SuffixParams())

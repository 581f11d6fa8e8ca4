"""The n-gram proposer, its config and the adaptive policy, against a brute-force reference."""

from __future__ import annotations

import random

import pytest

from tinyserve.request import Request
from tinyserve.sampling_params import SamplingParams
from tinyserve.spec_decode import proposer as proposer_module
from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.cost import StepCostModel
from tinyserve.spec_decode.ngram import propose
from tinyserve.spec_decode.proposer import NgramProposer, best_draft_length, expected_tokens


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
        ('{"method": "eagle"}', "method must be 'ngram' or 'suffix'"),
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


def _decoding(tokens):
    """A request with everything but its last token computed: one row to decode."""
    req = _request(tokens)
    req.num_computed_tokens = req.num_tokens - 1
    return req


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


def test_low_acceptance_backs_off_then_probes(monkeypatch):
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.3))
    req = _request([1, 2, 3, 4, 5, 6, 1, 2])
    for _ in range(3):
        p.record("r", 4, 0)
    searches = []
    monkeypatch.setattr(proposer_module, "propose", lambda *a: searches.append(a) or propose(*a))
    assert p.drafts(req, 100, 1) == []  # backed off
    assert searches == []  # without the n-gram search
    drafted = [bool(p.drafts(req, 100, 1)) for _ in range(8)]
    assert drafted.count(True) == 1 and len(searches) == 1  # probes once in a while
    probe = next(d for d in (p.drafts(req, 100, 1) for _ in range(8)) if d)
    assert probe == [3, 4]  # and briefly
    drafted = [bool(p.drafts(req, 100, 3)) for _ in range(48)]
    assert drafted.count(True) == 2  # more rarely in a bigger batch: every 8 x 3 steps
    assert p.stats.num_drafts == 3 and p.stats.num_accepted_tokens == 0
    p.record("r", 4, 4)
    p.record("r", 4, 4)
    assert p.drafts(req, 100, 1)  # recovered
    assert p.stats.accepted_per_pos == [2, 2, 2, 2]


def _measured(cost_of) -> StepCostModel:
    """A cost model that has seen steps of 1..64 rows cost ``cost_of(n)`` seconds."""
    model = StepCostModel()
    for n in range(1, 65):
        model.observe(n, cost_of(n))
    return model


def _best_by_enumeration(cost_of, rows, tokens, p, max_k):
    """Brute force: expected tokens of k drafts by summing over every accept/reject outcome,
    the rate of each k, the best strictly above k = 0."""
    rates = []
    for k in range(max_k + 1):
        # P(exactly j accepted) = p^j (1 - p) for j < k, p^k for j = k.
        gain = sum(j * p**j * (1 - p) for j in range(k)) + k * p**k
        rates.append((tokens + gain) / cost_of(rows + k))
    best = max(range(max_k + 1), key=lambda k: (rates[k], -k))
    return best if rates[best] > rates[0] else 0


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 0.75, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
def test_the_draft_length_maximises_expected_tokens_per_second(p, rows):
    curves = {
        "weight-bound": lambda n: 10.0 + 0.5 * (n - 1),  # rows nearly free
        "zen1": lambda n: 17.0 + 5.0 * (n - 1),  # ~0.3 of a one-row step per row
        "compute-bound": lambda n: 10.0 * n,  # every row as dear as the first
    }
    for cost_of in curves.values():
        model = _measured(cost_of)
        k, gain = best_draft_length(model, rows, float(rows), p, 8)
        assert k == _best_by_enumeration(cost_of, rows, float(rows), p, 8)
        assert gain == pytest.approx(expected_tokens(p, k))
    assert best_draft_length(_measured(curves["compute-bound"]), rows, rows, p, 8)[0] == 0


def test_drafts_shrink_as_the_batch_grows_and_the_acceptance_falls():
    model = _measured(lambda n: 17.0 + 5.0 * (n - 1))  # 2 Zen 1 cores, served (~2026-12-02)
    assert best_draft_length(model, 1, 1, 0.9, 8)[0] >= 4  # alone: most of the proposal
    assert best_draft_length(model, 1, 1, 0.4, 8)[0] >= 1  # alone, middling acceptance
    assert best_draft_length(model, 8, 8, 0.5, 8)[0] == 0  # 8 running: not at 0.5
    assert (
        1 <= best_draft_length(model, 8, 8, 0.9, 8)[0] < best_draft_length(model, 1, 1, 0.9, 8)[0]
    )
    assert best_draft_length(model, 1, 1, 0.2, 8)[0] == 0


def test_the_proposer_prices_drafts_with_the_measured_steps():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    cheap = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    dear = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    for n in range(1, 64):
        cheap.observe_step(n, 0.010 + 0.0005 * n)
        dear.observe_step(n, 0.010 * n)
    assert cheap.drafts(_request(tokens), 100, 1) == [3, 4, 5, 6]
    assert dear.drafts(_request(tokens), 100, 1) == []  # a row costs a step: never pays
    # The step's earlier drafts make it dearer for the requests after them.
    mid = NgramProposer(SpeculativeConfig(num_speculative_tokens=4))
    for n in range(1, 64):
        mid.observe_step(n, 0.017 + 0.005 * (n - 1))
    running = [_decoding(tokens) for _ in range(4)]
    mid.begin_step(running, budget=100)
    firsts = [len(mid.drafts(req, 100, 4)) for req in running]
    assert firsts[0] >= 1 and firsts == sorted(firsts, reverse=True)
    assert firsts[-1] < 4  # the fourth request's drafts cost more than they would alone
    mid.begin_step(running, budget=100)  # a new step starts afresh
    assert len(mid.drafts(running[0], 100, 4)) == firsts[0]
    # A prompt chunk in the step counts its rows: the step is dear, a decoding request's
    # drafts a small share of it, so at middling acceptance all of them pay, not just one.
    mid.record("r", 4, 0)  # acceptance ~0.49
    mid.begin_step([running[0]], budget=512)
    assert len(mid.drafts(running[0], 512, 1)) == 1
    prefill = _request(list(range(10, 310)))
    mid.begin_step([running[0], prefill], budget=512)
    assert len(mid.drafts(running[0], 512, 2)) == 4


def test_adaptive_off_drafts_every_proposal_in_full():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, adaptive=False))
    for n in range(1, 64):
        p.observe_step(n, 0.010 * n)
    for _ in range(5):
        p.record("r", 4, 0)
    assert p.drafts(_request([1, 2, 3, 4, 5, 6, 1, 2]), 100, 1) == [3, 4, 5, 6]


def test_step_costs_average_interpolate_and_extrapolate():
    m = StepCostModel(prior_row_cost=0.5)
    assert m.estimate(1) == 1.0 and m.estimate(3) == 2.0  # the prior, in one-row steps
    m.observe(1, 0.020)
    assert m.estimate(1) == 0.020
    assert m.estimate(5) == pytest.approx(0.020 + 4 * 0.010)  # above: the prior per row
    m.observe(1, 0.024)
    assert m.estimate(1) == pytest.approx(0.021)  # an exponential average
    m.observe(101, 1.021)
    assert m.estimate(51) == pytest.approx(0.521)  # between: linear
    # above: the prior per row, but never more than two steps of 101 rows
    assert m.estimate(151) == pytest.approx(1.021 + 50 * 0.0105)
    assert m.estimate(201) == pytest.approx(2 * 1.021)
    m = StepCostModel(prior_row_cost=0.5)
    m.observe(4, 0.050)
    assert m.estimate(2) == pytest.approx(0.050 * 1.5 / 2.5)  # below: the prior's shape
    m.observe(0, 1.0)
    m.observe(2, 0.0)
    assert m.estimate(2) == pytest.approx(0.030)  # empty or instant steps are ignored


def test_one_slow_step_does_not_price_a_draft_length_out():
    """A hiccup (a stolen core, a GC pause) during one verification step must not stop
    the policy drafting that length: a length it stops choosing is never measured again."""
    cost_of = lambda n: 0.010 + 0.0005 * (n - 1)  # noqa: E731  (rows nearly free)
    model = _measured(cost_of)
    before = best_draft_length(model, 1, 1.0, 0.8, 4)[0]
    assert before == 4
    n = 1 + before  # the step's rows
    model.observe(n, 10 * cost_of(n))
    assert model.estimate(n) <= 1.07 * cost_of(n)
    assert best_draft_length(model, 1, 1.0, 0.8, 4)[0] == before
    for _ in range(30):  # a lasting change is still followed
        model.observe(n, 1.6 * cost_of(n))
    assert model.estimate(n) == pytest.approx(1.6 * cost_of(n), rel=0.02)
    assert best_draft_length(model, 1, 1.0, 0.8, 4)[0] < before
    # A count's first step: no cheaper than fewer rows, at most two small steps a row more
    # (stored), and its estimate no dearer than splitting it into measured counts.
    cost_of = lambda n: 0.017 + 0.005 * (n - 1)  # noqa: E731
    fresh = StepCostModel()
    for n in (1, 2, 3, 4):
        fresh.observe(n, cost_of(n))
    fresh.observe(5, 100 * cost_of(5))
    assert fresh._seconds[5] == pytest.approx(cost_of(4) + 2 * cost_of(1))
    assert fresh.estimate(5) == pytest.approx(2 * cost_of(3))  # no dearer than 2 steps of 3 rows
    fresh.observe(6, 0.0001)
    assert fresh.estimate(6) == fresh.estimate(5)
    for v in (float("inf"), float("nan")):
        fresh.observe(7, v)
    assert 7 not in fresh.measured_rows
    # The floor holds where the counts above are (noisily) cheaper than the one below.
    bumpy = StepCostModel()
    for n, t in ((1, 0.011), (4, 0.020), (8, 0.030)):
        bumpy.observe(n, t)
    for _ in range(60):
        bumpy.observe(8, 0.010)
    assert bumpy.estimate(8) == pytest.approx(0.010, rel=1e-3)
    bumpy.observe(6, 0.030)
    assert bumpy.estimate(6) == 0.020


def test_a_slow_first_verification_step_costs_at_most_one_draft():
    """Served at one stream the verification counts are first measured by verification
    steps themselves, between the decode row and the prompt's prefill chunk."""
    cost_of = lambda n: 0.011 + 0.003 * (n - 1)  # noqa: E731  (~Zen 3 served)

    def served(outlier: float) -> StepCostModel:
        m = StepCostModel()
        m.observe(300, cost_of(300))  # the prompt
        for n in (1, 2, 3, 4):
            m.observe(n, cost_of(n))
        m.observe(5, outlier * cost_of(5))  # the first 4-draft step, during a hiccup
        return m

    slow = served(10.0)
    assert slow.estimate(5) == pytest.approx(1.25 * cost_of(5))  # the interpolation x 1.25
    for p in (0.7, 0.8, 0.9):
        true = best_draft_length(served(1.0), 1, 1.0, p, 4)[0]
        assert true - 1 <= best_draft_length(slow, 1, 1.0, p, 4)[0] <= true
    assert (
        best_draft_length(slow, 1, 1.0, 0.8, 4)[0]
        == 3
        == best_draft_length(served(1.0), 1, 1.0, 0.8, 4)[0]
    )


def test_a_cold_start_does_not_price_long_drafts_out_for_good():
    """Served, 2026-12-06: a fresh server's first steps (a 355-row prompt, the first 2-,
    9- and 10-row steps) took 2-4 s, 100x; the 1-row steps and 3-row probes the policy kept
    making recovered, the others were never measured again, and no draft length paid at
    acceptance 0.99 for a whole run. Faster steps are believed sooner, and no count costs
    more than splitting it into measured ones would."""
    cost_of = lambda n: 0.015 + 0.002 * (n - 1)  # noqa: E731
    m = StepCostModel()
    for n, seconds in ((355, 4.1), (2, 2.7), (9, 2.7), (10, 2.7), (1, 2.4), (3, 2.7)):
        m.observe(n, seconds)
    for _ in range(12):  # the steps the policy keeps making: decode rows and probes
        m.observe(1, cost_of(1))
        m.observe(3, cost_of(3))
    assert m.estimate(1) < 1.2 * cost_of(1) and m.estimate(3) < 1.2 * cost_of(3)
    assert m.estimate(17) <= 6 * m.estimate(3)  # 6 steps of 3 rows, not the stale 10s
    for _ in range(128):  # later turns: their prompts' prefill, decode rows, short drafts
        for n in (1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 200):
            m.observe(n, cost_of(n))
    assert 9 not in m.measured_rows and 355 not in m.measured_rows  # forgotten
    assert m.estimate(17) < 1.3 * cost_of(17)
    assert best_draft_length(m, 1, 1.0, 0.99, 16)[0] >= 8

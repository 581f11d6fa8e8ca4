"""Predicted Outputs (issue 40 deliver 3): a request's prediction is its draft source,
aligned as the output drifts from it; the output is token-identical to decoding without it
(exact, edited and unrelated predictions, alone and batched, no --speculative-config), usage
counts the prediction tokens kept (the HTTP API: tests/entrypoints/test_prediction_api.py)."""

from __future__ import annotations

import pytest

from tests.support.engine import assert_no_leaks, build_engine, run_alone, run_batch
from tinyserve.outputs import kept_in_order
from tinyserve.sampling_params import SamplingParams
from tinyserve.spec_decode.prediction import PredictionDrafter


def test_the_drafter_follows_the_output_through_an_edit():
    pred = list(range(100, 130))
    d = PredictionDrafter(pred, max_match=4)
    assert d.propose([], 3) == [100, 101, 102]  # nothing out yet: the prediction's start
    assert d.propose([100, 101], 3) == [102, 103, 104]
    out = [100, 101, 102, 7, 8, 105, 106]  # 103-104 replaced by an edit, then back on track
    assert d.propose(out, 2) == [107, 108]
    assert d.propose(out + [107, 108, 9], 4) == []  # an unknown token: no draft
    assert d.propose([5, 129], 4) == []  # the prediction's end: nothing follows


def test_a_short_match_far_from_the_alignment_is_no_draft():
    """After the answer has left the prediction, one or two tokens that also occur in it (a
    bracket, a newline) are no evidence of where it stands: their drafts were all rejected
    and kept suffix decoding from drafting (served: a copied file followed by a loop of
    prints, 0.85x of the same request without the prediction). Three tokens are."""
    pred = list(range(100, 200))
    d = PredictionDrafter(pred)  # near: 16 tokens
    assert d.propose(pred[:40], 3) == pred[40:43]
    left = pred[:40] + [1, 2, 3]
    assert d.propose(left + [105], 4) == []  # one token 35 back
    assert d.propose(left + [165], 4) == []  # one token 25 past the alignment
    assert d.propose(left + [150], 4) == pred[51:55]  # 10 past: an edit's deletion
    assert d.propose(left + [104, 105, 106], 4) == pred[7:11]  # three: anywhere
    d = PredictionDrafter(pred)
    d.propose(pred[:20], 2)
    assert d.propose(pred[:20] + [9, pred[22]], 2) == pred[23:25]  # an edit: one token, near


def test_kept_in_order_counts_an_edited_copy():
    pred = list(range(50))
    assert kept_in_order(pred, pred) == 50
    assert kept_in_order(pred, pred[:20] + [999] * 5 + pred[25:]) == 45
    assert kept_in_order(pred, [999] * 10) == 0
    assert kept_in_order(pred, pred[::-1]) == 1  # order matters
    assert kept_in_order(pred, pred[:10] + pred[30:]) == 30  # a deletion
    assert kept_in_order(pred, pred[:-3] + [999] + pred[-2:]) == 49  # an edit in the last 4


def test_kept_in_order_is_not_thrown_by_a_preamble():
    """An answer that opens with text before the file ("```python" and a newline): a token of
    the preamble that also occurs in the file (its last newline) must not move the
    alignment past the file's start (it did: 1 of 94 kept for a copied file, measured on the
    code-editing benchmark)."""
    newline = 7
    pred = [1, 2, 3, newline, 4, 5, 6, newline, 8, 9, newline]
    out = [90, 91, newline] + pred + [90, 92]
    assert kept_in_order(pred, out) == len(pred)
    edited = [90, newline] + pred[:4] + [93] + pred[5:]  # and an edit inside
    assert kept_in_order(pred, edited) == len(pred) - 1


def _requests(tokenizer):
    texts = ["The history of the Roman Empire", "def fibonacci(n):", "Dear Sir, I write to"]
    return [(f"r{i}", tokenizer.encode(t), SamplingParams(temperature=0.0, max_tokens=40,
             ignore_eos=True)) for i, t in enumerate(texts)]  # fmt: skip


@pytest.mark.slow
def test_outputs_are_identical_with_any_prediction(smollm2_gguf_path):
    engine = build_engine(model=str(smollm2_gguf_path), num_blocks=256, block_size=16)
    reqs = _requests(engine.tokenizer)
    plain = run_batch(engine, reqs)
    reference = {rid: plain[rid].token_ids for rid, _, _ in reqs}
    steps_plain = engine.core.num_steps
    edited = {}
    for rid, _, _ in reqs:
        out = reference[rid]
        edited[rid] = tuple(out[:15] + [42, 43] + out[20:])  # an edit in the middle

    for kind in ("exact", "edited", "unrelated"):
        with_pred = []
        for rid, prompt, _ in reqs:
            pred = {"exact": tuple(reference[rid]), "edited": edited[rid],
                    "unrelated": tuple(range(1000, 1040))}[kind]  # fmt: skip
            p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prediction=pred)
            with_pred.append((rid, prompt, p))
        before = (engine.core.num_steps, engine.core.proposer.stats.num_accepted_tokens)
        got = run_batch(engine, with_pred) if kind != "edited" else run_alone(engine, with_pred)
        assert {rid: got[rid].token_ids for rid, _, _ in reqs} == reference, kind
        accepted = engine.core.proposer.stats.num_accepted_tokens - before[1]
        if kind == "exact":  # how many: the adaptive policy's call (benchmarks/ measure it)
            assert accepted > 0 and engine.core.num_steps - before[0] < steps_plain
        if kind == "unrelated":
            assert accepted == 0
    assert_no_leaks(engine)


@pytest.mark.slow
def test_a_prediction_drafts_past_num_speculative_tokens(smollm2_gguf_path):
    """A prediction is the client's draft of the whole answer: drafted in runs longer than
    the n-gram source's ``num_speculative_tokens`` (4 here), so an exact one of 40 tokens is
    verified in a few steps, not ten; the output stays the plain one."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'
    engine = build_engine(model=str(smollm2_gguf_path), num_blocks=256, block_size=16,
                          speculative_config=spec)  # fmt: skip
    (rid, prompt, params), *_ = _requests(engine.tokenizer)
    reference = run_alone(engine, [(rid, prompt, params)])[rid].token_ids
    stats = engine.core.proposer.stats
    before = (engine.core.num_steps, stats.num_drafts, stats.num_accepted_tokens)
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prediction=tuple(reference))
    assert run_alone(engine, [(rid, prompt, p)])[rid].token_ids == reference
    drafts, accepted = stats.num_drafts - before[1], stats.num_accepted_tokens - before[2]
    assert accepted / drafts > 4, (accepted, drafts)  # runs longer than the n-gram cap
    assert engine.core.num_steps - before[0] <= 4  # prefill + 32 + the rest (+ its bonus)
    assert_no_leaks(engine)


def test_where_the_prediction_says_nothing_speculation_drafts_as_without_one():
    """Past a prediction's end (or after a token it does not hold) a request drafts from the
    configured source, as it would without a prediction; with speculation off, nothing."""
    from types import SimpleNamespace

    from tinyserve.spec_decode.config import SpeculativeConfig
    from tinyserve.spec_decode.proposer import NgramProposer

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                             prompt_lookup_max=2)  # fmt: skip
    prompt, output = [5, 6, 7, 8, 9, 10], [11, 5, 6]  # "5 6" occurred: 7 8 9 10 follow
    request = SimpleNamespace(
        request_id="r", output_token_ids=output, all_token_ids=prompt + output,
        sampling_params=SamplingParams(prediction=(11, 12, 13)),  # nothing follows "11 5 6"
    )  # fmt: skip
    assert NgramProposer(spec)._propose(request, 32) == [7, 8, 9, 10]  # capped at 4, not 32
    assert NgramProposer(spec, ngram=False)._propose(request, 32) == []
    request.sampling_params = SamplingParams(prediction=(11, 5, 6, 20, 21))
    assert NgramProposer(spec)._propose(request, 32) == [20, 21]  # the prediction first

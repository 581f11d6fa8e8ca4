"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and scoring without generating
(``max_tokens=0``), end to end through the engine:

- equal to a dense transformers reference (float32) within 1e-4, ranks and top-k included;
- the same bits alone, batched with other requests, chunked into small prefill pieces,
  preempted and recomputed, and after the prompt's blocks were cached by another request
  (a scoring request takes no prefix hit: cached positions have no logits);
- ``max_tokens=0`` ends the request after its prefill with no token and nothing leaked.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import assert_no_leaks, greedy, random_prompt, run_alone, run_batch
from tests.support.engine import tiny_engine as _tiny
from tinyserve.kernels import gemm
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import model_runner

K = 3


def tiny_engine(path, **kw):
    return _tiny(path, kernel_activations="float32", **kw)


def scoring(max_tokens: int = 0, k: int = K) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=k,
                          ignore_eos=True)  # fmt: skip


def _values(choice) -> list:
    return [None if e is None else (e.token_id, e.logprob, e.rank, e.top)
            for e in choice.prompt_logprobs]  # fmt: skip


def test_prompt_logprobs_equal_transformers(tiny_qwen2_path, tiny_qwen2_hf):
    prompt = random_prompt(37, seed=5)
    got = run_batch(tiny_engine(tiny_qwen2_path), [("a", prompt, scoring())])["a"]
    assert got.token_ids == [] and got.finish_reason == "length"
    with torch.no_grad():
        logits = tiny_qwen2_hf(torch.tensor([prompt])).logits[0].double()
    ref = torch.log_softmax(logits, -1)
    lps = got.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for p, entry in enumerate(lps[1:]):
        row = ref[p]
        assert entry.token_id == prompt[p + 1]
        assert abs(entry.logprob - row[prompt[p + 1]].item()) <= 1e-4
        assert (
            entry.rank == int((row > row[prompt[p + 1]] + 1e-4).sum()) + 1
            or abs(row.sort(descending=True).values[entry.rank - 1] - entry.logprob) <= 1e-4
        )  # a near tie may rank either way
        top = row.topk(K)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        for (_, v), w in zip(entry.top, top.values.tolist(), strict=True):
            assert abs(v - w) <= 1e-4


def test_the_same_bits_batched_chunked_preempted_and_after_a_cache_fill(tiny_qwen2_path):
    prompts = [random_prompt(9 + (7 * i) % 23, seed=40 + i) for i in range(10)]
    scored = [(f"s{i}", p, scoring(max_tokens=4 + i % 3)) for i, p in enumerate(prompts)]
    ref = run_alone(tiny_engine(tiny_qwen2_path, num_blocks=512), scored)
    for rid, prompt, _ in scored:
        assert len(ref[rid].prompt_logprobs) == len(prompt)

    # Batched with plain requests, prompts chunked 8 tokens a step, a pool that preempts.
    plain = [(f"g{i}", random_prompt(12, seed=90 + i), greedy(12)) for i in range(4)]
    engine = tiny_engine(tiny_qwen2_path, num_blocks=12, max_num_batched_tokens=8)
    got = run_batch(engine, plain + scored)
    assert engine.core.scheduler.num_preemptions > 0
    for rid, _, _ in scored:
        assert _values(got[rid]) == _values(ref[rid]), rid
        assert got[rid].token_ids == ref[rid].token_ids
    assert all(got[rid].prompt_logprobs is None for rid, _, _ in plain)
    assert_no_leaks(engine)

    # The prompts' blocks cached first by plain requests: the scoring ones take no hit.
    engine = tiny_engine(tiny_qwen2_path, num_blocks=512, enable_prefix_caching=True)
    run_batch(engine, [(f"w{rid}", p, greedy(2)) for rid, p, _ in scored])
    again = run_batch(engine, scored)
    for rid, _, _ in scored:
        assert again[rid].num_cached_tokens == 0
        assert _values(again[rid]) == _values(ref[rid]), rid
    assert_no_leaks(engine)


def test_the_fused_head_gives_the_logits_paths_values(tiny_qwen2_path, monkeypatch):
    """Scoring takes the logprobs straight from the LM head's tiles (kernels/gemm_score.h:
    the tiny model's float32 head runs on gemm.c) and gives what the head's logits and then
    ops.c's row kernel give: the same ranks and top-k ids, logprobs two float32 roundings
    of the log-sum-exp apart at most."""
    calls, fused = [], gemm.score_rows

    def counted(x, *args, **kw):
        calls.append(len(x))
        return fused(x, *args, **kw)

    monkeypatch.setattr(gemm, "score_rows", counted)
    scored = [
        (f"s{i}", random_prompt(n, seed=60 + i), scoring(k=5)) for i, n in enumerate((50, 37))
    ]
    got = run_batch(tiny_engine(tiny_qwen2_path, num_blocks=64), scored)
    assert sorted(calls) == [36, 49]  # one call a request: its prompt rows but the last
    monkeypatch.setattr(LlamaForCausalLM, "score_head", lambda self: None)
    ref = run_batch(tiny_engine(tiny_qwen2_path, num_blocks=64), scored)
    assert sorted(calls) == [36, 49]
    for rid, _, _ in scored:
        for a, b in zip(got[rid].prompt_logprobs[1:], ref[rid].prompt_logprobs[1:], strict=True):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            # two float32 roundings of the log-sum-exp apart at most (relative below -8)
            assert abs(a.logprob - b.logprob) <= 1e-6 + 2.4e-7 * abs(b.logprob)
            assert all(abs(u - v) <= 1e-6 + 2.4e-7 * abs(v)
                       for (_, u), (_, v) in zip(a.top, b.top, strict=True))  # fmt: skip


def test_the_same_bits_when_the_head_runs_in_chunks_of_rows(tiny_qwen2_path, monkeypatch):
    """Where scoring computes the logits (a head that is not gemm.c's, as Granite's scaled
    one), the LM head over the prompt rows in chunks of 16 (the floor of
    ``prompt_logprob_rows``; the tiny vocabulary otherwise fits one chunk): two prompts in one
    step, split at rows that are not the requests' own boundaries, give the one-chunk bits."""
    monkeypatch.setattr(LlamaForCausalLM, "score_head", lambda self: None)
    scored = [(f"s{i}", random_prompt(n, seed=70 + i), scoring()) for i, n in enumerate((50, 37))]
    ref = run_batch(tiny_engine(tiny_qwen2_path, num_blocks=64), scored)
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_BYTES", 1)
    assert model_runner.prompt_logprob_rows(151_936) == 16
    got = run_batch(tiny_engine(tiny_qwen2_path, num_blocks=64), scored)
    for rid, prompt, _ in scored:
        assert len(got[rid].prompt_logprobs) == len(prompt)
        assert _values(got[rid]) == _values(ref[rid]), rid


def test_generated_tokens_logprob_equals_the_prompt_logprob_of_it(tiny_qwen2_path):
    """A prompt row's logprob and the sampler's raw logprob of the token sampled there are
    the same number from the same logits: generate, then score the prompt with that token
    appended (the prompt path's fused row kernel and the sampler's torch log_softmax agree
    to float32 rounding)."""
    engine = tiny_engine(tiny_qwen2_path, num_blocks=256)
    prompt = random_prompt(21, seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, ignore_eos=True)
    gen = run_batch(engine, [("g", prompt, sp)])["g"]
    (token,), (lp,) = gen.token_ids, gen.logprobs
    scored = run_batch(engine, [("s", prompt + [token], scoring(k=2))])["s"]
    last = scored.prompt_logprobs[-1]
    assert last.token_id == token and abs(last.logprob - lp.logprob) <= 1e-5
    assert [t for t, _ in last.top] == [t for t, _ in lp.top]
    assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(last.top, lp.top, strict=True))
    assert last.rank == 1  # greedy


def test_bounds_and_no_prompt_logprobs_unless_asked(tiny_qwen2_path):
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"max_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64)
    out = run_batch(engine, [("a", [5], scoring()), ("b", [5, 6], greedy(2))])
    assert out["a"].prompt_logprobs == [None] and out["a"].token_ids == []
    assert out["b"].prompt_logprobs is None
    assert_no_leaks(engine)


def test_a_prompt_filling_the_context_window_can_be_scored(tiny_qwen2_path):
    """``max_tokens=0`` needs no room for output: a prompt of exactly max_model_len tokens
    (lm-eval's rolling loglikelihood windows are the full context) was refused as "no room
    for output"; generating from it still is."""
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64, max_model_len=32)
    prompt = random_prompt(32, seed=9)
    out = run_batch(engine, [("a", prompt, scoring())])["a"]
    assert len(out.prompt_logprobs) == 32 and out.token_ids == []
    with pytest.raises(ValueError, match="no room for output"):
        engine.validate_request(prompt, greedy(1))
    with pytest.raises(ValueError, match="no room for output"):
        engine.validate_request(prompt + [5], scoring())
    assert_no_leaks(engine)

"""Preemption by recompute and chunked prefill, end to end through the model.

- A KV pool too small for all requests at once: every request still finishes with the
  output of an unconstrained run, and the scheduler did preempt.
- A prompt 4x longer than ``max_num_batched_tokens`` is prefilled in chunks, matches the
  unchunked output, and other requests keep decoding in the same steps (step trace).
"""

from __future__ import annotations

import pytest

from tests.support.engine import (
    assert_no_leaks,
    build_engine,
    greedy,
    random_prompt,
    record_schedules,
    run_alone,
    run_batch,
    text_prompts,
    tiny_engine,
)


def _tokens(collector) -> dict[str, list[int]]:
    return {rid: c[0].token_ids for rid, c in collector.choices.items()}


# ---------------------------------------------------------------- preemption


@pytest.mark.device
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tiny_qwen2_preemption_keeps_outputs(tiny_qwen2_path, prefix_caching, test_device):
    # 12 requests of up to 9 blocks each (block_size 4) against a pool of 24 blocks.
    requests = [
        (f"p{i}", random_prompt(6 + (5 * i) % 17, seed=300 + i), greedy(10 + (3 * i) % 11))
        for i in range(12)
    ]
    need = [-(-(len(p) + sp.max_tokens) // 4) for _, p, sp in requests]
    assert max(need) <= 24 < sum(need)
    kw = dict(block_size=4, enable_prefix_caching=prefix_caching, max_num_batched_tokens=64,
              device=test_device)  # fmt: skip
    ref = run_batch(tiny_engine(tiny_qwen2_path, num_blocks=512, **kw), requests)
    assert all(c[0].finish_reason == "length" for c in ref.choices.values())

    engine = tiny_engine(tiny_qwen2_path, num_blocks=24, **kw)
    got = run_batch(engine, requests)
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.stats().num_preemptions == engine.core.scheduler.num_preemptions
    for rid, _, params in requests:
        assert got[rid].finish_reason == "length"
        assert len(got[rid].token_ids) == params.max_tokens
    assert _tokens(got) == _tokens(ref)
    assert_no_leaks(engine)


@pytest.mark.slow
def test_smollm2_preemption_keeps_outputs(smol_path, smollm2_tokenizer):
    prompts = text_prompts(smollm2_tokenizer, [20, 33, 27, 40, 24, 31], seed=7)
    requests = [(f"s{i}", p, greedy(12 + 2 * (i % 3))) for i, p in enumerate(prompts)]
    need = [-(-(len(p) + sp.max_tokens) // 8) for _, p, sp in requests]
    num_blocks = 12
    assert max(need) <= num_blocks < sum(need)

    kw = dict(model=smol_path, block_size=8, max_num_batched_tokens=256)
    ref = run_batch(build_engine(num_blocks=256, **kw), requests)
    engine = build_engine(num_blocks=num_blocks, **kw)
    got = run_batch(engine, requests)
    assert engine.core.scheduler.num_preemptions > 0
    for rid, _, params in requests:
        assert got[rid].finish_reason == "length"
        assert len(got[rid].token_ids) == params.max_tokens
        assert got[rid].text == ref[rid].text
    assert _tokens(got) == _tokens(ref)
    assert_no_leaks(engine)


# ---------------------------------------------------------------- chunked prefill

BUDGET = 32


@pytest.mark.slow
def test_chunked_prefill_matches_and_decodes_keep_advancing(smol_path):
    engine = build_engine(
        model=smol_path,
        num_blocks=64,
        block_size=16,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
    )
    short = text_prompts(engine.tokenizer, [7, 9, 11], seed=11)
    [long_prompt] = text_prompts(engine.tokenizer, [4 * BUDGET + 13], seed=12)
    others = [(f"d{i}", p, greedy(20)) for i, p in enumerate(short)]
    long_req = ("long", long_prompt, greedy(8))

    # The unchunked reference: a budget bigger than the whole prompt, each request alone.
    ref_engine = build_engine(
        model=smol_path,
        num_blocks=64,
        block_size=16,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    ref = _tokens(run_alone(ref_engine, [*others, long_req]))

    tokens: dict[str, list[int]] = {}
    schedules = record_schedules(engine)

    def step():
        outs = engine.step()
        sched = schedules[-1]
        assert sched.num_batched_tokens <= BUDGET
        new = {o.request_id: o.new_token_ids for o in outs}
        for rid, ids in new.items():
            tokens.setdefault(rid, []).extend(ids)
        return {it.request.request_id: it.num_new_tokens for it in sched.scheduled}, new

    for rid, prompt, params in others:
        engine.add_request(rid, prompt, params)
    while not all(tokens.get(rid) for rid, _, _ in others):  # all three are decoding
        step()
    engine.add_request(*long_req)

    chunks = []
    while not tokens.get("long"):
        scheduled, new = step()
        assert "long" in scheduled  # the long prompt is never starved
        chunks.append(scheduled["long"])
        for rid, _, _ in others:  # ... and never stalls the decodes
            assert scheduled.get(rid) == 1, (rid, scheduled)
            assert len(new.get(rid, [])) == 1, (rid, new)
    assert len(chunks) >= 4
    assert sum(chunks) == len(long_prompt)
    assert all(c <= BUDGET - len(others) for c in chunks)

    while engine.has_unfinished():
        step()
    assert tokens == ref
    assert_no_leaks(engine)

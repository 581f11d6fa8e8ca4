"""Continuous batching changes nothing but speed: greedy outputs of many prompts of varied
lengths and max_tokens, run together, equal each prompt run alone, token for token (SmolLM2
through the offline ``LLM`` API, and a tiny Qwen2); the static (gang) policy gives the same
outputs as the continuous one, and the two really schedule differently."""

from __future__ import annotations

import pytest

from tests.support.engine import (
    assert_no_leaks,
    build_llm,
    drain,
    greedy,
    random_prompt,
    record_schedules,
    run_alone,
    run_batch,
    text_prompts,
    tiny_engine,
)
from tinyserve.kernels import gemm

NUM_PROMPTS = 16
# Varied prompt lengths (tokens) and max_tokens (ignore_eos: lengths are exact).
SMOL_LENGTHS = [3 + (37 * i) % 150 for i in range(NUM_PROMPTS)]
SMOL_MAX_TOKENS = [8 + (5 * i) % 13 for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def nocache_llm(smol_path):
    # Prefix caching off: these tests are about batching alone.
    return build_llm(
        model=smol_path,
        num_blocks=160,
        block_size=16,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def smol_prompts(nocache_llm):
    return text_prompts(nocache_llm.tokenizer, SMOL_LENGTHS, seed=1)


@pytest.fixture(scope="module")
def smol_batched(nocache_llm, smol_prompts):
    params = [greedy(m) for m in SMOL_MAX_TOKENS]
    return nocache_llm.generate(smol_prompts, params, use_tqdm=False)


def _assert_same(got: dict[str, list[int]], want: dict[str, list[int]]) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid] == want[rid], f"{rid}: {got[rid]} != {want[rid]}"


@pytest.mark.slow
def test_smollm2_batched_equals_sequential(nocache_llm, smol_prompts, smol_batched):
    assert len(set(map(len, smol_prompts))) >= 12  # really varied lengths
    tok = nocache_llm.tokenizer
    for prompt, mt, out in zip(smol_prompts, SMOL_MAX_TOKENS, smol_batched, strict=True):
        assert out.finished and out.prompt_token_ids == prompt
        [choice] = out.outputs
        assert len(choice.token_ids) == mt and choice.finish_reason == "length"
        assert choice.text == tok.decode(choice.token_ids, skip_special_tokens=True)
    # Each prompt alone, one after the other, on the same (now idle) engine.
    alone = [
        nocache_llm.generate(prompt, greedy(mt), use_tqdm=False)[0]
        for prompt, mt in zip(smol_prompts, SMOL_MAX_TOKENS, strict=True)
    ]
    _assert_same(
        {str(i): o.outputs[0].token_ids for i, o in enumerate(smol_batched)},
        {str(i): o.outputs[0].token_ids for i, o in enumerate(alone)},
    )
    # Not a degenerate model output: the prompts do lead to different continuations.
    assert len({tuple(o.outputs[0].token_ids[:8]) for o in alone}) >= NUM_PROMPTS // 2


@pytest.mark.slow
def test_smollm2_int8_decode_batched_equals_sequential(smol_path, smol_prompts):
    """``--decode-activations int8``: decode rows take the integer kernel, prompt rows the
    float one, chosen per token by the model runner (decode rows first in the flat batch),
    so batching still changes nothing; and the engine really runs that path."""
    llm = build_llm(model=smol_path, num_blocks=160, block_size=16, max_num_batched_tokens=512,
                    enable_prefix_caching=False, decode_activations="int8")  # fmt: skip
    layers = llm.engine.executor.model.linear_layers().values()
    bf16 = "+bf16" if gemm.bf16_available() else ""  # prompt rows: the default activations
    assert {m.method.name for m in layers} == {f"kernel-q4_1{bf16}+int8-decode",
                                               f"kernel-q8_0{bf16}+int8-decode"}  # fmt: skip
    prompts, max_tokens = smol_prompts[:8], SMOL_MAX_TOKENS[:8]
    batched = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    alone = [llm.generate(p, greedy(m), use_tqdm=False)[0] for p, m in zip(prompts, max_tokens, strict=True)]  # fmt: skip
    _assert_same(
        {str(i): o.outputs[0].token_ids for i, o in enumerate(batched)},
        {str(i): o.outputs[0].token_ids for i, o in enumerate(alone)},
    )


@pytest.mark.slow
def test_smollm2_static_policy_matches_continuous(smol_path, smol_prompts, smol_batched):
    llm = build_llm(
        model=smol_path,
        num_blocks=160,
        block_size=16,
        max_num_batched_tokens=512,
        max_num_seqs=6,
        enable_prefix_caching=False,
        scheduling_policy="static",
    )
    params = [greedy(m) for m in SMOL_MAX_TOKENS]
    static = llm.generate(smol_prompts, params, use_tqdm=False)
    _assert_same(
        {str(i): o.outputs[0].token_ids for i, o in enumerate(static)},
        {str(i): o.outputs[0].token_ids for i, o in enumerate(smol_batched)},
    )


# ---------------------------------------------------------------- tiny Qwen2


TINY_REQUESTS = [
    (f"q{i}", random_prompt(1 + (23 * i) % 120, seed=100 + i), greedy(8 + (7 * i) % 17))
    for i in range(20)
]


def _tokens(collector) -> dict[str, list[int]]:
    return {rid: c[0].token_ids for rid, c in collector.choices.items()}


@pytest.fixture(scope="module")
def tiny_alone(tiny_qwen2_path):
    engine = tiny_engine(tiny_qwen2_path, enable_prefix_caching=False)
    return _tokens(run_alone(engine, TINY_REQUESTS))


@pytest.mark.device
def test_tiny_qwen2_batched_equals_sequential(tiny_qwen2_path, tiny_alone, test_device):
    """Batched on the test device = alone on the CPU (greedy, token for token)."""
    # A small token budget: long prompts are chunked and share steps with decodes.
    engine = tiny_engine(
        tiny_qwen2_path, enable_prefix_caching=False, max_num_batched_tokens=64, device=test_device
    )
    batched = run_batch(engine, TINY_REQUESTS)
    for rid, _, params in TINY_REQUESTS:
        c = batched[rid]
        assert c.finish_reason == "length" and len(c.token_ids) == params.max_tokens
    _assert_same(_tokens(batched), tiny_alone)
    assert len({tuple(t[:8]) for t in tiny_alone.values()}) >= 15
    stats = engine.stats()  # no prefix cache, no preemption: every token counted once
    assert stats.prompt_tokens_total == sum(len(p) for _, p, _ in TINY_REQUESTS)
    assert stats.generation_tokens_total == sum(sp.max_tokens for _, _, sp in TINY_REQUESTS)
    assert stats.num_preemptions == 0


def _trace_admissions(engine, requests):
    """Add all requests and step to the end. Returns the per-request tokens and, per step,
    (ids scheduled for the first time, ids admitted earlier and still unfinished)."""
    schedules = record_schedules(engine)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    seen: set[str] = set()
    trace = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        live_old = {rid for rid in engine.core.scheduler.requests if rid in seen}
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        ids = {item.request.request_id for item in schedules[-1].scheduled}
        trace.append((ids - seen, live_old))
        seen |= ids
    return trace, tokens


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_tiny_qwen2_policies_match_alone(tiny_qwen2_path, tiny_alone, policy):
    engine = tiny_engine(
        tiny_qwen2_path,
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        scheduling_policy=policy,
    )
    trace, tokens = _trace_admissions(engine, TINY_REQUESTS)
    _assert_same(tokens, tiny_alone)
    # Steps in which a request was admitted while earlier admitted ones were still running.
    joins = sum(1 for new, old in trace if new and old)
    if policy == "static":
        assert joins == 0  # a gang runs until all its members finish
    else:
        assert joins > 0  # iteration-level: a finished slot is refilled at once
    assert max(len(new | old) for new, old in trace) <= 4  # max_num_seqs


def test_several_prompts_in_one_request_sample_as_separate_requests(tiny_qwen2_path):
    """One engine request holding two prompts x n=2 (a completions call with a prompt list)
    gives each choice the tokens the same prompt gets as its own request; choices are
    numbered prompt_index * n + sample and the request finishes once, with its usage."""
    from tinyserve.engine.client import SyncEngine
    from tinyserve.sampling_params import SamplingParams

    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    prompts = [random_prompt(7, seed=1), random_prompt(11, seed=2)]
    together = tiny_engine(tiny_qwen2_path)
    assert isinstance(together, SyncEngine)
    together.add_request("both", prompts, params)
    outs = []
    while together.has_unfinished():
        outs += together.step()
    got = {}
    for o in outs:
        got.setdefault(o.index, []).extend(o.new_token_ids)
        assert o.prompt_index == o.index // 2
    assert [o.request_finished for o in outs].count(True) == 1 and outs[-1].request_finished
    assert outs[-1].usage.prompt_tokens == 18 and outs[-1].usage.completion_tokens == 24
    assert_no_leaks(together)

    alone = tiny_engine(tiny_qwen2_path)
    for i, p in enumerate(prompts):
        alone.add_request(f"p{i}", p, params)
    ref = drain(alone).choices
    expected = {2 * i + j: ref[f"p{i}"][j].token_ids for i in range(2) for j in range(2)}
    assert got == expected

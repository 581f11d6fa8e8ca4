"""Suffix decoding through the whole engine (SmolLM2, CPU kernels, fp32): greedy requests are
token-identical to plain decoding alone, batched, on prefix-cache hits, under preemption and
with structured outputs, while drafts come from the request's own tokens and from earlier
requests' outputs; requests with different ``cache_salt`` values share neither those
outputs nor prefix-cache blocks."""

from __future__ import annotations

import pytest

from tests.support.engine import assert_no_leaks, run_alone, run_batch
from tests.support.spec_decode import greedy_requests, outputs_of, run_checking_hashes, spec_engine
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

# Every proposal drafted in full at any batch size: as many verification runs as possible.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "max_batch_size": 64,
          "adaptive": False}  # fmt: skip


def test_greedy_identical_batched_alone_on_prefix_hits_and_from_earlier_outputs(smol_path):
    plain = spec_engine(smol_path, None)
    reqs = greedy_requests(plain.tokenizer)
    reference = outputs_of(run_batch(plain, reqs), reqs)

    spec = spec_engine(smol_path, SUFFIX)
    assert outputs_of(run_batch(spec, reqs), reqs) == reference  # batched, own tokens only
    proposer = spec.core.proposer
    assert len(proposer.suffix_cache) == len(reqs)  # every finished output was kept
    first = proposer.stats.num_accepted_tokens
    assert first > 100, proposer.stats
    # The same requests again: prefix-cache hits, and the earlier outputs are drafts.
    hits = spec.core.kv_cache_manager.prefix_cache_hits
    again = [(f"{r}b", p, s) for r, p, s in reqs[::5]]
    got = outputs_of(run_alone(spec, again), again)
    assert got == {f"{r}b": reference[r] for r, _, _ in reqs[::5]}
    assert spec.core.kv_cache_manager.prefix_cache_hits > hits
    # Drafts grow with the match (max_spec_factor 1): most of each output, not all of it.
    accepted = proposer.stats.num_accepted_tokens - first
    assert accepted > 0.6 * sum(len(reference[r][0]) - 1 for r, _, _ in reqs[::5]), accepted
    assert_no_leaks(spec)


def test_the_default_is_suffix_decoding_and_changes_no_token(smol_path):
    """What EngineArgs gives without a speculative_config ("auto"): suffix decoding under the
    measured pricing, with plain decoding's greedy outputs."""
    from tinyserve.engine.arg_utils import EngineArgs
    from tinyserve.spec_decode.config import SpeculativeConfig

    assert EngineArgs().speculative_config == "auto"
    plain = spec_engine(smol_path, None)
    assert not plain.core.speculative
    reqs = greedy_requests(plain.tokenizer)
    reference = outputs_of(run_batch(plain, reqs), reqs)
    default = spec_engine(smol_path, "auto")
    assert default.core.speculative
    assert default.core.proposer.config == SpeculativeConfig(method="suffix")
    assert outputs_of(run_batch(default, reqs), reqs) == reference
    assert_no_leaks(default)


def test_greedy_identical_under_preemption(smol_path):
    plain = spec_engine(smol_path, None)
    reqs = [(r, p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for r, p, _ in greedy_requests(plain.tokenizer)[:8]]  # fmt: skip
    reference = outputs_of(run_batch(plain, reqs), reqs)
    spec = spec_engine(smol_path, SUFFIX, num_blocks=28)  # 448 slots for 8 requests: preemption
    for _ in range(2):  # the second round drafts from the first's outputs as well
        assert run_checking_hashes(spec, reqs) == reference
    assert spec.core.scheduler.num_preemptions > 0
    assert spec.core.proposer.stats.num_accepted_tokens > 0
    assert_no_leaks(spec)


def test_structured_outputs_draft_forced_tokens_and_earlier_outputs(smol_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "city": {"type": "string"}}, "required": ["name", "city"],
              "additionalProperties": False}  # fmt: skip
    plain = spec_engine(smol_path, None)
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    texts = ["Name a person and a city as JSON: ", "A scientist and where she lived, as JSON: "]
    reqs = [(f"j{i}", plain.tokenizer.encode(t, add_special_tokens=False), params)
            for i, t in enumerate(texts * 2)]  # fmt: skip
    reference = outputs_of(run_alone(plain, reqs), reqs)
    spec = spec_engine(smol_path, SUFFIX)
    assert outputs_of(run_alone(spec, reqs), reqs) == reference
    assert spec.core.proposer.stats.num_accepted_tokens > 10
    assert_no_leaks(spec)


def test_cache_salt_separates_earlier_outputs_and_prefix_blocks(smol_path):
    """A salted request drafts only from outputs of its own salt and hits only blocks of its
    own salt; the outputs are the same whatever the salt."""
    spec = spec_engine(smol_path, SUFFIX)
    prompt = greedy_requests(spec.tokenizer)[45][1]  # 53 tokens cut from a text: few own drafts
    kv, proposer = spec.core.kv_cache_manager, spec.core.proposer
    outputs, accepted = {}, {}
    for name, salt in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("n1", None)]:
        req = [(name, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                             cache_salt=salt))]  # fmt: skip
        hits, drafted = kv.prefix_cache_hits, proposer.stats.num_accepted_tokens
        outputs[name] = outputs_of(run_alone(spec, req), req)[name][0]
        accepted[name] = proposer.stats.num_accepted_tokens - drafted
        assert (kv.prefix_cache_hits > hits) == (name == "a2"), name  # its own salt's blocks
    assert len({tuple(o) for o in outputs.values()}) == 1
    assert accepted["a2"] >= 15 and accepted["b1"] <= accepted["a2"] - 10, accepted
    assert accepted["n1"] == accepted["b1"], accepted  # unsalted: nothing of a's or b's
    cache = proposer.suffix_cache
    assert len(cache.corpus("a")[0]) == 2 * 25 and len(cache.corpus("b")[0]) == 25
    assert_no_leaks(spec)

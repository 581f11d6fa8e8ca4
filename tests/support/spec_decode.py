"""Helpers of the speculative-decoding engine tests (tests/engine/test_spec_*.py): greedy
requests whose outputs repeat their prompts, their outputs in comparable form, and the
check that no hashed block holds an unverified token."""

from __future__ import annotations

import random

from tests.support.engine import CORPUS, Collector, build_engine, text_prompts
from tinyserve.sampling_params import SamplingParams

# Drafts at every batch size and acceptance (no back-off): as many verification runs as
# possible, batched and alone, for the identity checks.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2, "max_batch_size": 64, "adaptive": False}  # fmt: skip


def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    """Prompts that carry a passage and ask for it back: the output repeats the input."""
    words = CORPUS.split()
    prompts = []
    for i in range(n):
        start = (i * 37) % (len(words) - 60)
        passage = " ".join(words[start : start + 40 + i % 20])
        text = f"Copy this text exactly:\n{passage}\nCopy:\n{passage[: 20 + i]}"
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def greedy_requests(tokenizer) -> list[tuple[str, list[int], SamplingParams]]:
    """50 greedy requests: 30 grounded, 20 cut from the corpus; varied max_tokens (so some
    end inside an accepted run), some with stop strings, some with EOS allowed."""
    prompts = grounded_prompts(tokenizer, 30) + text_prompts(
        tokenizer, [8 + 3 * i for i in range(20)]
    )
    rng = random.Random(0)
    reqs = []
    for i, prompt in enumerate(prompts):
        kw = {"temperature": 0.0, "max_tokens": rng.randint(5, 24), "ignore_eos": i % 3 != 0}
        if i % 4 == 1:
            kw["stop"] = [" the", "."]
        if i % 7 == 2:
            kw["logprobs"] = 2
        reqs.append((f"r{i}", prompt, SamplingParams(**kw)))
    return reqs


def outputs_of(collector, reqs) -> dict[str, tuple]:
    out = {}
    for rid, _, _ in reqs:
        c = collector[rid]
        lps = [(lp.token_id, round(lp.logprob, 4)) for lp in c.logprobs]
        out[rid] = (c.token_ids, c.text, c.finish_reason, c.stop_reason, lps)
    return out


def spec_engine(smol_path, spec, **kw):
    kw = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 64, **kw}
    return build_engine(model=smol_path, speculative_config=spec, **kw)


def hashed_tokens_are_real(engine) -> None:
    """Every hashed block of a live request holds that request's own tokens."""
    kv, sched = engine.core.kv_cache_manager, engine.core.scheduler
    for rid, table in kv.req_to_blocks.items():
        req = sched.requests[rid]
        for i, block_id in enumerate(table):
            block = kv.blocks[block_id]
            if block.token_ids is not None:
                assert (i + 1) * kv.block_size <= req.num_computed_tokens
                assert list(block.token_ids) == req.all_token_ids[i * 16 : (i + 1) * 16]


def run_checking_hashes(engine, reqs) -> dict[str, tuple]:
    """Run ``reqs`` together step by step, checking the hashed blocks after every step."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    collector = Collector()
    while engine.has_unfinished():
        collector.feed(engine.step())
        hashed_tokens_are_real(engine)
    return outputs_of(collector, reqs)

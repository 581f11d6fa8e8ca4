"""Blocks left of the sliding window are released (issue 41 deliver 2): the KV-cache manager
with every layer's window releases a request's blocks once no later query of it can read
them, keeps them in the prefix cache, and releases each once; the engine serving a tiny
Mistral whose every layer has a 6-position window gives transformers' greedy tokens past
the window with its blocks released as it goes, the same tokens with the prefix cache (hits
past the window) and without, and without releasing. A model with full-attention layers
too (Gemma 3) has a pool per layer group: tests/engine/test_hybrid_kv_cache.py."""

from __future__ import annotations

import pytest

from tests.support.engine import (
    assert_like_hf,
    assert_no_leaks,
    greedy,
    held_blocks_each_step,
    hf_greedy,
    kv_request,
    kv_step,
    random_prompt,
    run_alone,
    run_batch,
    tiny_engine,
)
from tinyserve.engine import kv_cache_manager as kvm
from tinyserve.engine.kv_cache_manager import KVCacheManager

WINDOW = 6


def test_blocks_left_of_every_later_window_are_released_once():
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=WINDOW)
    a = kv_request("a", list(range(20)))
    table = kv_step(kv, a, 20)  # the prompt's queries see from position 0: all kept
    assert kv.num_dead_blocks("a") == 0 and kv.num_free_blocks == 11
    a.append_output_token(20)
    table = kv_step(kv, a, 1)  # query 20 sees 15 .. 20: blocks 0-2 (0 .. 11) are left of it
    assert kv.num_dead_blocks("a") == 3 and kv.num_free_blocks == 16 - 3
    assert [kv.blocks[b].ref_count for b in table] == [0, 0, 0, 1, 1, 1]
    assert kv.pool_map().count("u") == 3 and kv.get_block_ids("a") == table
    for t in range(21, 26):  # queries 21 .. 25: at 25 (sees 20 ..) blocks 3-4 go too
        a.append_output_token(t)
        table = kv_step(kv, a, 1)
    assert kv.num_dead_blocks("a") == 5 and len(table) == 7
    assert kv.num_free_blocks == 16 - 2  # blocks 5, 6 (positions 20-27) held
    kv.free("a")
    assert kv.num_free_blocks == 16 and all(b.ref_count == 0 for b in kv.blocks)
    assert kv.num_dead_blocks("a") == 0


def test_released_blocks_stay_in_the_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=WINDOW)
    a = kv_request("a", list(range(20)))
    kv_step(kv, a, 20)
    a.append_output_token(20)
    kv_step(kv, a, 1)
    assert kv.num_dead_blocks("a") == 3
    b = kv_request("b", list(range(16)) + [99, 98])
    hits, num_hit_tokens = kv.get_computed_blocks(b)  # 3 released blocks and a held one
    assert num_hit_tokens == 16 and hits == kv.get_block_ids("a")[:4]
    b.num_computed_tokens = num_hit_tokens
    kv_step(kv, b, 2, hits)  # the hits left of query 16's window enter dead, untaken
    assert kv.num_dead_blocks("b") == 2
    assert [kv.blocks[h].ref_count for h in hits] == [0, 0, 1, 2]
    kv.free("a"), kv.free("b")
    assert kv.num_free_blocks == 16 and all(b.ref_count == 0 for b in kv.blocks)


def test_hits_left_of_the_window_are_never_taken():
    """A prompt computed 4 tokens a step in a 5-block pool holds at most 3 blocks at once (a
    step's and its window's); asked again with 2 more tokens, its 5 cached blocks are hits,
    the 3 left of query 20's window entered dead and never taken: 3 blocks held, where
    taking every hit (5) and a new block would not fit the pool."""
    kv = KVCacheManager(num_blocks=5, block_size=4, sliding_window=WINDOW)
    assert kv.blocks_to_hold(100, 8) == 5 and kv.blocks_to_hold(10, 8) == 3
    assert KVCacheManager(num_blocks=6, block_size=4).blocks_to_hold(100, 8) == 25
    a = kv_request("a", list(range(20)))
    held = []
    for _ in range(5):
        kv_step(kv, a, 4)
        held.append(5 - kv.num_free_blocks)
    assert held == [1, 2, 3, 3, 3] and kv.num_dead_blocks("a") == 2
    kv.free("a")
    b = kv_request("b", list(range(22)))
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 20 and len(hits) == 5
    b.num_computed_tokens = num_hit_tokens
    table = kv_step(kv, b, 2, hits)
    assert table[:5] == hits and kv.num_dead_blocks("b") == 3
    # The live hits and the new block are held; the new one may reuse a dead entry's block
    # (whose values the window never reads).
    assert [kv.blocks[h].ref_count for h in hits[3:]] == [1, 1] and len(table) == 6
    assert table[5] not in hits[3:] and kv.blocks[table[5]].ref_count == 1
    assert kv.num_free_blocks == 2
    kv.free("b")
    assert kv.num_free_blocks == 5 and all(blk.ref_count == 0 for blk in kv.blocks)


def test_without_a_window_on_every_layer_nothing_is_released():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv_step(kv, kv_request("a", list(range(20))), 20)
    assert kv.num_dead_blocks("a") == 0 and kv.num_free_blocks == 11
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(num_blocks=4, block_size=4, sliding_window=0)


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from tinyserve.testing.checkpoints import build_hf, save_hf, tiny_config

    hf = build_hf(tiny_config("mistral", sliding_window=WINDOW, initializer_range=0.5))
    return str(save_hf(hf, tmp_path_factory.mktemp("mistral_window"))), hf


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_the_engine_releases_blocks_and_keeps_transformers_tokens(mistral, kernels):
    path, hf = mistral
    prompt = random_prompt(30, seed=3)
    want = hf_greedy(hf, prompt, 24)
    engine = tiny_engine(path, num_blocks=64, block_size=4, enable_prefix_caching=False,
                         cpu_kernels=kernels)  # fmt: skip
    assert engine.executor.model.attention_backend == ("kernel" if kernels else "torch")
    assert engine.core.kv_cache_manager.sliding_window == WINDOW
    held = held_blocks_each_step(engine, "r")
    assert_like_hf(run_alone(engine, [("r", prompt, greedy(24, logprobs=1))]), {"r": want})
    # The prompt's step holds its 8 blocks (its queries see from position 0); after it, of
    # the 14 blocks 54 positions fill, the window keeps at most 3 (6 keys + the new one).
    assert held[0] == (8,) and max(h for (h,) in held[1:]) <= 3 and len(held) == 24
    assert_no_leaks(engine)


def test_prefix_cache_hits_past_the_window_give_the_uncached_tokens(mistral):
    """Requests sharing a 32-token prefix (8 blocks, released as left of the window by the
    first request but still cached): the hits change no token, nor does releasing."""
    path, _ = mistral
    shared = random_prompt(32, seed=4)
    requests = [(f"r{i}", shared + random_prompt(5, seed=10 + i), greedy(16)) for i in range(3)]
    outs = {}
    for caching in (True, False):
        engine = tiny_engine(path, num_blocks=64, block_size=4, enable_prefix_caching=caching)
        done = run_alone(engine, requests)
        outs[caching] = {rid: done[rid].token_ids for rid, _, _ in requests}
        if caching:
            assert all(done[f"r{i}"].num_cached_tokens == 32 for i in (1, 2))
        assert_no_leaks(engine)
    assert outs[True] == outs[False]
    engine = tiny_engine(path, num_blocks=64, block_size=4)
    engine.core.kv_cache_manager.sliding_window = None  # keep every block: the same tokens
    done = run_alone(engine, requests)
    assert {rid: done[rid].token_ids for rid, _, _ in requests} == outs[True]


def test_speculative_verification_past_the_window_keeps_the_tokens(mistral):
    """Drafts from a prediction (Predicted Outputs: the plain output, every 9th token
    wrong) verified as multi-row runs past the window, num_computed_tokens moved back over
    the rejected ones, blocks released and free blocks scribbled on as above: the tokens of
    plain decoding, with most drafts accepted."""
    path, _ = mistral
    prompts = {f"r{i}": random_prompt(20 + i, seed=20 + i) for i in range(3)}
    plain = run_alone(tiny_engine(path, num_blocks=64, block_size=4,
                                  enable_prefix_caching=False),
                      [(rid, p, greedy(40)) for rid, p in prompts.items()])  # fmt: skip
    requests = []
    for rid, prompt in prompts.items():
        pred = [(t + 1) % 256 if i % 9 == 8 else t for i, t in enumerate(plain[rid].token_ids)]
        requests.append((rid, prompt, greedy(40, prediction=tuple(pred))))
    # Not adaptive: every step drafts up to 4 (the measured step costs would vary the count).
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    engine = tiny_engine(path, num_blocks=64, block_size=4, enable_prefix_caching=False,
                         speculative_config=spec)  # fmt: skip
    held_blocks_each_step(engine, "r0")
    done = run_alone(engine, requests)
    for rid in prompts:
        assert done[rid].token_ids == plain[rid].token_ids, rid
    assert engine.core.scheduler.proposer.stats.num_accepted_tokens > 60
    assert_no_leaks(engine)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_a_windowed_model_serves_past_the_kv_cache(mistral, kernels):
    """Every layer windowed, 8 tokens a step: a request holds at most 5 blocks at once (the
    window's 6 positions and a step's 8: blocks left of the window released before a step's
    are taken), so a 5-block pool (20 tokens) serves 70-token requests, its context uncapped: transformers' greedy tokens alone (free blocks
    scribbled on each step), and three at once (preempted and recomputed as the pool runs
    short), with and without the prefix cache; nothing leaked."""
    path, hf = mistral
    prompts = {f"r{i}": random_prompt(30, seed=40 + i) for i in range(3)}
    want = {rid: hf_greedy(hf, prompt, 40) for rid, prompt in prompts.items()}
    requests = [(rid, prompt, greedy(40, logprobs=1)) for rid, prompt in prompts.items()]
    for caching in (False, True):
        engine = tiny_engine(path, num_blocks=5, block_size=4, max_num_batched_tokens=8,
                             enable_prefix_caching=caching, cpu_kernels=kernels)  # fmt: skip
        assert engine.max_model_len == 512  # the model's, past the pool's 20 tokens
        if not caching:
            held = held_blocks_each_step(engine, "r0")
            assert_like_hf(run_alone(engine, requests[:1]), {"r0": want["r0"]})
            assert max(h for (h,) in held) <= 5
        assert_like_hf(run_batch(engine, requests), want)
        assert engine.core.scheduler.num_preemptions > 0
        assert_no_leaks(engine)


def test_the_context_stays_capped_where_one_request_would_not_fit(mistral):
    """A pool smaller than one request's live blocks (4 < 5), or whole prompts in one step
    (no chunked prefill): the context is the pool's, as for a model without a window."""
    path, _ = mistral
    small = tiny_engine(path, num_blocks=4, block_size=4, max_num_batched_tokens=8)
    assert small.max_model_len == 16
    engine = tiny_engine(path, num_blocks=6, block_size=4, max_num_batched_tokens=32,
                         enable_chunked_prefill=False)  # fmt: skip
    assert engine.max_model_len == 24


# -- hits past evicted blocks ------------------------------------------------------------------


def _evicted_prefix(kv: KVCacheManager) -> None:
    """In a 5-block pool request "a" computes 20 tokens, 4 a step, in blocks 0-4 (window 6:
    0 and 1 released on the way, the rest at its end, tail first); "c" (8 tokens) then takes
    the free queue's head, a's blocks 0 and 1: evicted."""
    a = kv_request("a", list(range(20)))
    for _ in range(5):
        table = kv_step(kv, a, 4)
    assert table == [0, 1, 2, 3, 4]
    kv.free("a")
    assert kv_step(kv, kv_request("c", list(range(100, 108))), 8) == [0, 1]
    assert kv.blocks[1].token_ids == (104, 105, 106, 107)  # c's now
    assert kv.blocks[2].token_ids == (8, 9, 10, 11)  # still a's


def test_a_hit_passes_over_evicted_blocks_left_of_its_window():
    """Asked again with 2 more tokens, a's prompt hits all 5 blocks: the 2 evicted ones (and
    block 2) left of query 20's window enter dead (block 0 standing in for the evicted), the
    2 others are taken; the request registers its next block on the chain, so a later
    request hits 24 tokens past 4 evicted blocks; nothing leaks."""
    kv = KVCacheManager(num_blocks=5, block_size=4, sliding_window=WINDOW)
    _evicted_prefix(kv)
    b = kv_request("b", list(range(22)))
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 20 and hits == [kvm.GONE, kvm.GONE, 2, 3, 4]
    b.num_computed_tokens = num_hit_tokens
    table = kv_step(kv, b, 2, hits)
    assert table == [0, 0, 2, 3, 4, 2] and kv.num_dead_blocks("b") == 3  # block 2 reused
    assert [kv.blocks[i].ref_count for i in (3, 4, 2)] == [1, 1, 1]
    for t in range(22, 25):
        b.append_output_token(t)
        kv_step(kv, b, 1)
    # Query 24 left block 3 behind (released, then taken for b's seventh block: evicted).
    assert kv.get_block_ids("b") == [0, 0, 2, 3, 4, 2, 3]
    hits, num_hit_tokens = kv.get_computed_blocks(kv_request("b2", list(range(24)) + [7]))
    assert num_hit_tokens == 24 and hits == [kvm.GONE] * 4 + [4, 2]
    kv.free("b"), kv.free("c")
    assert kv.num_free_blocks == 5 and all(blk.ref_count == 0 for blk in kv.blocks)


def test_an_evicted_block_is_passed_over_only_left_of_the_window():
    """The hit is cut before an evicted block the first new query's window reads (14 tokens:
    the query at 12 sees 7 .. 12, block 1 evicted: no hit at all); a prompt whose first
    block differs misses everything after it, evicted or not."""
    kv = KVCacheManager(num_blocks=5, block_size=4, sliding_window=WINDOW)
    _evicted_prefix(kv)
    assert kv.get_computed_blocks(kv_request("short", list(range(14)))) == ([], 0)
    other = [99, 98, 97, 96] + list(range(4, 22))
    assert kv.get_computed_blocks(kv_request("other", other)) == ([], 0)


def test_a_collision_with_an_evicted_block_is_a_miss(monkeypatch):
    """With a hash that forgets the parent, a prompt starting with a's second block's tokens
    finds a's evicted block 1 under its hash; the kept identity (its parent's content id)
    rejects it."""
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: hash(tokens))
    kv = KVCacheManager(num_blocks=5, block_size=4, sliding_window=WINDOW)
    _evicted_prefix(kv)
    assert hash((4, 5, 6, 7)) in kv._ghosts
    assert kv.get_computed_blocks(kv_request("other", list(range(4, 26)))) == ([], 0)


def test_without_a_window_evicted_blocks_leave_no_ghosts():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv_step(kv, kv_request("a", list(range(16))), 16)
    kv.free("a")
    kv_step(kv, kv_request("c", list(range(100, 116))), 16)
    assert not kv._ghosts
    assert kv.get_computed_blocks(kv_request("b", list(range(18)))) == ([], 0)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_the_engine_hits_past_evicted_blocks_and_keeps_transformers_tokens(mistral, kernels):
    """A 30-token prompt runs, another request then evicts its early blocks (released as left
    of the window); the first prompt with 3 more tokens still hits its last cached blocks,
    the evicted ones entered dead: transformers' greedy tokens, nothing leaked."""
    path, hf = mistral
    prompt = random_prompt(30, seed=60)
    engine = tiny_engine(path, num_blocks=9, block_size=4, max_num_batched_tokens=8,
                         cpu_kernels=kernels)  # fmt: skip
    run_alone(engine, [("a", prompt, greedy(4)), ("c", random_prompt(12, seed=61), greedy(2))])
    kv = engine.core.kv_cache_manager
    again = prompt + random_prompt(3, seed=62)
    hits, num_hit_tokens = kv.get_computed_blocks(kv_request("probe", again))
    assert kvm.GONE in hits and num_hit_tokens >= 24, (hits, num_hit_tokens)
    done = run_alone(engine, [("b", again, greedy(12))])
    assert done["b"].num_cached_tokens == num_hit_tokens
    assert done["b"].token_ids == hf_greedy(hf, again, 12)[0]
    assert_no_leaks(engine)

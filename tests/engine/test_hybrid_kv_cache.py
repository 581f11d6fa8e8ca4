"""A model mixing sliding-window and full-attention layers (Gemma 3) has a block table per
layer group over one shared pool (issue 41 deliver 2; vLLM's hybrid allocator): the layers
are grouped as vLLM does, the windowed groups release a request's blocks left of the window
while the full-attention group keeps them, an allocation takes every group's blocks or none,
a prefix hit is the run every group holds, a block is a page of one group's layers; and the
engine serving a tiny Gemma 3 from a pool in which one table for all layers could not hold
one request gives transformers' greedy tokens (kernels and torch, with and without the
prefix cache, alone, batched and preempted)."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import (
    Choice,
    Collector,
    assert_like_hf,
    assert_no_leaks,
    greedy,
    held_blocks,
    held_blocks_each_step,
    hf_greedy,
    kv_request,
    kv_step,
    random_prompt,
    run_alone,
    run_batch,
    tiny_engine,
)
from tinyserve.config import CacheConfig, ModelConfig, window_live_blocks
from tinyserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from tinyserve.engine.kv_cache_manager import GONE
from tinyserve.utils.kv_groups import KVGroups, kv_groups
from tinyserve.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for

WINDOW = 6
# The tiny Gemma 3's layers (sliding, full, sliding): groups of one layer, the full one first.
TINY = KVGroups(size=1, layer_group=(1, 0, 2), layer_slot=(0, 0, 0), windows=(None, 6, 6))


def _gemma3_config(**over) -> ModelConfig:
    """Gemma 3 1B's layer pattern (26 layers, every 6th global) at a small width."""
    fields = dict(architecture="Gemma3ForCausalLM", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=26, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=256, sliding_window=512,
                  local_layers=tuple(int(i % 6 != 5) for i in range(26)))  # fmt: skip
    return ModelConfig(**{**fields, **over})


def test_layers_are_grouped_as_vllm_groups_them():
    groups = kv_groups(_gemma3_config())
    assert groups.size == 4 and groups.windows == (None,) + (512,) * 6  # 4 global, 22 local
    assert [groups.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [groups.layer_slot[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert groups.layer_group[:5] == (1, 1, 1, 1, 2) and groups.layer_slot[:5] == (0, 1, 2, 3, 0)
    assert groups.layer_group[24:] == (6, 6) and groups.layer_slot[24:] == (0, 1)  # short
    assert len(set(zip(groups.layer_group, groups.layer_slot, strict=True))) == 26
    tiny = _gemma3_config(num_hidden_layers=3, local_layers=(1, 0, 1), sliding_window=6)
    assert kv_groups(tiny) == TINY
    assert kv_groups(_gemma3_config(local_layers=(1,) * 26)) is None  # windowed everywhere
    assert kv_groups(_gemma3_config(sliding_window=None)) is None
    # One request's ids at once: every block in the full group, a window's in the others.
    assert groups.blocks_to_hold(160, 32, 16) == 7 * 10
    assert groups.blocks_to_hold(8000, 32, 16) == 500 + 6 * window_live_blocks(512, 32, 16)
    assert groups.capacity_tokens(500 + 6 * 35, 32, 16) == 8000


def test_a_block_is_a_page_of_one_group():
    """Gemma 3 1B's shape, 1 GiB: a block id is 4 layers' K/V, not 26 — 6.5x the ids; an
    8,000-token request takes 710 of them (the full group's 500, 35 in each windowed one)
    where one table would take 500 blocks of all 26 layers (3,250 of these ids' memory)."""
    cfg, dtype = _gemma3_config(), torch.float32
    per_layer = 2 * 16 * 1 * 256 * 4
    assert bytes_per_block(cfg, 16, dtype) == 4 * per_layer
    budget = CacheConfig(block_size=16, kv_cache_memory=1 << 30)
    assert num_blocks_for(cfg, budget, dtype) == (1 << 30) // (4 * per_layer)
    plain = _gemma3_config(sliding_window=None)
    assert bytes_per_block(plain, 16, dtype) == 26 * per_layer
    caches = allocate_kv_cache(_gemma3_config(num_hidden_layers=3, local_layers=(1, 0, 1)), 9,
                               4, dtype, groups=TINY)  # fmt: skip
    assert len(caches) == 3 and all(kv is caches[0] for kv in caches)  # one slot, shared
    groups = kv_groups(cfg)
    caches = allocate_kv_cache(cfg, 5, 16, dtype, groups=groups)
    assert all(caches[i] is caches[j] for i, j in ((0, 5), (1, 11), (4, 5), (25, 11)))
    assert len({id(kv) for kv in caches}) == 4
    caches[0][1].fill_(1)
    assert not caches[0][0].any() and not caches[1][1].any()


def test_windowed_groups_release_what_the_full_group_keeps():
    kv = HybridKVCacheManager(num_blocks=32, block_size=4, groups=TINY)
    full, left, right = kv.groups
    a = kv_request("a", range(20))
    table = kv_step(kv, a, 20)  # the prompt's queries see from position 0: all kept
    assert len(table) == 5 and [len(t) for t in kv.group_block_ids("a")] == [5, 5]
    assert kv.num_free_blocks == 32 - 15
    for t in range(20, 26):  # query 25 sees 20 .. 25: 5 blocks left of it
        a.append_output_token(t)
        table = kv_step(kv, a, 1)
    assert len(table) == 7 and held_blocks(full, "a") == 7
    assert held_blocks(left, "a") == held_blocks(right, "a") == 2 and kv.num_free_blocks == 32 - 11
    ids = [b for g in kv.groups for b in g.get_block_ids("a")[g.num_dead_blocks("a") :]]
    assert len(set(ids)) == 11 and kv.pool_map().count("u") == 11  # one pool, no id twice
    kv.free("a")
    assert kv.num_free_blocks == 32 and all(b.ref_count == 0 for b in kv.blocks)
    assert kv.group_block_ids("a") == [[], []] and not left.req_to_blocks


def test_an_allocation_takes_every_groups_blocks_or_none():
    kv = HybridKVCacheManager(num_blocks=12, block_size=4, groups=TINY)
    a = kv_request("a", range(20))
    assert kv.allocate_slots(a, 20) is None  # 3 groups x 5 blocks: 15 of 12
    assert kv.num_free_blocks == 12 and not any(g.req_to_blocks for g in kv.groups)
    for _ in range(5):  # 4 tokens a step: the window's and a step's blocks fit
        kv_step(kv, a, 4)
    assert held_blocks(kv, "a") == 5 and kv.num_free_blocks == 12 - 5 - 2 * held_blocks(
        kv.others[0], "a"
    )
    live = window_live_blocks(WINDOW, 4, 4)  # 4: a window's 6 positions and a step's 4
    assert kv.blocks_to_hold(20, 4) == 5 + 2 * live and kv.blocks_to_hold(200, 4) == 50 + 2 * live


def test_every_groups_hits_leave_the_free_queue_before_any_group_takes_a_block():
    """A's freed blocks at the free queue's head, other blocks behind them: b's hits (a's
    blocks, two per group) must all be taken out of the queue before any group takes its new
    block from the head — else one group's new block is another group's hit, held twice."""
    kv = HybridKVCacheManager(num_blocks=12, block_size=4, groups=TINY)
    a, z = kv_request("a", range(8)), kv_request("z", range(50, 58))
    kv_step(kv, a, 8)
    kv.free("a")
    kv_step(kv, z, 8)  # the 6 never-used blocks, freed behind a's
    kv.free("z")
    b = kv_request("b", list(range(8)) + [99, 98])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 8 and len(hits) == 2
    b.num_computed_tokens = 8
    kv_step(kv, b, 2, hits)
    ids = [i for g in kv.groups for i in g.get_block_ids("b")]
    assert len(ids) == len(set(ids)) == 9 and all(kv.blocks[i].ref_count == 1 for i in ids)
    assert kv.num_free_blocks == 3
    kv.free("b")
    assert kv.num_free_blocks == 12


def test_a_prefix_hit_is_the_run_every_group_holds():
    """a's blocks, freed, are taken back by other prompts from the free queue's head: the
    windowed groups' first ones (released early) go first, and the hit passes over them
    left of the window; once the full group's first block goes, there is no hit at all."""
    kv = HybridKVCacheManager(num_blocks=24, block_size=4, groups=TINY)
    a = kv_request("a", range(20))
    for _ in range(5):
        kv_step(kv, a, 4)
    tables = [g.get_block_ids("a") for g in kv.groups]
    kv.free("a")
    b = kv_request("b", list(range(20)) + [99, 98])
    assert kv.get_computed_blocks(b) == (list(zip(*tables, strict=True)), 20)
    expected = [
        (list(zip(*tables, strict=True)), 20),
        (
            [
                (tables[0][0], GONE, GONE),
                (tables[0][1], GONE, tables[2][1]),
                *zip(*(t[2:] for t in tables), strict=True),
            ],
            20,
        ),  # fmt: skip
        ([], 0),  # the full group's first block was taken
    ]
    for i, want in enumerate(expected):
        z = kv_request(f"z{i}", range(100 + 8 * i, 108 + 8 * i))
        kv_step(kv, z, 8)  # 6 blocks from the free queue's head
        kv.free(z.request_id)
        assert kv.get_computed_blocks(b) == want, i
    hits, num_hit_tokens = expected[1]
    b.num_computed_tokens = num_hit_tokens
    kv.reset_prefix_cache()
    c = kv_request("c", list(range(20)) + [1, 2])
    assert kv.get_computed_blocks(c) == ([], 0)
    kv.free("b")
    assert kv.num_free_blocks == 24


def test_evicted_window_hits_enter_dead_and_the_tokens_go_on():
    kv = HybridKVCacheManager(num_blocks=24, block_size=4, groups=TINY)
    a = kv_request("a", range(20))
    for _ in range(5):
        kv_step(kv, a, 4)
    kv.free("a")
    for i in range(2):
        z = kv_request(f"z{i}", range(100 + 8 * i, 108 + 8 * i))
        kv_step(kv, z, 8)
        kv.free(z.request_id)
    b = kv_request("b", list(range(20)) + [99, 98])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 20 and GONE in hits[0]
    b.num_computed_tokens = num_hit_tokens
    kv_step(kv, b, 2, hits)  # hits left of query 20's window enter dead (GONE: block 0 stands)
    full, left, right = kv.groups
    assert full.num_dead_blocks("b") == 0 and left.num_dead_blocks("b") == 3
    assert held_blocks(full, "b") == 6 and held_blocks(left, "b") == held_blocks(right, "b") == 3
    kv.free("b")
    assert kv.num_free_blocks == 24 and all(blk.ref_count == 0 for blk in kv.blocks)


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tinyserve.testing.checkpoints import build_hf, save_hf, tiny_config

    hf = build_hf(tiny_config("gemma3", sliding_window=WINDOW, initializer_range=0.5))
    return str(save_hf(hf, tmp_path_factory.mktemp("gemma3_hybrid"))), hf


def _assert_no_leaks(engine) -> None:
    assert_no_leaks(engine)
    for group in engine.core.kv_cache_manager.others:
        assert not group.req_to_blocks and not group._req_to_chain and not group._num_dead


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_gemma3_serves_requests_one_table_could_not_hold(gemma3, kernels):
    """40 block ids of one layer each: one table for the 3 layers would hold 13 blocks (52
    tokens), not one 70-token request. With a table per group a request holds its 18 in the
    full group and at most 5 in each windowed one (8 tokens a step). Three requests alone
    (free blocks scribbled on each step) and together (two at a time, preempted and
    recomputed as the pool runs short), with and without the prefix cache: transformers'
    greedy tokens."""
    path, hf = gemma3
    prompts = {f"r{i}": random_prompt(30, seed=60 + i) for i in range(3)}
    want = {rid: hf_greedy(hf, prompt, 40) for rid, prompt in prompts.items()}
    requests = [(rid, prompt, greedy(40, logprobs=1)) for rid, prompt in prompts.items()]
    for caching in (False, True):
        engine = tiny_engine(path, num_blocks=40, block_size=4, max_num_batched_tokens=8,
                             max_num_seqs=2, enable_prefix_caching=caching,
                             cpu_kernels=kernels)  # fmt: skip
        kv = engine.core.kv_cache_manager
        assert isinstance(kv, HybridKVCacheManager) and kv.kv_groups == TINY
        # The longest request: 30 full-group ids and 5 in each windowed group, 120 tokens.
        assert engine.executor.kv_capacity_tokens == engine.max_model_len == 120
        if not caching:
            held = held_blocks_each_step(engine, "r0")
            assert_like_hf(run_alone(engine, requests), want)
            assert held[-1][0] == 18 and max(max(h[1:]) for h in held) <= 5
        assert_like_hf(run_batch(engine, requests), want)
        assert engine.core.scheduler.num_preemptions > 0
        _assert_no_leaks(engine)


def test_gemma3_prefix_hits_over_evicted_window_blocks_keep_the_tokens(gemma3):
    """A shared 24-token prefix served again after the pool took the windowed groups' early
    blocks back (the hit passes over them, left of the window): transformers' tokens."""
    path, hf = gemma3
    shared = random_prompt(24, seed=80)
    prompts = {f"s{i}": shared + random_prompt(6, seed=81 + i) for i in range(3)}
    want = {rid: hf_greedy(hf, prompt, 20) for rid, prompt in prompts.items()}
    engine = tiny_engine(path, num_blocks=34, block_size=4, max_num_batched_tokens=8,
                         max_num_seqs=2)  # fmt: skip
    kv = engine.core.kv_cache_manager
    first = run_alone(engine, [("s0", prompts["s0"], greedy(20, logprobs=1))])
    hits, num_hit_tokens = kv.get_computed_blocks(kv_request("probe", prompts["s1"]))
    # s0's 50 tokens took 13 + 2 x 13 ids from a pool of 34: its windowed groups' first
    # blocks were taken again (left of query 24's window); the full group holds all six.
    assert num_hit_tokens == 24 and GONE in {b for hit in hits for b in hit[1:]}
    rest = run_alone(engine, [(rid, prompts[rid], greedy(20, logprobs=1)) for rid in ("s1", "s2")])
    assert_like_hf(first, {"s0": want["s0"]})
    assert_like_hf(rest, {rid: want[rid] for rid in ("s1", "s2")})
    assert rest["s1"].num_cached_tokens == 24
    _assert_no_leaks(engine)


def test_gemma3_under_churn_keeps_every_token_and_leaks_nothing(gemma3):
    """Twelve requests on a 30-page pool, four at a time, 8 tokens a step: shared prefixes
    (hits, some over evicted window blocks), speculation (n-gram drafts on repetitive
    prompts: slots taken and trimmed in every group), preemption, and three requests
    aborted mid-way. Every request that finishes has the tokens of a roomy engine without
    the prefix cache or drafts; the pool ends whole, every group's tables empty."""
    import random

    path, _ = gemma3
    rng = random.Random(7)
    shared = random_prompt(16, seed=100)
    requests = []
    for i in range(12):
        body = random_prompt(rng.randrange(4, 20), seed=200 + i)
        prompt = (shared if i % 2 else []) + body + body[:8]  # repeats: drafts find them
        requests.append((f"q{i}", prompt, greedy(rng.randrange(8, 30))))
    roomy = tiny_engine(path, num_blocks=400, block_size=4, enable_prefix_caching=False)
    want = run_batch(roomy, requests)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "adaptive": False}  # fmt: skip
    engine = tiny_engine(path, num_blocks=30, block_size=4, max_num_batched_tokens=8,
                         max_num_seqs=4, speculative_config=spec)  # fmt: skip
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, aborted = Collector(), {"q3", "q6", "q10"}
    for step in range(3000):
        if not engine.has_unfinished():
            break
        done.feed(engine.step())
        if step in (5, 17, 40):
            engine.abort(sorted(aborted)[(5, 17, 40).index(step)])
    for rid, _, _ in requests:
        if (
            rid not in aborted
            or done.choices.get(rid, {}).get(0, Choice()).finish_reason == "length"
        ):
            assert done[rid].token_ids == want[rid].token_ids, rid
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.core.scheduler.proposer.stats.num_accepted_tokens > 0
    assert engine.core.kv_cache_manager.prefix_cache_hits > 0
    _assert_no_leaks(engine)

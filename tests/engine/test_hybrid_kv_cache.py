"""A model mixing sliding-window and full-attention layers (Gemma 3) keeps each layer group's
K/V in a pool of its own (issue 41 deliver 2; vLLM's hybrid allocator): the windowed layers'
blocks left of the window are released as a request moves on while the full-attention
layers' stay, an allocation takes blocks from both pools or from neither, a prefix hit is
the run both pools hold, the memory budget goes to the full pool, and the engine serving a
tiny Gemma 3 whose window pool holds far less than its contexts gives transformers' greedy
tokens (kernels and torch, with and without the prefix cache, batched and preempted)."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import (
    assert_no_leaks,
    greedy,
    random_prompt,
    run_alone,
    run_batch,
    tiny_engine,
)
from tinyserve.config import CacheConfig, ModelConfig, window_live_blocks
from tinyserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from tinyserve.engine.kv_cache_manager import GONE, KVCacheManager
from tinyserve.request import Request
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker.kv_cache import allocate_kv_cache, kv_cache_bytes, pool_sizes

WINDOW = 6


def _request(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=32), max_model_len=128)


def _step(kv, request: Request, num_new: int, hits=None) -> list[int]:
    table = kv.allocate_slots(request, num_new, hits)
    assert table is not None
    request.num_computed_tokens += num_new
    return table


def _held(pool, rid: str) -> int:
    return len(pool.get_block_ids(rid)) - pool.num_dead_blocks(rid)


def test_the_window_pool_releases_what_the_full_pool_keeps():
    kv = HybridKVCacheManager(num_blocks=16, num_window_blocks=8, block_size=4, window=WINDOW)
    a = _request("a", range(20))
    table = _step(kv, a, 20)  # the prompt's queries see from position 0: all kept, both pools
    assert len(table) == 5 and len(kv.window_block_ids("a")) == 5
    assert kv.num_free_blocks == 11 and kv.window.num_free_blocks == 3
    for t in range(20, 26):  # query 25 sees 20 .. 25: 5 window blocks left of it
        a.append_output_token(t)
        table = _step(kv, a, 1)
    assert len(table) == 7 and _held(kv, "a") == 7 and kv.num_free_blocks == 9
    assert len(kv.window_block_ids("a")) == 7 and _held(kv.window, "a") == 2
    assert kv.window.num_free_blocks == 6
    kv.free("a")
    assert kv.num_free_blocks == 16 and kv.window.num_free_blocks == 8
    assert kv.window_block_ids("a") == [] and not kv.window.req_to_blocks


def test_an_allocation_takes_both_pools_or_neither():
    kv = HybridKVCacheManager(num_blocks=16, num_window_blocks=4, block_size=4, window=WINDOW)
    a = _request("a", range(20))
    assert kv.allocate_slots(a, 20) is None  # 5 window blocks at once: the window pool has 4
    assert kv.num_free_blocks == 16 and kv.window.num_free_blocks == 4
    assert not kv.req_to_blocks and not kv.window.req_to_blocks
    for _ in range(5):  # 4 tokens a step: the window's and a step's blocks fit
        _step(kv, a, 4)
    assert _held(kv, "a") == 5 and _held(kv.window, "a") <= 3
    small = HybridKVCacheManager(num_blocks=2, num_window_blocks=8, block_size=4, window=WINDOW)
    assert small.allocate_slots(_request("b", range(12)), 12) is None  # the full pool short
    assert small.window.num_free_blocks == 8 and not small.window.req_to_blocks


def test_a_prefix_hit_is_the_run_both_pools_hold():
    """The window pool (6 blocks) loses a's cached blocks to other prompts, oldest first,
    while the full pool (32) keeps them all: the hit passes over evicted window blocks left
    of its first query's window, is cut where one inside the window is gone, and is empty
    once the window pool holds none of it."""
    kv = HybridKVCacheManager(num_blocks=32, num_window_blocks=6, block_size=4, window=WINDOW)
    a = _request("a", range(20))
    for _ in range(5):
        _step(kv, a, 4)
    kv.free("a")
    b = _request("b", list(range(20)) + [99, 98])
    full = KVCacheManager.get_computed_blocks(kv, b)[0]
    assert full == [0, 1, 2, 3, 4]
    assert kv.get_computed_blocks(b) == (list(zip(full, full, strict=True)), 20)
    expected = [
        ([(0, GONE), (1, 1), (2, 2), (3, 3), (4, 4)], 20),  # block 0: left of query 20's
        ([(0, GONE), (1, GONE), (2, 2), (3, 3)], 16),  # block 4 gone, inside: cut before it
        ([], 0),
    ]
    for i, want in enumerate(expected):
        z = _request(f"z{i}", range(100 + 8 * i, 108 + 8 * i))
        _step(kv, z, 8)  # 2 window blocks from the free queue's head
        kv.free(z.request_id)
        assert kv.get_computed_blocks(b) == want
        assert KVCacheManager.get_computed_blocks(kv, b)[0] == full
    b.num_computed_tokens = 16
    _step(kv, b, 6, expected[1][0])  # the hits left of query 16's window enter dead
    assert kv.window.num_dead_blocks("b") == 2 and _held(kv, "b") == 6
    assert kv.window.get_block_ids("b")[2:4] == [2, 3] and _held(kv.window, "b") <= 4
    kv.free("b")
    assert kv.num_free_blocks == 32 and kv.window.num_free_blocks == 6


def _gemma3_config(**over) -> ModelConfig:
    fields = dict(architecture="Gemma3ForCausalLM", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=512,
                  local_layers=(1, 1, 1, 1, 1, 0))  # fmt: skip
    return ModelConfig(**{**fields, **over})


def test_the_memory_budget_goes_to_the_full_pool():
    """Five windowed layers to one full: the window pool holds what max_num_seqs requests
    hold there; the rest of the budget buys full-pool blocks, ~3.6x as many tokens here."""
    cfg, dtype = _gemma3_config(), torch.float32
    budget = CacheConfig(block_size=16, kv_cache_memory=64 << 20)
    full, windowed = pool_sizes(cfg, budget, dtype, 1, max_num_seqs=8, max_chunk=512)
    plain = (64 << 20) // (6 * 2 * 16 * 2 * 16 * 4)  # every layer in one pool
    assert windowed == 8 * window_live_blocks(512, 512, 16) and full > 3.5 * plain
    assert kv_cache_bytes(cfg, 16, dtype, 1, full, windowed) <= 64 << 20
    assert kv_cache_bytes(cfg, 16, dtype, 1, full + 1, windowed) > 64 << 20
    # Many sequences: the window pool would not be smaller, so one pool's worth each.
    assert pool_sizes(cfg, budget, dtype, 1, 256, 512) == (plain, plain)
    given = CacheConfig(block_size=16, num_blocks=40)  # a count is the full pool's
    assert pool_sizes(cfg, given, dtype, 1, 8, 512) == (40, 40)
    assert pool_sizes(cfg, given, dtype, 1, 1, 16) == (40, window_live_blocks(512, 16, 16))
    mistral = _gemma3_config(architecture="MistralForCausalLM", local_layers=None)
    assert pool_sizes(mistral, given, dtype, 1, 8, 512) == (40, None)  # windowed everywhere
    caches = allocate_kv_cache(cfg, 40, 16, dtype, num_window_blocks=9)
    assert [k.shape[0] for k, _ in caches] == [9, 9, 9, 9, 9, 40]
    caches[0][1].fill_(1)
    assert not caches[0][0].any() and not caches[1][0].any() and not caches[5][1].any()


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tinyserve.testing.checkpoints import build_hf, save_hf, tiny_config

    hf = build_hf(tiny_config("gemma3", sliding_window=WINDOW, initializer_range=0.5))
    return str(save_hf(hf, tmp_path_factory.mktemp("gemma3_hybrid"))), hf


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    from tinyserve.testing.checkpoints import hf_logits

    out: list[int] = []
    for _ in range(n):
        out.append(int(hf_logits(hf, prompt + out)[-1].argmax()))
    return out


def _held_blocks_each_step(engine, rid: str) -> list[tuple[int, int]]:
    """Records the blocks ``rid`` holds in each step in each pool and, once a step is
    scheduled and before it runs, fills every free block of each layer's pool with random
    K/V: a block released while a query still reads it would change the tokens (prefix
    caching off: a free block is never read again)."""
    kv, sched, seen = engine.core.kv_cache_manager, engine.core.scheduler, []
    config = engine.executor.model_config
    schedule, gen = sched.schedule, torch.Generator().manual_seed(0)

    def scribbling_schedule():
        out = schedule()
        if rid in kv.req_to_blocks:
            seen.append((_held(kv, rid), _held(kv.window, rid)))
        for i, pair in enumerate(engine.executor.runner.kv_caches):
            pool = kv if config.layer_window(i) is None else kv.window
            free = torch.tensor(pool.free_block_ids, dtype=torch.int64)
            for cache in pair:
                cache[free] = torch.randn(cache[free].shape, generator=gen) * 10
        return out

    sched.schedule = scribbling_schedule
    return seen


def _assert_no_leaks(engine) -> None:
    assert_no_leaks(engine)
    window = engine.core.kv_cache_manager.window
    assert window.num_free_blocks == window.num_total_blocks and not window.req_to_blocks
    assert all(b.ref_count == 0 for b in window.blocks)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_gemma3_serves_from_a_window_pool_smaller_than_its_contexts(gemma3, kernels):
    """8 tokens a step, 2 sequences at most: the window pool is 10 blocks (each request holds
    at most 5 there), a quarter of what two 70-token contexts fill in the full pool. Three
    requests alone (free blocks of both pools scribbled on each step) and together (the
    third waits), with and without the prefix cache: transformers' greedy tokens."""
    path, hf = gemma3
    prompts = {f"r{i}": random_prompt(30, seed=60 + i) for i in range(3)}
    want = {rid: _hf_greedy(hf, prompt, 40) for rid, prompt in prompts.items()}
    requests = [(rid, prompt, greedy(40)) for rid, prompt in prompts.items()]
    for caching in (False, True):
        engine = tiny_engine(path, num_blocks=64, block_size=4, max_num_batched_tokens=8,
                             max_num_seqs=2, enable_prefix_caching=caching,
                             cpu_kernels=kernels)  # fmt: skip
        kv = engine.core.kv_cache_manager
        assert isinstance(kv, HybridKVCacheManager) and kv.window.num_total_blocks == 10
        caches = engine.executor.runner.kv_caches
        assert [k.shape[0] for k, _ in caches] == [10, 64, 10]  # sliding, full, sliding
        if not caching:
            held = _held_blocks_each_step(engine, "r0")
            alone = run_alone(engine, requests)
            assert {rid: alone[rid].token_ids for rid in prompts} == want
            assert max(w for _, w in held) <= 5 and held[-1][0] == 18  # 70 tokens, 4 a block
        done = run_batch(engine, requests)
        assert {rid: done[rid].token_ids for rid in prompts} == want
        _assert_no_leaks(engine)


def test_gemma3_prefix_hits_and_preemption_keep_the_tokens(gemma3):
    """A shared 24-token prefix served again after the window pool evicted its early blocks
    (hits over them, left of the window), and a pool so small the scheduler preempts and
    recomputes: transformers' greedy tokens throughout."""
    path, hf = gemma3
    shared = random_prompt(24, seed=80)
    prompts = {f"s{i}": shared + random_prompt(6, seed=81 + i) for i in range(3)}
    want = {rid: _hf_greedy(hf, prompt, 20) for rid, prompt in prompts.items()}
    engine = tiny_engine(path, num_blocks=64, block_size=4, max_num_batched_tokens=8,
                         max_num_seqs=2)  # fmt: skip
    kv = engine.core.kv_cache_manager
    first = run_alone(engine, [("s0", prompts["s0"], greedy(20))])
    b = _request("probe", prompts["s1"])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    # s0's 50 tokens took 13 window blocks from a pool of 10: its first ones are gone there
    # (left of query 24's window), the full pool holds all six.
    assert num_hit_tokens == 24 and GONE in [w for _, w in hits]
    rest = run_alone(engine, [(rid, prompts[rid], greedy(20)) for rid in ("s1", "s2")])
    assert first["s0"].token_ids == want["s0"]
    assert {rid: rest[rid].token_ids for rid in ("s1", "s2")} == {r: want[r] for r in ("s1", "s2")}
    assert rest["s1"].num_cached_tokens == 24
    _assert_no_leaks(engine)
    tight = tiny_engine(path, num_blocks=14, block_size=4, max_num_batched_tokens=8,
                        max_num_seqs=2, enable_prefix_caching=False)  # fmt: skip
    done = run_batch(tight, [(rid, prompt, greedy(20)) for rid, prompt in prompts.items()])
    assert {rid: done[rid].token_ids for rid in prompts} == want
    assert tight.core.scheduler.num_preemptions > 0
    _assert_no_leaks(tight)

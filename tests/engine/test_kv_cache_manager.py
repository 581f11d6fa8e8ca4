"""KVCacheManager: ref counts, LRU free queue, chained prefix hashes. No torch."""

from __future__ import annotations

import pytest

from tinyserve.engine import kv_cache_manager as kvm
from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.request import Request
from tinyserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), max_model_len=64)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does on admission: prefix hits, then slots for the rest."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    table = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert table is not None
    kv.record_prefix_lookup(request, len(hits))
    request.num_computed_tokens = request.num_tokens
    return table


def test_allocate_and_free_ref_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    table = admit(kv, a)
    assert table == [0, 1, 2] == kv.req_to_blocks["a"]
    assert [kv.blocks[b].ref_count for b in table] == [1, 1, 1]
    assert kv.num_free_blocks == 5 and kv.num_total_blocks == 8
    assert kv.usage == pytest.approx(3 / 8)
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert all(b.ref_count == 0 for b in kv.blocks)
    assert "a" not in kv.req_to_blocks
    kv.free("a")  # idempotent
    kv.free("never-seen")
    assert kv.num_free_blocks == 8


def test_shared_prefix_takes_references():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert (hits, num_hit_tokens) == ([0, 1], 8)
    table = admit(kv, b)
    assert table[:2] == [0, 1] and table[2] not in kv.req_to_blocks["a"]
    assert kv.blocks[0].ref_count == kv.blocks[1].ref_count == 2
    assert kv.num_free_blocks == 4  # 3 for a, 1 new for b
    kv.free("a")
    assert kv.blocks[0].ref_count == 1 and 0 not in kv.free_block_ids
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_hit_on_free_cached_block_leaves_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    kv.free("a")
    assert kv.num_free_blocks == 4
    table = admit(kv, make_request("b", [1, 2, 3, 4, 9]))
    assert table[:2] == [0, 1]
    assert kv.num_free_blocks == 1
    assert 0 not in kv.free_block_ids and 1 not in kv.free_block_ids
    assert kv.blocks[0].ref_count == 1


def test_free_in_reverse_order_and_lru_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))  # blocks 0, 1 full (hashed), 2 partial
    kv.free("a")
    # Never-used block 3 first, then a's blocks tail first.
    assert kv.free_block_ids == [3, 2, 1, 0]
    admit(kv, make_request("c", [7, 7]))
    assert kv.req_to_blocks["c"] == [3]
    admit(kv, make_request("d", [8, 8, 8]))  # takes 2 (unhashed), then evicts 1 (a's tail)
    assert kv.req_to_blocks["d"] == [2, 1]
    # a's head block survives; its second block is gone.
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 5]))
    assert (hits, num_hit_tokens) == ([0], 2)


def test_no_stale_hit_after_eviction_and_reuse():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    admit(kv, make_request("a", [1, 2, 3]))
    kv.free("a")
    admit(kv, make_request("b", [7, 8, 9]))  # reuses both blocks; block 0 gets new content
    assert kv.get_computed_blocks(make_request("a2", [1, 2, 3])) == ([], 0)
    kv.free("b")
    hits, _ = kv.get_computed_blocks(make_request("b2", [7, 8, 9]))
    assert len(hits) == 1 and kv.blocks[hits[0]].token_ids == (7, 8)


def test_hash_is_chained_on_the_parent():
    assert kvm.hash_block_tokens(None, (3, 4)) != kvm.hash_block_tokens(
        kvm.hash_block_tokens(None, (1, 2)), (3, 4)
    )
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 9]))
    # Same second block under a different first block: no hit at all.
    assert kv.get_computed_blocks(make_request("b", [5, 6, 3, 4, 9])) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", [3, 4, 9])) == ([], 0)


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: 42)
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    # a's second block collides with its first: the incumbent stays, registration stops.
    assert kv.cached_block_hash_to_block == {42: 0}
    assert kv.blocks[1].block_hash is None
    assert kv.get_computed_blocks(make_request("b", [5, 6, 7])) == ([], 0)
    table = admit(kv, make_request("b", [5, 6, 7]))
    assert kv.cached_block_hash_to_block == {42: 0}
    assert kv.blocks[table[0]].block_hash is None
    assert kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 5])) == ([0], 2)


def test_collision_that_ignores_the_parent_is_a_miss(monkeypatch):
    # A hash that forgets the parent: the stored parent identity still rejects the hit.
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: hash(tokens))
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 9]))
    assert kv.get_computed_blocks(make_request("b", [3, 4, 3, 4, 9])) == ([], 0)


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    kv.free("a")
    before = (kv.free_block_ids, dict(kv.cached_block_hash_to_block))
    b = make_request("b", [1, 2, 3, 4] + list(range(10, 17)))  # 11 tokens: 6 blocks
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    b.num_computed_tokens = num_hit_tokens
    # 2 free hits + 4 new blocks > 4 free blocks.
    assert kv.allocate_slots(b, b.num_tokens - num_hit_tokens, hits) is None
    assert (kv.free_block_ids, dict(kv.cached_block_hash_to_block)) == before
    assert "b" not in kv.req_to_blocks
    assert all(blk.ref_count == 0 for blk in kv.blocks)
    # Exactly enough once the free hits are counted: 2 hits + 2 new.
    c = make_request("c", [1, 2, 3, 4, 20, 21, 22])
    assert admit(kv, c)[:2] == [0, 1] and kv.num_free_blocks == 0


def test_allocate_short_for_running_request_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    admit(kv, a)
    a.append_output_token(5)
    assert kv.allocate_slots(a, 1) is None
    assert kv.req_to_blocks["a"] == [0, 1] and kv.num_free_blocks == 0


def test_tail_block_is_never_shared_until_full():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3])
    table = admit(kv, a)
    assert kv.blocks[table[1]].block_hash is None  # partly filled tail
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([table[0]], 2)
    # a decodes one token: its tail becomes full and is registered now.
    a.append_output_token(4)
    assert kv.allocate_slots(a, 1) == table
    assert kv.blocks[table[1]].token_ids == (3, 4)
    assert kv.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])) == (table, 4)


def test_hits_never_cover_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4]))
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("b", [1, 2, 3, 4]))
    assert (len(hits), num_hit_tokens) == (1, 2)


def test_counters_in_tokens_and_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))  # 5 tokens looked up, 2 full blocks, 0 hits
    b = make_request("b", [1, 2, 3, 4, 6, 7, 8])  # 7 tokens, 3 blocks, 2 hit
    kv.get_computed_blocks(b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (5, 0)  # a lookup alone: nothing
    admit(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 4)
    assert (kv.prefix_cache_block_queries, kv.prefix_cache_block_hits) == (5, 2)


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    assert kv.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.blocks)
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.prefix_cache_queries == kv.prefix_cache_hits == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    admit(kv, make_request("b", [5, 6, 7]))
    kv.free("b")
    kv.reset_prefix_cache()
    assert kv.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_request("b2", [5, 6, 7])) == ([], 0)
    # A running request registers nothing more after a reset.
    a.append_output_token(4)
    kv.allocate_slots(a, 1)
    assert kv.cached_block_hash_to_block == {}
    assert kv.req_to_blocks["a"] == [0, 1]


def test_hits_must_be_for_a_new_request():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3]))
    b = make_request("b", [1, 2, 3])
    admit(kv, b)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, [0])


def test_a_leaving_request_hashes_what_its_last_step_accepted():
    """Slots for drafts are allocated before they are the request's tokens, so their blocks
    are hashed at the next allocation; the last step's never were (a conversation's next
    turn repeats them). ``cache_computed`` hashes them, never past the computed tokens."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(5)))
    admit(kv, a)
    a.num_computed_tokens = 4  # the last prompt token's K/V not yet written: decodes it
    assert kv.allocate_slots(a, 1 + 6) is not None  # with 6 drafts: slots to 11
    for token in (5, 6, 7, 8, 9):  # 4 drafts accepted and the bonus token: 10 tokens
        a.append_output_token(token)
    a.num_computed_tokens = 5 + 4  # 9 written (the bonus token's is not)
    probe = make_request("b", list(range(10)) + [99])
    assert kv.get_computed_blocks(probe)[1] == 4  # only the prompt's full block
    kv.cache_computed(a)
    assert kv.get_computed_blocks(probe)[1] == 8  # tokens 4-7 too; 8-9 fill no block
    kv.free("a")
    assert kv.get_computed_blocks(probe)[1] == 8

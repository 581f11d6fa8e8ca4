"""HybridKVCacheManager: a block table per layer group over one shared pool, for a model
whose layers mix full attention with one sliding window (Gemma 3) — vLLM's hybrid KV-cache
manager (utils/kv_groups.py says how the layers are grouped and the cache laid out).

- Group 0 is this manager itself (full attention, so stats, the live view and the prefix
  metrics read it as before); every other group is a KVCacheManager sharing its pool (blocks,
  free queue, prefix cache, ghosts), with the group's window or none. A windowed group
  releases a request's blocks wholly left of its next query's window as it moves on, enters
  hits left of the first query's window dead and passes over evicted ones (``GONE``), as for
  a model windowed everywhere; a full-attention group keeps every block.
- So a long request holds its whole context only in the full-attention groups: the memory
  the windowed layers would spend on the rest of it stays free for other requests, and the
  pool is shared, so no split between the groups has to be guessed.
- Every group hashes the same tokens from its own root (kv_cache_utils.root_hash), so no
  hit crosses groups. A prefix hit is the run every group holds: each group's lookup is
  capped by the previous group's run.
- An allocation takes every group's blocks or none: all groups' needs are counted against
  the one free queue first, every group's hits are taken out of it before any group takes a
  new block (a free hit must not be reused by another group first).
"""

from __future__ import annotations

from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.request import Request
from tinyserve.utils.kv_groups import KVGroups


class HybridKVCacheManager(KVCacheManager):
    """``num_blocks`` ids, each a page of ``groups.size`` layers, shared by the groups."""

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups,
                 enable_prefix_caching: bool = True):  # fmt: skip
        if groups.windows[0] is not None:
            raise ValueError("a hybrid model's first layer group is a full-attention one")
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.kv_groups = groups
        self.keep_ghosts = True  # (shared by the groups below)
        self.others = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, w, share=self, group=g)
            for g, w in enumerate(groups.windows[1:], start=1)
        ]

    @property
    def groups(self) -> list[KVCacheManager]:
        return [self, *self.others]

    def blocks_to_hold(self, num_tokens: int, max_chunk: int) -> int:
        return self.kv_groups.blocks_to_hold(num_tokens, max_chunk, self.block_size)

    def get_computed_blocks(
        self, request: Request, max_blocks: int | None = None
    ) -> tuple[list[tuple[int, ...]], int]:
        """The run every group holds: one tuple of block ids per block (one id per group)."""
        runs = [super().get_computed_blocks(request, max_blocks)[0]]
        for group in self.others:
            runs.append(group.get_computed_blocks(request, len(runs[-1]))[0])
        n = min(len(run) for run in runs)
        return list(zip(*(run[:n] for run in runs), strict=True)), n * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[tuple[int, ...]] | None = None,
    ) -> list[int] | None:
        """Every group's table covers the tokens, or nothing changes (but the windowed
        groups' release of blocks left of the window). Returns group 0's table; the others'
        are ``group_block_ids``."""
        hits = list(zip(*computed_blocks, strict=True)) if computed_blocks else []
        per_group = [list(hits[g]) if hits else [] for g in range(len(self.others) + 1)]
        groups = self.groups
        needed = sum(group.blocks_needed(request, num_new_tokens, group_hits)
                     for group, group_hits in zip(groups, per_group, strict=True))  # fmt: skip
        if needed > self.num_free_blocks:
            return None
        for group, group_hits in zip(groups, per_group, strict=True):
            group.enter_hits(request, group_hits)
        for group in self.others:
            group.extend(request, num_new_tokens)
        return self.extend(request, num_new_tokens)

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        return [group.get_block_ids(request_id) for group in self.others]

    def cache_computed(self, request: Request) -> None:
        for group in self.groups:
            KVCacheManager.cache_computed(group, request)

    def free(self, request_id: str) -> None:
        for group in self.groups:
            KVCacheManager.free(group, request_id)

    def trim(self, request: Request) -> None:
        for group in self.groups:
            KVCacheManager.trim(group, request)

"""How a hybrid model's layers share the paged KV cache: vLLM's hybrid allocator (torch-free).

A model that mixes sliding-window and full-attention layers (Gemma 3: five local layers of
window 512 to each global one) can release its windowed layers' blocks left of the window
but must keep its full-attention layers' whole context. So the layers are cut into *groups*
of ``size`` layers each, full-attention groups first (the fewer kind's count is the size, as
vLLM does; the last group of the other kind may be short), and each group has its own block
table per request (engine/hybrid_kv_cache_manager.py). Every group draws block ids from one
pool, and one block id is a page of ``size`` layers: the cache has ``size`` tensors (slots)
of K and of V, and layer ``l`` keeps its K/V in slot ``layer_slot[l]`` at the ids of group
``layer_group[l]``'s table (worker/kv_cache.py). Gemma 3 1B (4 global, 22 local layers):
groups of 4, one full and six windowed (the last of two layers); a token inside the window
takes 7 ids, one left of it only the full group's 1 - where one table for all 26 layers
spends 26 layers' memory on every token of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.config import ModelConfig, window_live_blocks


@dataclass(frozen=True)
class KVGroups:
    size: int  # layers per group: the cache's slots (tensors of K and of V)
    layer_group: tuple[int, ...]  # per layer, its group (full-attention groups first)
    layer_slot: tuple[int, ...]  # per layer, its slot in 0 .. size - 1
    windows: tuple[int | None, ...]  # per group, its sliding window (None: full attention)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_to_hold(self, num_tokens: int, max_chunk: int, block_size: int) -> int:
        """The most block ids one request of ``num_tokens`` tokens holds at once in steps of
        at most ``max_chunk`` tokens, over every group."""
        every = -(-num_tokens // block_size)
        return sum(
            every if w is None else min(every, window_live_blocks(w, max_chunk, block_size))
            for w in self.windows
        )

    def capacity_tokens(self, num_blocks: int, max_chunk: int, block_size: int) -> int:
        """The longest request ``num_blocks`` ids hold (in steps of ``max_chunk`` tokens)."""
        lo, hi = 0, num_blocks * block_size
        while lo < hi:  # blocks_to_hold grows with num_tokens
            mid = (lo + hi + 1) // 2
            if self.blocks_to_hold(mid, max_chunk, block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_groups(config: ModelConfig) -> KVGroups | None:
    """The layer groups of a model mixing windowed and full-attention layers; None where
    every layer reads one table (no window, or the same window on every layer)."""
    if config.sliding_window is None or config.uniform_window is not None:
        return None
    layers = range(config.num_hidden_layers)
    full = [i for i in layers if config.layer_window(i) is None]
    windowed = [i for i in layers if config.layer_window(i) is not None]
    size = min(len(full), len(windowed))
    num_full_groups = -(-len(full) // size)
    group, slot = [0] * len(layers), [0] * len(layers)
    for first, kind in ((0, full), (num_full_groups, windowed)):
        for k, i in enumerate(kind):
            group[i], slot[i] = first + k // size, k % size
    windows = (None,) * num_full_groups + (config.sliding_window,) * -(-len(windowed) // size)
    return KVGroups(size, tuple(group), tuple(slot), windows)

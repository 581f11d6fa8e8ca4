"""HybridKVCacheManager: two block pools for a model whose layers mix full attention with one
sliding window (Gemma 3: five local layers of window 512 to each global one). vLLM's hybrid
KV-cache manager in the simplest form that serves such a model: one pool per layer group.

- The full-attention layers' K/V live in one pool (this manager: a KVCacheManager without a
  window) and the windowed layers' in a second (``self.window``: a KVCacheManager with the
  window), each layer reading its group's block table (``ScheduledRequest.window_block_ids``;
  layers/attention.py ``AttentionMetadata.windowed``).
- A request's windowed-layer blocks wholly left of its next query's window are released as it
  moves on, as for a model windowed everywhere; its full-attention blocks stay. So a long
  request holds its whole context in the full pool but only ~one window in the window pool,
  which the worker sizes for ``max_num_seqs`` such requests (worker/kv_cache.py
  ``pool_sizes``): the memory the windowed layers would spend on the rest of every context
  goes to the full pool, i.e. to longer contexts and more requests.
- Both pools see the same tokens and hash them alike. A prefix hit is the shorter of the two
  pools' runs (the window pool's may pass over blocks evicted left of the window: ``GONE``).
- An allocation takes blocks from both pools or from neither. Stats, the live view and the
  scheduler's "can it ever fit" check read the full pool: a request never holds more blocks
  in the window pool than in the full one, and the window pool is never the smaller of the
  two below what one request can hold (``pool_sizes``).
"""

from __future__ import annotations

from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.request import Request


class HybridKVCacheManager(KVCacheManager):
    """The full-attention layers' pool (``num_blocks``), with the windowed layers' own pool
    (``num_window_blocks``, window ``window``) alongside as ``self.window``."""

    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int,
                 window: int, enable_prefix_caching: bool = True):  # fmt: skip
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = KVCacheManager(num_window_blocks, block_size, enable_prefix_caching,
                                     sliding_window=window)  # fmt: skip

    def get_computed_blocks(
        self, request: Request, max_blocks: int | None = None
    ) -> tuple[list[tuple[int, int]], int]:
        """The hit both pools hold: (full block id, window block id) pairs, and its tokens."""
        full, _ = super().get_computed_blocks(request, max_blocks)
        windowed, _ = self.window.get_computed_blocks(request, len(full))
        return list(zip(full, windowed, strict=False)), len(windowed) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[tuple[int, int]] | None = None,
    ) -> list[int] | None:
        """Both pools' tables cover the tokens, or neither changes (but for the window pool's
        release of blocks left of the window). Returns the full-attention layers' table; the
        windowed layers' is ``window_block_ids``."""
        full = [f for f, _ in computed_blocks or ()]
        windowed = [w for _, w in computed_blocks or ()]
        if self.window.blocks_short(request, num_new_tokens, windowed) > 0:
            return None
        if self.blocks_short(request, num_new_tokens, full) > 0:
            return None
        self.window.allocate_slots(request, num_new_tokens, windowed)
        return super().allocate_slots(request, num_new_tokens, full)

    def window_block_ids(self, request_id: str) -> list[int] | None:
        return self.window.get_block_ids(request_id)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.window.free(request_id)

    def trim(self, request: Request) -> None:
        super().trim(request)
        self.window.trim(request)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.window.reset_prefix_cache()

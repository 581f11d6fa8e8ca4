"""KVCacheManager: the paged KV cache's bookkeeping (block ids, ref counts, prefix hashes).

Plain Python, no torch: the K/V tensors live in the worker; this module only decides which
block ids a request's tokens go to, in the one table every layer reads (a hybrid model: one
manager per layer group over a shared pool, engine/hybrid_kv_cache_manager.py).

Ownership:
- A request holds one reference on every block of its block table, from ``allocate_slots``
  until ``free(request_id)`` (called by the scheduler on finish, abort and preemption).
- A block whose ref count drops to 0 goes to the tail of the free queue. If it is full and
  hashed it stays in the prefix cache (lazy eviction) until it is taken from the head of the
  free queue for new use; a prefix-cache hit before then takes it back out of the queue.
- A block is written only by its sole owner: the partly filled tail block is never hashed, so
  only full blocks are ever shared, and full blocks are never written again.
- With a sliding window on every layer (``sliding_window``), a request's blocks wholly left
  of its next query's window are released as it moves on (``allocate_slots``, before it
  takes the step's blocks and after registering them): no later query of the request reads
  them (layers/attention.py). Their ids stay in its block table, dead, so positions still
  index it; the kernels and masks never read a dead slot's values into an output. Prefix
  hits left of the first new query's window enter the table dead, never taken, and may be
  blocks evicted since (``GONE``: their identities are kept as ghosts, so the hit is still
  exact). So a request holds at most ``config.window_live_blocks`` at once, however long it
  runs: it may outgrow the pool.
- Hashes are registered when ``allocate_slots`` makes a block full of the request's tokens,
  before the step that writes its K/V: a request in the same step may hit it. So the runner
  writes a step's K/V before attention reads (per layer) and runs every request of a
  SchedulerOutput; if a step fails, call ``reset_prefix_cache()``. Blocks that accepted
  drafts filled are hashed at the next allocation, or when the request leaves
  (``cache_computed``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from tinyserve.config import window_live_blocks
from tinyserve.engine.kv_cache_utils import (
    HashChain,
    KVCacheBlock,
    block_ident,
    clear_hash,
    hash_block_tokens,
    pool_map,
    root_hash,
)
from tinyserve.request import Request

GONE = -1  # a prefix hit whose block was evicted (windowed models; get_computed_blocks)
GHOSTS_PER_BLOCK = 4  # evicted identities kept, per block of the pool (~100 bytes each)


class KVCacheManager:
    """A fixed pool of ``num_blocks`` blocks, a free queue in LRU order and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, share: KVCacheManager | None = None,
                 group: int = 0):  # fmt: skip
        window = 1 if sliding_window is None else sliding_window
        for name, n in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("sliding_window", window)):  # fmt: skip
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        self.sliding_window = sliding_window  # its layers' (None: some layer sees all)
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_outputs = True  # False: only prompt tokens' blocks are shared (core.py)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._req_to_chain: dict[str, HashChain] = {}
        self._num_dead: dict[str, int] = {}  # leading table entries released (left of window)
        # A hybrid model's other layer groups share the first's pool (blocks, free queue,
        # prefix cache, ghosts); their hashes start from ``group``, so no hit crosses groups.
        self.group = group
        if share is None:
            self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
            # Head = least recently freed = next reused. OrderedDict: O(1) removal of a hit.
            self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
            self.cached_block_hash_to_block: dict[int, int] = {}
            self._content_ids = itertools.count()
            # With a window: evicted hashed blocks' identities (tokens, content id, parent's),
            # so a hit may pass over them left of its window and stay exact.
            self._ghosts: OrderedDict[int, tuple] = OrderedDict()
            self.keep_ghosts = sliding_window is not None
        else:
            for name in ("blocks", "_free_queue", "cached_block_hash_to_block", "_ghosts",
                         "_content_ids", "keep_ghosts"):  # fmt: skip
                setattr(self, name, getattr(share, name))
        # vLLM's prefix-cache metrics: tokens looked up / tokens found; and the same in blocks.
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.prefix_cache_block_queries = self.prefix_cache_block_hits = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue; cached blocks nobody references count as free."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def free_block_ids(self) -> list[int]:
        """The free queue, head (next reused) first."""
        return list(self._free_queue)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (its first ``num_dead_blocks`` entries released)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def num_dead_blocks(self, request_id: str) -> int:
        """Leading entries of the request's table released as left of its window."""
        return self._num_dead.get(request_id, 0)

    def blocks_to_hold(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, computed in
        steps of at most ``max_chunk`` tokens: all of them, or with a window on every layer
        the window's and a step's."""
        every = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return every
        return min(every, window_live_blocks(self.sliding_window, max_chunk, self.block_size))

    def pool_map(self) -> str:
        return pool_map(self)

    @property
    def groups(self) -> list[KVCacheManager]:
        return [self]  # the managers sharing this pool (hybrid_kv_cache_manager.py: more)

    # -- prefix cache ------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_blocks: int | None = None
    ) -> tuple[list[int], int]:
        """Longest run (of at most ``max_blocks``) of cached full blocks matching
        ``request.all_token_ids`` from the start: (block ids, number of tokens they hold).

        Never covers the last token, so the request always computes at least one token and
        has logits to sample from. Takes no references: pass the blocks to ``allocate_slots``
        in the same step. Counts nothing: the scheduler calls ``record_prefix_lookup`` once
        the request is admitted (a request waiting at the head of the queue is counted once).
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        bs = self.block_size
        whole = (len(tokens) - 1) // bs
        max_blocks = whole if max_blocks is None else min(whole, max_blocks)
        hits: list[int] = []
        parent_hash = root_hash(request, self.group)
        parent_content_id: int | None = None
        for i in range(max_blocks):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, block_tokens)
            block_id = self.cached_block_hash_to_block.get(block_hash, GONE)
            ident = (
                self._ghosts.get(block_hash)
                if block_id == GONE
                else block_ident(self.blocks[block_id])
            )
            if ident is None or ident[0] != block_tokens or ident[2] != parent_content_id:
                break  # a miss (or a hash collision)
            hits.append(block_id)
            parent_hash, parent_content_id = block_hash, ident[1]
        n = len(hits)  # evicted blocks (GONE) may stand only left of the first query's window
        while GONE in hits[self._left_of(n * bs) : n]:
            n = max(i for i in range(n) if hits[i] == GONE)
        return hits[:n], n * bs

    def record_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Count one admitted request's prefix-cache lookup (vLLM's queries / hits, in tokens,
        and the same in blocks)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = len(request.all_token_ids)
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_blocks * self.block_size
        self.prefix_cache_block_queries += (num_tokens - 1) // self.block_size
        self.prefix_cache_block_hits += num_hit_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use stay with their requests; those requests
        register no further blocks (their chains would hang off forgotten parents)."""
        for block in self.blocks:
            clear_hash(block)
        self.cached_block_hash_to_block.clear()
        self._ghosts.clear()
        for chain in (c for group in self.groups for c in group._req_to_chain.values()):
            chain.cacheable = False

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make the request's block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` (prefix hits from ``get_computed_blocks``, only for a request with
        no blocks yet) become the start of its table; the caller has already counted them in
        ``request.num_computed_tokens``. Returns the whole block table, or None when the free
        queue cannot supply the blocks (``blocks_needed``), changing nothing but releasing
        the blocks already left of the window (which no later query reads).
        """
        if self.blocks_needed(request, num_new_tokens, computed_blocks) > self.num_free_blocks:
            return None
        self.enter_hits(request, computed_blocks or [])
        return self.extend(request, num_new_tokens)

    def blocks_needed(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> int:
        """The blocks ``allocate_slots`` with these arguments takes from the free queue (new
        ones and free cached hits), once the blocks left of the window are released (the
        only change made here)."""
        computed_blocks = computed_blocks or []
        table = self.req_to_blocks.get(request.request_id)
        if computed_blocks and table:
            raise ValueError(f"request {request.request_id!r} already has blocks; hits are "
                             "for new ones")  # fmt: skip
        if table and self.sliding_window is not None:  # registered first: a block released
            # here may be taken again in allocate_slots
            self._register(request, table, request.num_computed_tokens)
            self._release_left_of_window(request, table)
        num_held = len(table or ()) + len(computed_blocks)
        num_required = request.num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, -(-num_required // self.block_size) - num_held)
        num_dead_hits = min(self._left_of(request.num_computed_tokens), len(computed_blocks))
        # A free cached hit leaves the free queue too.
        num_free_hits = sum(
            1 for b in computed_blocks[num_dead_hits:] if self.blocks[b].ref_count == 0
        )
        return num_new_blocks + num_free_hits

    def enter_hits(self, request: Request, computed_blocks: list[int]) -> None:
        """Start a new request's table with its prefix hits (taken out of the free queue
        before any new block is: a free hit must not be reused first). Hits left of the first
        new query's window are entered dead, never taken."""
        request_id = request.request_id
        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = []
            self._req_to_chain[request_id] = HashChain()
        table, chain = self.req_to_blocks[request_id], self._req_to_chain[request_id]
        num_dead_hits = min(self._left_of(request.num_computed_tokens), len(computed_blocks))
        for i, block_id in enumerate(computed_blocks):
            if block_id == GONE:  # left of the window, evicted: any id stands in (dead)
                self._enter_gone(request, table, chain)
                continue
            block = self.blocks[block_id]
            if i >= num_dead_hits:
                if block.ref_count == 0:
                    del self._free_queue[block_id]
                block.ref_count += 1
            table.append(block_id)
            chain.hashes.append(block.block_hash)
            chain.content_ids.append(block.content_id)
        if num_dead_hits:
            self._num_dead[request_id] = num_dead_hits

    def extend(self, request: Request, num_new_tokens: int) -> list[int]:
        """New blocks to cover the step's tokens (enough are free: ``blocks_needed``), the
        full ones registered, those left of the window released. Returns the table."""
        table = self.req_to_blocks[request.request_id]
        num_required = request.num_computed_tokens + num_new_tokens
        for _ in range(max(0, -(-num_required // self.block_size) - len(table))):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            table.append(block_id)
        self._register(request, table, num_required)
        self._release_left_of_window(request, table)
        return list(table)

    def cache_computed(self, request: Request) -> None:
        """Hash the full blocks of a leaving request's computed tokens (its last step's
        accepted drafts, never hashed else: a conversation's next turn repeats them)."""
        if (table := self.req_to_blocks.get(request.request_id)) is not None:
            self._register(request, table, request.num_computed_tokens)

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        return None  # a hybrid model's other layer groups' tables; here every layer reads one

    def free(self, request_id: str) -> None:
        """Drop the request's references. Tail first, so a prefix's tail is evicted before
        its head (the head is the part other requests are likeliest to share). Idempotent."""
        table = self.req_to_blocks.pop(request_id, None)
        self._req_to_chain.pop(request_id, None)
        num_dead = self._num_dead.pop(request_id, 0)
        for block_id in reversed((table or [])[num_dead:]):
            self._release(block_id)

    def trim(self, request: Request) -> None:
        """Give back the blocks wholly past ``request.num_tokens`` (slots taken for
        speculative drafts that were rejected). They were never hashed: ``allocate_slots``
        registers only blocks full of the request's own tokens, never of drafts."""
        table = self.req_to_blocks.get(request.request_id)
        if not table:
            return
        keep = -(-request.num_tokens // self.block_size)
        while len(table) > keep:
            self._release(table.pop())

    # -- internals ---------------------------------------------------------------------------

    def _release_left_of_window(self, request: Request, table: list[int]) -> None:
        """Release the blocks wholly left of the window of the request's next query (at
        ``num_computed_tokens``: later queries' windows start later still). Speculation only
        moves num_computed_tokens back over this step's rejected drafts, never below."""
        dead = min(self._left_of(request.num_computed_tokens), len(table))
        rid = request.request_id
        for i in range(self._num_dead.get(rid, 0), dead):
            self._release(table[i])
            self._num_dead[rid] = i + 1

    def _register(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Hash its full blocks within ``num_tokens`` (without ``cache_outputs``: prompt ones)."""
        if self.enable_prefix_caching:
            mine = request.num_tokens if self.cache_outputs else request.num_prompt_tokens
            chain = self._req_to_chain[request.request_id]
            num_full = min(num_tokens, mine) // self.block_size
            self._register_full_blocks(request, table, chain, num_full)

    def _left_of(self, position: int) -> int:
        """Blocks wholly left of the window of a query at ``position`` (0: no window)."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def _enter_gone(self, request: Request, table: list[int], chain: HashChain) -> None:
        """An evicted hit, dead in the table (block 0 stands in: a dead entry's values are
        weighted 0), its identity from its ghost (none left: the request registers no more)."""
        i, bs = len(table), self.block_size
        parent_hash = chain.hashes[-1] if chain.hashes else root_hash(request, self.group)
        tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
        ghost = self._ghosts.get(block_hash := hash_block_tokens(parent_hash, tokens))
        chain.cacheable = chain.cacheable and ghost is not None
        table.append(0)
        chain.hashes.append(block_hash)
        chain.content_ids.append(ghost[1] if ghost else None)

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds joins the free queue's tail."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_queue[block_id] = None

    def _register_full_blocks(
        self, request: Request, table: list[int], chain: HashChain, num_full: int
    ) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(chain.hashes), num_full):
            if not chain.cacheable:
                return
            parent_hash = chain.hashes[-1] if chain.hashes else root_hash(request, self.group)
            parent_content_id = chain.content_ids[-1] if chain.content_ids else None
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, block_tokens)
            block = self.blocks[table[i]]
            cached_id = self.cached_block_hash_to_block.get(block_hash)
            if cached_id is None:
                ghost = self._ghosts.pop(block_hash, None)  # the same content: its id again
                same = ghost and ghost[0] == block_tokens and ghost[2] == parent_content_id
                block.block_hash = block_hash
                block.token_ids = block_tokens
                block.content_id = ghost[1] if same else next(self._content_ids)
                block.parent_content_id = parent_content_id
                self.cached_block_hash_to_block[block_hash] = block.block_id
                content_id = block.content_id
            else:
                cached = self.blocks[cached_id]
                same = (
                    cached.token_ids == block_tokens
                    and cached.parent_content_id == parent_content_id
                )
                if not same:
                    chain.cacheable = False  # collision: keep the incumbent, stop here
                    return
                # The same content computed twice (or this block is the hit itself): children
                # chain off the cached copy, whose K/V equal ours.
                content_id = cached.content_id
            chain.hashes.append(block_hash)
            chain.content_ids.append(content_id)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) == block.block_id:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.keep_ghosts and self.enable_prefix_caching:
                    self._ghosts[block.block_hash] = block_ident(block)
                    if len(self._ghosts) > GHOSTS_PER_BLOCK * self.num_total_blocks:
                        self._ghosts.popitem(last=False)  # the oldest
        clear_hash(block)

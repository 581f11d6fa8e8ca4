"""The paged KV cache's block records and prefix hashing (vLLM's kv_cache_utils): plain
Python, shared by engine/kv_cache_manager.py and engine/hybrid_kv_cache_manager.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: a block's hash depends on every token before it. Stable (int and
    tuple hashes ignore PYTHONHASHSEED); lookups compare the tokens and parent (KVCacheBlock)."""
    return hash((parent_hash, token_ids))


@dataclass
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K/V tensors (a hybrid model's:
    a page of one layer group's, utils/kv_groups.py)."""

    block_id: int
    ref_count: int = 0
    # Set while the block is in the prefix cache (full, hashed), cleared on eviction.
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # Never-reused identity of the cached content and of its parent block's content: with the
    # token ids, this makes a hit exact even if the hash chain collides.
    content_id: int | None = None
    parent_content_id: int | None = None


@dataclass
class HashChain:
    """A request's registered full blocks: (hash, content id) of the cached copy of each."""

    hashes: list[int] = field(default_factory=list)
    content_ids: list[int] = field(default_factory=list)
    # False after a hash collision (or a cache reset): later blocks are not registered.
    cacheable: bool = True


def block_ident(block: KVCacheBlock) -> tuple:
    return (block.token_ids, block.content_id, block.parent_content_id)


def root_hash(request: Request, group: int = 0) -> int | None:
    """The parent of a request's first block: its ``cache_salt``, so that requests with
    different salts never share a block (vLLM's isolation of the prefix cache), and the
    layer group whose pool it is in (a hybrid model's groups share one pool)."""
    salt = request.sampling_params.cache_salt
    root = None if salt is None else hash(("cache_salt", salt))
    return root if group == 0 else hash(("kv_group", group, root))


def clear_hash(block: KVCacheBlock) -> None:
    block.block_hash = None
    block.token_ids = None
    block.content_id = None
    block.parent_content_id = None


def pool_map(kv) -> str:
    """One character per block (the live engine view): '.' free and empty, 'c' free but
    holding a cached prefix block (reusable), 'u' held by one request, 's' held by more
    than one (a shared prefix). Costs O(held + cached blocks), not O(pool)."""
    chars = bytearray(b"." * kv.num_total_blocks)
    for block_id in kv.cached_block_hash_to_block.values():
        chars[block_id] = 99  # 'c'; a cached block someone holds is overwritten below
    for group in kv.groups:  # (a hybrid model's layer groups share the pool)
        for request_id, table in group.req_to_blocks.items():
            for block_id in table[group.num_dead_blocks(request_id) :]:
                chars[block_id] = 115 if kv.blocks[block_id].ref_count > 1 else 117
    return chars.decode("ascii")  # ('s' / 'u')

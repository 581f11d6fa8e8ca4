"""Sizing and allocation of the paged KV cache (the tensors; block bookkeeping lives in
engine/kv_cache_manager.py)."""

from __future__ import annotations

import math
import mmap

import torch

from tinyserve.config import KV_CACHE_DTYPES, CacheConfig, ModelConfig, window_live_blocks

KVCache = tuple[torch.Tensor, torch.Tensor]


def resolve_kv_cache_dtype(name: str, model) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the model's dtype, or bfloat16 where attention runs on AMX
    tiles (kernels/attention_amx.h rounds K and V to bf16 as it loads them, so a bf16 cache
    gives the same outputs from half the bytes: a decode step's attention 1.3-1.4x faster at
    8-32 rows); "bfloat16" needs either a bf16 model or the CPU kernels' attention
    (kernels/attention.c reads a bf16 cache; the torch path attends in the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    if name == "auto" and attention_tiles(model):
        return torch.bfloat16
    if name == "float32" and model.dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype='float32' needs a float32 model, not {model.dtype}")
    if name in ("auto", "float32") or model.dtype == torch.bfloat16:
        return model.dtype
    if not model.attention_method.block_table_inputs:
        raise ValueError(
            "kv_cache_dtype='bfloat16' with a float32 model needs the CPU kernels' attention "
            "(a CPU with AVX2/FMA and cpu_kernels on); here attention runs in torch, in "
            f"{model.dtype}: use dtype='bfloat16' for a bf16 cache"
        )
    return torch.bfloat16


def attention_tiles(model) -> bool:
    """Whether the model's attention runs on AMX tiles (the loader's attention method)."""
    return bool(getattr(getattr(model, "attention_method", None), "tiles", False))


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """K and V of one block across all layers, on one rank (which holds 1/tp_size of the
    KV heads)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = config.num_key_value_heads // tp_size
    per_layer = block_size * heads * config.head_dim * itemsize
    return 2 * config.num_hidden_layers * per_layer


def num_blocks_for(
    config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """The block count: given directly, or as many as fit the memory budget (per rank)."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    per_block = bytes_per_block(config, cache_config.block_size, dtype, tp_size)
    num_blocks = cache_config.kv_cache_memory // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv cache memory budget of {cache_config.kv_cache_memory} bytes holds no block "
            f"({per_block} bytes per block of {cache_config.block_size} tokens): raise --kv-cache-memory"
        )
    return int(num_blocks)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp_size: int = 1,
    num_window_blocks: int | None = None,
) -> list[KVCache]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads / tp_size,
    head_dim] — or, given ``num_window_blocks`` (a hybrid model's window pool,
    :func:`pool_sizes`), that many blocks in its windowed layers. Zero-filled so a stale read
    can never be NaN (on a CPU: fresh zero pages, each touched once).

    On a CPU every tensor is a view of one buffer asked for in huge pages before it is
    touched (:func:`advise_huge_pages`): a decode row reads a few cache lines per key from
    blocks that a long-running pool scatters, and with 4 KiB pages nearly every page it
    reads misses the TLB. Measured on 2 Zen 4 cores (benchmarks/README.md): attention alone
    over randomly placed blocks, 32 rows x 600 tokens, 100 -> 66 ms; whole engine steps on
    a shuffled pool 1.02-1.09x at 8-32 running, none on a fresh pool (blocks in order)."""
    block = (block_size, config.num_key_value_heads // tp_size, config.head_dim)
    counts = [num_blocks] * config.num_hidden_layers
    if num_window_blocks is not None:
        counts = [num_blocks if config.layer_window(i) is None else num_window_blocks
                  for i in range(config.num_hidden_layers)]  # fmt: skip
    if torch.device(device).type != "cpu":
        return [
            (torch.zeros((n, *block), dtype=dtype, device=device),
             torch.zeros((n, *block), dtype=dtype, device=device))
            for n in counts
        ]  # fmt: skip
    buf = _zero_pages(2 * sum(counts) * math.prod(block), dtype)
    out, offset = [], 0
    for n in counts:
        size = n * math.prod(block)
        k, v = buf[offset : offset + 2 * size].view(2, n, *block)
        out.append((k, v))
        offset += 2 * size
    return out


def hybrid_window(config: ModelConfig) -> int | None:
    """The windowed layers' window where the other layers attend to everything (Gemma 3's
    local layers): such a model's two layer groups get their own block pools
    (engine/hybrid_kv_cache_manager.py). None: every layer reads one table."""
    return config.sliding_window if config.uniform_window is None else None


def pool_sizes(
    config: ModelConfig,
    cache_config: CacheConfig,
    dtype: torch.dtype,
    tp_size: int,
    max_num_seqs: int,
    max_chunk: int,
) -> tuple[int, int | None]:
    """(blocks of the full-attention layers' pool, blocks of the windowed layers' pool or
    None where the model is not hybrid).

    The window pool holds what ``max_num_seqs`` requests hold there at most (each at most
    config.window_live_blocks in steps of ``max_chunk`` tokens), never more blocks than the
    full pool; the rest of the memory budget goes to the full pool. With ``num_blocks`` given
    it is the full pool's size."""
    window = hybrid_window(config)
    if window is None:
        return num_blocks_for(config, cache_config, dtype, tp_size), None
    plain = num_blocks_for(config, cache_config, dtype, tp_size)  # every layer in one pool
    need = max_num_seqs * window_live_blocks(window, max_chunk, cache_config.block_size)
    if cache_config.num_blocks is not None or need >= plain:
        return plain, min(plain, need)
    layers = config.num_hidden_layers
    windowed = sum(config.layer_window(i) is not None for i in range(layers))
    per_layer = bytes_per_block(config, cache_config.block_size, dtype, tp_size) // layers
    full = (cache_config.kv_cache_memory - need * windowed * per_layer) // (
        (layers - windowed) * per_layer
    )
    return int(full), need


def kv_cache_bytes(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int,
    num_blocks: int, num_window_blocks: int | None,
) -> int:  # fmt: skip
    """The bytes of the pools (:func:`pool_sizes`) on one rank."""
    per_layer = bytes_per_block(config, block_size, dtype, tp_size) // config.num_hidden_layers
    if num_window_blocks is None:
        return num_blocks * per_layer * config.num_hidden_layers
    windowed = sum(config.layer_window(i) is not None for i in range(config.num_hidden_layers))
    full = config.num_hidden_layers - windowed
    return (num_blocks * full + num_window_blocks * windowed) * per_layer


def _zero_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor over a fresh anonymous mapping: zeros by POSIX, the kernel zeroing each
    page as it is faulted in. Every page is then touched once (one element a page) after the
    huge-page advice, so the whole cache is resident from the start, as before: memory runs
    out at start-up, not mid-serving, and RSS stays flat while it fills. 1 GiB: ~0.5 s on 2
    Zen 3 cores, where ``torch.empty`` + ``advise`` + ``zero_()`` took 1.5-2 s alone and
    ~3 s of a 13 s server start (py-spy). The tensor holds the mapping."""
    item = dtype.itemsize
    flat = torch.frombuffer(mmap.mmap(-1, max(numel * item, 1)), dtype=dtype, count=numel)
    advise_huge_pages(flat)
    flat[:: max(1, mmap.PAGESIZE // item)].zero_()
    return flat


_MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of ``t``'s memory (Linux, where
    transparent huge pages are "madvise" or "always"; ``$TINYSERVE_HUGE_PAGES=0`` skips it).
    Call before the memory is first touched. Returns whether the kernel took the advice."""
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux") or os.environ.get("TINYSERVE_HUGE_PAGES") == "0":
        return False
    start = t.data_ptr()
    lo = (start + (1 << 21) - 1) & ~((1 << 21) - 1)
    hi = (start + t.numel() * t.element_size()) & ~((1 << 21) - 1)
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False

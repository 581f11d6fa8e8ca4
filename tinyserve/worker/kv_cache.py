"""Sizing and allocation of the paged KV cache (the tensors; block bookkeeping lives in
engine/kv_cache_manager.py)."""

from __future__ import annotations

import math
import mmap

import torch

from tinyserve.config import KV_CACHE_DTYPES, CacheConfig, ModelConfig
from tinyserve.utils.kv_groups import KVGroups, kv_groups

KVCache = tuple[torch.Tensor, torch.Tensor]


def resolve_kv_cache_dtype(name: str, model) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the model's dtype, or bfloat16 where attention computes bf16
    products (AMX tiles, kernels/attention_amx.h, or AVX-512 BF16 dot products,
    attention_dp.h: both round K and V to bf16 as they load them, so a bf16 cache gives the
    same outputs from half the bytes: a decode step's attention 1.3-1.4x faster at 8-32 rows
    on AMX) or the kernels hold the weights in bf16 (``bf16_weights``); "bfloat16" needs
    either a bf16 model or the CPU kernels' attention (kernels/attention.c reads a bf16
    cache; the torch path attends in the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    if name == "auto" and (attention_tiles(model) or bf16_weights(model)):
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


def bf16_weights(model) -> bool:
    """The kernels hold the model's weights in bf16 (``--quantization bf16``, or ``--dtype
    auto`` on a bf16 checkpoint): "auto" then caches K and V in bf16 too, as torch's bf16
    path did (the kernels' attention reads them; twice the tokens of a float32 cache)."""
    from tinyserve.kernels.gemm import BF16

    kernel = getattr(getattr(model, "lm_head_module", None), "method", None)
    return getattr(getattr(kernel, "kernel", None), "kind", None) == BF16 and bool(
        model.attention_method.block_table_inputs
    )


def attention_tiles(model) -> bool:
    """Whether the model's attention computes bf16 products (AMX tiles or AVX-512 BF16 dot
    products; the loader's attention method)."""
    return bool(getattr(getattr(model, "attention_method", None), "tiles", False))


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """K and V of one block id on one rank (which holds 1/tp_size of the KV heads): across
    all layers, or a hybrid model's page of one layer group (utils/kv_groups.py)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = config.num_key_value_heads // tp_size
    per_layer = block_size * heads * config.head_dim * itemsize
    groups = kv_groups(config)
    return 2 * (config.num_hidden_layers if groups is None else groups.size) * per_layer


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
    groups: KVGroups | None = None,
) -> list[KVCache]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads / tp_size,
    head_dim]. With a hybrid model's ``groups`` (utils/kv_groups.py) the cache holds
    ``groups.size`` pairs (slots), each shared by one layer of every group: layer l's is
    slot ``groups.layer_slot[l]``'s. Zero-filled so a stale read can never be NaN (on a CPU:
    fresh zero pages, each touched once).

    On a CPU every tensor is a view of one buffer asked for in huge pages before it is
    touched (:func:`advise_huge_pages`): a decode row reads a few cache lines per key from
    blocks that a long-running pool scatters, and with 4 KiB pages nearly every page it
    reads misses the TLB. Measured on 2 Zen 4 cores (benchmarks/README.md): attention alone
    over randomly placed blocks, 32 rows x 600 tokens, 100 -> 66 ms; whole engine steps on
    a shuffled pool 1.02-1.09x at 8-32 running, none on a fresh pool (blocks in order)."""
    shape = (num_blocks, block_size, config.num_key_value_heads // tp_size, config.head_dim)
    layers = config.num_hidden_layers
    slots = layers if groups is None else groups.size
    if torch.device(device).type != "cpu":
        pairs = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(slots)
        ]  # fmt: skip
    else:
        buf = _zero_pages(slots * 2 * math.prod(shape), dtype).view(slots, 2, *shape)
        pairs = [(buf[i, 0], buf[i, 1]) for i in range(slots)]
    return pairs if groups is None else [pairs[groups.layer_slot[i]] for i in range(layers)]


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

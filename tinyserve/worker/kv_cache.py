"""Sizing and allocation of the paged KV cache (the tensors; block bookkeeping lives in
engine/kv_cache_manager.py)."""

from __future__ import annotations

import torch

from tinyserve.config import KV_CACHE_DTYPES, CacheConfig, ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def resolve_kv_cache_dtype(name: str, model) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the model's dtype; "bfloat16" needs either a bf16 model or
    the CPU kernels' attention (kernels/attention.c reads a bf16 cache; the torch path
    attends in the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    if name == "auto" or model.dtype == torch.bfloat16:
        return model.dtype
    if model.attention_backend != "kernel":
        raise ValueError(
            "kv_cache_dtype='bfloat16' with a float32 model needs the CPU kernels' attention "
            "(a CPU with AVX2/FMA and cpu_kernels on); here attention runs in torch, in "
            f"{model.dtype}: use dtype='bfloat16' for a bf16 cache"
        )
    return torch.bfloat16


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
) -> list[KVCache]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads / tp_size,
    head_dim]. Zero-filled so a stale read can never be NaN."""
    shape = (num_blocks, block_size, config.num_key_value_heads // tp_size, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]

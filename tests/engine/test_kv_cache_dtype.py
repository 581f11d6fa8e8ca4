"""--kv-cache-dtype: "bfloat16" gives a float32 model on the CPU kernels a bf16 KV cache —
twice the blocks for the same memory, batch-invariant like the float32 cache, and greedy
answers equal to it here; what cannot be served is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import build_engine, random_prompt, run_alone, run_batch, tiny_engine
from tinyserve.kernels import attention as attention_kernel
from tinyserve.sampling_params import SamplingParams

needs_kernels = pytest.mark.skipif(
    attention_kernel.library() is None, reason="needs an x86 CPU with AVX2/FMA and cc"
)


@needs_kernels
def test_a_bf16_cache_holds_twice_the_blocks_and_stays_batch_invariant(tiny_qwen2_path):
    f32 = tiny_engine(tiny_qwen2_path, num_blocks=None, kv_cache_memory="2MiB")
    b16 = tiny_engine(tiny_qwen2_path, num_blocks=None, kv_cache_memory="2MiB",
                      kv_cache_dtype="bfloat16")  # fmt: skip
    assert f32.executor.kv_dtype == torch.float32 and b16.executor.kv_dtype == torch.bfloat16
    assert b16.executor.num_blocks == 2 * f32.executor.num_blocks
    assert b16.executor.runner.kv_caches[0][0].dtype == torch.bfloat16
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [(str(i), random_prompt(5 + 7 * i, seed=i), params) for i in range(6)]
    batched, alone = run_batch(b16, reqs), run_alone(b16, reqs)
    for rid, _, _ in reqs:
        assert batched[rid].token_ids == alone[rid].token_ids, rid
    assert b16.core.scheduler.kv_cache_manager.num_free_blocks == b16.executor.num_blocks


@needs_kernels
def test_greedy_with_a_bf16_cache_follows_the_float32_one(smol_path):
    """SmolLM2 (whose logits the bf16 rounding of K and V moves by ~1e-2): the same greedy
    tokens as the float32 cache for most of each answer, measured not assumed — a broken
    cache (wrong layout, unrounded garbage) diverges at the first token."""
    prompts = [random_prompt(24, seed=s, vocab=49152) for s in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = [(str(i), p, params) for i, p in enumerate(prompts)]
    out = {}
    for dtype in ("float32", "bfloat16"):
        eng = build_engine(
            model=smol_path, num_blocks=64, load_tokenizer=False, kv_cache_dtype=dtype
        )
        out[dtype] = run_batch(eng, reqs)
    same = 0
    for rid, _, _ in reqs:
        a, b = out["float32"][rid].token_ids, out["bfloat16"][rid].token_ids
        assert a[0] == b[0], rid
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert same >= 0.75 * 16 * len(reqs), same


@needs_kernels
def test_auto_is_a_bf16_cache_exactly_where_attention_computes_bf16_products(smol_path):
    """Where attention computes bf16 products (AMX tiles, or AVX-512 BF16 dot products) it
    rounds K and V to bf16 as it loads them: "auto" stores them so (half the bytes), and a
    float32 cache gives the very same tokens; elsewhere "auto" is float32."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [(str(i), random_prompt(30, seed=i, vocab=49152), params) for i in range(3)]
    auto = build_engine(model=smol_path, num_blocks=64, load_tokenizer=False)
    tiles = attention_kernel.uses_bf16_products(64) and auto.executor.model.attention_method.tiles
    assert auto.executor.kv_dtype == (torch.bfloat16 if tiles else torch.float32)
    if tiles:
        f32 = build_engine(model=smol_path, num_blocks=64, load_tokenizer=False,
                           kv_cache_dtype="float32")  # fmt: skip
        assert f32.executor.kv_dtype == torch.float32
        a, b = run_batch(auto, reqs), run_batch(f32, reqs)
        assert all(a[r].token_ids == b[r].token_ids for r, _, _ in reqs)


def test_what_cannot_be_served_is_refused_by_name(tiny_qwen2_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        tiny_engine(tiny_qwen2_path, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16'.*CPU kernels"):
        tiny_engine(tiny_qwen2_path, kv_cache_dtype="bfloat16", cpu_kernels=False)
    # A bf16 model's cache is bf16 already: the flag asks for nothing new.
    eng = tiny_engine(tiny_qwen2_path, dtype="bfloat16", cpu_kernels=False,
                      kv_cache_dtype="bfloat16")  # fmt: skip
    assert eng.executor.kv_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' needs a float32 model"):
        tiny_engine(tiny_qwen2_path, dtype="bfloat16", cpu_kernels=False,
                    kv_cache_dtype="float32")  # fmt: skip


def test_the_cli_flag_reaches_the_engine_args():
    import argparse

    from tinyserve.engine.arg_utils import EngineArgs, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-cache-dtype", "bfloat16"])
    assert EngineArgs.from_namespace(ns).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "float16"])

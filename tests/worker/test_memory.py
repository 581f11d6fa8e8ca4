"""KV-cache sizing: a fixed budget on a CPU, free-memory sizing on CUDA (the arithmetic and
the profiling run here; the real card in scripts/gpu_check.sh)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf
from tinyserve.worker import memory
from tinyserve.worker.executor import Executor

GiB = 2**30


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_hf(build_hf(llama_config()), tmp_path_factory.mktemp("llama"))


def test_budget_is_utilization_less_peak_less_others():
    # 100 GiB card, torch reserved 12 GiB and 3 GiB are held by someone else (free 85).
    b = memory.kv_budget_bytes(100 * GiB, 85 * GiB, 12 * GiB, 10 * GiB, 0.9, scratch=GiB)
    assert b == int(0.9 * 100 * GiB) - 9 * GiB - 3 * GiB
    # Nothing left: a clear error naming the flags.
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        memory.kv_budget_bytes(10 * GiB, 9 * GiB, GiB, 9 * GiB, 0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory.kv_budget_bytes(10 * GiB, 9 * GiB, GiB, GiB, 1.5)


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_profile_run_makes_the_largest_step(tiny_llama_dir, cpu_kernels):
    model, _ = load_model(str(tiny_llama_dir), torch.float32, cpu_kernels=cpu_kernels)
    cfg = model.config
    scratch = memory.profile_run(model, block_size=16, num_tokens=40, num_seqs=8, device="cpu")
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert scratch == 48 * per_token  # 3 blocks of 16 for the 40 tokens, K and V


def test_cpu_takes_the_fixed_budget_unless_given(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", device="cpu")
    ex = Executor(args.create_configs())
    assert ex.kv_cache_bytes <= memory.DEFAULT_KV_CACHE_BYTES
    assert ex.kv_cache_bytes > memory.DEFAULT_KV_CACHE_BYTES - ex.kv_cache_bytes / ex.num_blocks
    small = Executor(
        EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="1MiB").create_configs()
    )
    assert small.kv_cache_bytes <= 2**20 < 2 * small.kv_cache_bytes


def test_cuda_budget_comes_from_the_profile_unless_given(monkeypatch):
    """The executor's choice on a CUDA device (the device faked; the profile stubbed)."""
    calls = []

    def fake_budget(model, device, block_size, num_tokens, num_seqs, utilization):
        calls.append((num_tokens, num_seqs, utilization))
        return 5 * GiB

    monkeypatch.setattr(memory, "cuda_kv_budget", fake_budget)
    tp = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    ex = SimpleNamespace(model=None)
    args = EngineArgs(max_num_batched_tokens=384, max_num_seqs=48, gpu_memory_utilization=0.8)
    assert Executor._kv_budget(ex, args.create_configs(), tp) == 5 * GiB
    assert calls == [(384, 48, 0.8)]  # the largest step the scheduler can make
    # Given explicitly: the flag wins; the profile still runs (it is the warm-up).
    given = EngineArgs(kv_cache_memory="2GiB")
    assert Executor._kv_budget(ex, given.create_configs(), tp) == 2 * GiB and len(calls) == 2

    def full(*a):
        raise ValueError("no GPU memory left for the KV cache")

    monkeypatch.setattr(memory, "cuda_kv_budget", full)
    with pytest.raises(ValueError, match="no GPU memory"):
        Executor._kv_budget(ex, EngineArgs().create_configs(), tp)
    assert Executor._kv_budget(ex, given.create_configs(), tp) == 2 * GiB  # sized by the flag: not an error
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert Executor._kv_budget(ex, EngineArgs().create_configs(), cpu) == memory.DEFAULT_KV_CACHE_BYTES

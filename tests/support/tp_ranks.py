"""Functions the tensor-parallel tests run in spawned rank processes (importable by name)."""

from __future__ import annotations

import torch

from tests.support.kernels import held_weight
from tinyserve.distributed.parallel_state import init_tp_group
from tinyserve.models.loader import load_model
from tinyserve.testing.paged_runner import PagedRunner


def teacher_forced_logits(rank, size, init_method, model_path, tokens, prompt_len, out_path):
    """Every rank: its shard, prefill + teacher-forced decode through the paged cache.
    Rank 0 saves the logits and how many all-reduces the forward passes made."""
    torch.set_num_threads(1)
    group = init_tp_group(rank, size, torch.device("cpu"), init_method)
    try:
        model, _ = load_model(model_path, torch.float32, "cpu", tp=group)
        runner = PagedRunner(model, block_size=4, num_blocks=64, seed=3)
        logits = runner.prefill_then_decode(tokens, prompt_len)
        steps = 1 + len(tokens) - prompt_len
        if rank == 0:
            torch.save(
                {
                    "logits": logits,
                    "all_reduces": group.num_all_reduces,
                    "steps": steps,
                    "qkv_rows": held_weight(model.model.layers[0].self_attn.qkv_proj).shape[0],
                    "kv_heads": runner.kv_caches[0][0].shape[2],
                },
                out_path,
            )
    finally:
        group.destroy()

"""A tensor-parallel step that fails on a rank leaves the other ranks inside a collective:
``close()`` must still return quickly (not after the 300 s group timeout) and leave no
worker process behind."""

from __future__ import annotations

import time

import pytest
import torch.distributed

from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing.checkpoints import build_hf, llama_config, random_tokens, save_hf

pytestmark = pytest.mark.slow


def test_close_after_a_failed_tp_step_is_bounded(tmp_path, monkeypatch):
    path = save_hf(build_hf(llama_config()), tmp_path / "llama")  # 4 heads, 2 KV heads
    engine = LLMEngine(
        model=str(path), tensor_parallel_size=2, dtype="float32", device="cpu",
        load_tokenizer=False, block_size=4, num_blocks=32,
    )  # fmt: skip
    procs = list(engine.executor.tp_driver.processes)
    assert len(procs) == 1 and procs[0].is_alive()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", random_tokens(9, seed=1), params)
    engine.step()  # one good step: the group works

    def failing_forward(*args, **kwargs):  # rank 0 fails after the step was broadcast:
        raise RuntimeError("injected failure")  # rank 1 waits in the first all-reduce

    monkeypatch.setattr(engine.executor.runner.model, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.step()
    t0 = time.monotonic()
    engine.close()
    elapsed = time.monotonic() - t0
    assert elapsed <= 10.0, f"close() took {elapsed:.1f} s"
    assert all(not p.is_alive() for p in procs)
    assert not torch.distributed.is_initialized()  # the next engine can start a group
    engine.close()  # idempotent

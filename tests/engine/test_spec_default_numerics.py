"""Speculation's default ("auto") only where a verified draft's logits are a decoded
token's: on torch's attention (a dense checkpoint where ``--dtype auto`` measured torch's
bf16 faster, as on AMX CPUs) decode rows and a verified run take different kernels, and a
bug hunt on an AMX Xeon saw logprobs 0.016 apart at a verified position; the default is then
off (so too where a linear layer runs on torch's GEMM), and an explicit config still turns it
on."""

from __future__ import annotations

import pytest

from tests.support.engine import tiny_engine


@pytest.mark.parametrize(
    ("kwargs", "spec", "speculative"),
    [
        ({}, "auto", True),  # the CPU kernels: one numeric path
        ({"cpu_kernels": False}, "auto", False),  # torch's attention
        ({"cpu_kernels": False}, {"method": "suffix"}, True),  # asked for
        ({"cpu_kernels": False}, None, False),
    ],
)
def test_auto_speculation_stays_off_where_drafts_change_numerics(
    tiny_qwen2_path, kwargs, spec, speculative
):
    engine = tiny_engine(tiny_qwen2_path, speculative_config=spec, **kwargs)
    assert engine.core.executor.attention_backend == ("torch" if kwargs else "kernel")
    assert engine.core.speculative is speculative


def test_auto_speculation_stays_off_where_a_linear_runs_on_torch(tmp_path, caplog):
    """An input width the kernels cannot take (not a multiple of 32: here the MLP's 112)
    leaves that layer on torch's GEMM, whose blocking follows the row count (a bug hunt:
    logprobs alone vs batched differed in 12 of 12 requests): the default is off there too."""
    import logging

    from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf

    path = save_hf(build_hf(llama_config(intermediate_size=112)), tmp_path / "odd")
    with caplog.at_level(logging.INFO):
        engine = tiny_engine(str(path), speculative_config="auto")
    assert engine.core.executor.attention_backend == "kernel"
    assert engine.core.speculative is False
    assert any("linear layers run on torch's GEMM" in r.getMessage() for r in caplog.records)
    assert tiny_engine(str(path), speculative_config={"method": "suffix"}).core.speculative

"""One host->device copy per step (worker/staging.py): the packing is checked on the CPU
with ``pack=True`` (on a CPU the runner does not pack; on CUDA it always does)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf
from tinyserve.worker.staging import HostToDevice, tensors_of, with_tensors


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_hf(build_hf(llama_config()), tmp_path_factory.mktemp("llama"))


def test_packed_views_hold_every_dtype_and_shape_exactly():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-(2**40), 2**40, (7,), generator=g),  # int64
        torch.randn(3, 5, generator=g),  # float32
        torch.rand(4, 1, 9, generator=g) > 0.5,  # bool
        torch.randint(0, 1000, (2, 3), generator=g, dtype=torch.int32),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.empty(0, dtype=torch.int64),
        torch.randn(6, 4, generator=g).t(),  # not contiguous
    ]
    stage = HostToDevice("cpu", pack=True)
    for _ in range(2):  # the buffers are reused
        out = stage(tensors)
        for a, b in zip(tensors, out, strict=True):
            assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
    assert stage.num_copies == 2
    assert HostToDevice("cpu")(tensors) is tensors  # a CPU does not pack


def test_tensors_round_trip_through_nested_dataclasses():
    @dataclasses.dataclass
    class Inner:
        a: torch.Tensor
        tag: str = "x"

    @dataclasses.dataclass
    class Outer:
        pair: tuple | None
        groups: list
        n: int = 3

    obj = Outer((torch.ones(2), torch.zeros(1)), [Inner(torch.arange(3)), Inner(torch.ones(1))])
    ts = tensors_of(obj)
    assert len(ts) == 4
    new = with_tensors(obj, iter([t + 10 for t in ts]))
    assert torch.equal(new.pair[0], torch.full((2,), 11.0)) and new.groups[1].tag == "x"
    assert torch.equal(obj.pair[0], torch.ones(2))  # the original is untouched


def _run(engine, params):
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5 + i] * (3 + 11 * i), p)
    outs: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            lps = o.logprobs or [None] * len(o.new_token_ids)
            outs.setdefault(o.request_id, []).extend(zip(o.new_token_ids, lps, strict=True))
    # Per request, token by token: how many tokens a step gives (speculation drafts by the
    # measured step costs, which a busy host moves) is not what packing is about.
    return outs, steps


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch-path", "kernel-path"])
def test_a_packed_step_gives_the_same_tokens_and_logprobs(tiny_llama_dir, cpu_kernels):
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, seed=5, top_p=0.8, max_tokens=10, ignore_eos=True),
        SamplingParams(
            temperature=0.0,
            max_tokens=10,
            ignore_eos=True,
            presence_penalty=0.7,
            logit_bias={7: 3.0},
            min_tokens=3,
        ),  # fmt: skip
    ]

    def engine():
        return LLMEngine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                    cpu_kernels=cpu_kernels, load_tokenizer=False,
                                    num_blocks=64, max_num_batched_tokens=16))  # fmt: skip

    plain, _ = _run(engine(), params)
    packed_engine = engine()
    runner = packed_engine.executor.runner
    runner.to_device = HostToDevice("cpu", pack=True)
    packed, steps = _run(packed_engine, params)
    assert packed == plain
    assert runner.to_device.num_copies == steps  # one transfer per step

"""The step reads the device back once (issue 16, item 1's budget): on a GPU every
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero()`` or truth test of a tensor waits for the
device, so the hot path may make one such call per step (the sampled ids, with the logprobs
packed beside them) and none elsewhere — in metadata, the model, the sampler or the engine.

Counted here on the CPU by wrapping those tensor methods during ``engine.step()``: the same
code runs on CUDA, so a call added anywhere on the path fails this test before a GPU sees it.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf

SYNCING = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
           "__index__")  # fmt: skip
BUDGET = 1  # device->host reads per step


@contextlib.contextmanager
def count_syncs():
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, fn):
        def counted(self, *a, **kw):
            counts[name] += 1
            return fn(self, *a, **kw)

        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    real_nonzero = torch.nonzero
    torch.nonzero = wrap("torch.nonzero", real_nonzero)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = real_nonzero


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_hf(build_hf(llama_config()), tmp_path_factory.mktemp("llama"))


REQUESTS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, min_p=0.05, max_tokens=12, ignore_eos=True),
    SamplingParams(
        temperature=0.0,
        logprobs=2,
        frequency_penalty=0.5,
        max_tokens=12,
        ignore_eos=True,
        logit_bias={5: 2.0},
        min_tokens=4,
    ),  # fmt: skip
]


def test_counter_sees_a_read_back():
    with count_syncs() as counts:
        torch.ones(3).tolist()
        bool(torch.ones(1))
    assert counts == Counter({"tolist": 1, "__bool__": 1})
    assert torch.ones(2).tolist() == [1.0, 1.0]  # restored


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch-path", "kernel-path"])
def test_every_step_reads_the_device_back_at_most_once(tiny_llama_dir, cpu_kernels):
    """The torch path is the one CUDA runs; the CPU kernel path keeps the same budget."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                  cpu_kernels=cpu_kernels, load_tokenizer=False,
                                  num_blocks=64, max_num_batched_tokens=32))  # fmt: skip
    for i, params in enumerate(REQUESTS):
        engine.add_request(f"r{i}", [3 + i] * (5 + 9 * i), params)  # some prompts chunked
    per_step, tokens = [], 0
    while engine.has_unfinished():
        with count_syncs() as counts:
            outs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outs)
        per_step.append(sum(counts.values()))
        assert sum(counts.values()) <= BUDGET, (len(per_step), dict(counts))
    assert tokens == sum(p.max_tokens for p in REQUESTS)
    assert per_step.count(1) >= 11  # decode steps really were counted

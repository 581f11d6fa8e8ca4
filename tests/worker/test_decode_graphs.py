"""The fixed-buffer decode path that CUDA graphs capture (worker/decode_graphs.py).

On a CPU the path runs uncaptured ("eager"): the same padded buffers, static metadata and
forward a graph would replay, with the masked torch attention or the Triton kernel (under
its interpreter). It must give what the ordinary path gives, write no real KV block from a
padding row, and stay off for steps it cannot take. With ``TINYSERVE_TEST_DEVICE=cuda`` the
last test captures the graphs and checks a replay against the eager forward."""

from __future__ import annotations

import pytest
import torch

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.kernels import triton_attention
from tinyserve.models import loader
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing.checkpoints import build_hf, llama_config, qwen2_config, save_hf, tiny_config
from tinyserve.worker import executor
from tinyserve.worker.decode_graphs import DecodeGraphs, buckets_for
from tinyserve.worker.model_runner import ModelRunner, StepInput


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {
        "llama": save_hf(build_hf(llama_config()), tmp_path_factory.mktemp("llama")),
        "qwen2": save_hf(build_hf(qwen2_config()), tmp_path_factory.mktemp("qwen2")),
        # Hybrid: a block table per layer group (utils/kv_groups.py).
        "gemma3": save_hf(
            build_hf(tiny_config("gemma3", sliding_window=6)), tmp_path_factory.mktemp("gemma3")
        ),
    }


def test_buckets_cover_max_num_seqs():
    assert buckets_for(1) == (1,)
    assert buckets_for(5) == (1, 2, 4, 8)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_for(1000)[-1] == 256  # larger batches run eagerly


def test_decode_graphs_mode_is_cuda_only_and_obeys_enforce_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert executor.decode_graphs_mode(cuda, 1, False) == "capture"
    assert executor.decode_graphs_mode(cuda, 1, True) == "off"
    assert executor.decode_graphs_mode(cuda, 2, False) == "off"  # collectives: not captured
    assert executor.decode_graphs_mode(cpu, 1, False) == "off"


def _engine(path, **kw):
    args = dict(
        model=str(path),
        dtype="float32",
        device="cpu",
        cpu_kernels=False,
        load_tokenizer=False,
        num_blocks=96,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        speculative_config=None,  # plain decode steps: the ones graphs replay
    )
    args.update(kw)  # fmt: skip
    return LLMEngine(EngineArgs(**args))


def _run(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            logprobs.setdefault(o.request_id, []).extend(lp.logprob for lp in o.logprobs or [])
    return tokens, logprobs


PROMPTS = [[5 + i] * (2 + 9 * i) + [3, 1, 4, 1, 5][: i + 1] for i in range(5)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=1)
          for i in range(5)]  # fmt: skip


@pytest.mark.parametrize(
    "arch,backend,count",
    [("llama", "masked", 5), ("qwen2", "masked", 5), ("gemma3", "masked", 5),
     ("llama", "triton", 3)],
)  # fmt: skip
def test_fixed_buffer_decode_matches_the_ordinary_path(tiny_dirs, arch, backend, count,
                                                       monkeypatch):  # fmt: skip
    """Greedy tokens equal and logprobs within float32 noise: requests of ragged lengths
    finishing at different steps, so the batch walks through the buckets (8,) 4, 2, 1. (The
    Triton kernel runs interpreted here, ~50 ms a call: 3 requests.)"""
    if backend == "triton" and not triton_attention.available("cpu"):
        pytest.skip("Triton is not installed (dev extras)")
    if backend == "triton":
        monkeypatch.setattr(loader, "_triton_decode_fits", lambda net, heads: True)
    prompts, params = PROMPTS[:count], PARAMS[:count]
    plain = _run(_engine(tiny_dirs[arch]), prompts, params)
    monkeypatch.setattr(executor, "decode_graphs_mode", lambda *a: "eager")
    engine = _engine(tiny_dirs[arch])
    graphs = engine.executor.runner.decode_graphs
    assert graphs is not None and graphs.backend == backend
    groups = engine.executor.kv_groups  # a hybrid model's other groups: their own buffers
    assert len(graphs.groups) == (0 if groups is None else groups.num_groups - 1)
    fixed = _run(engine, prompts, params)
    assert graphs.num_replays >= max(p.max_tokens for p in params) - 1  # decode steps took it
    assert fixed[0] == plain[0]
    for rid, lps in plain[1].items():
        assert fixed[1][rid] == pytest.approx(lps, abs=1e-4)


def test_padding_rows_write_only_the_scratch_block(tiny_dirs):
    from tinyserve.models.loader import load_model

    model, _ = load_model(str(tiny_dirs["llama"]), torch.float32, "cpu", cpu_kernels=False)
    bs, num_blocks = 4, 12
    runner = ModelRunner(model, num_blocks, bs, torch.device("cpu"), decode_graphs="eager",
                         max_num_seqs=8, max_model_len=32)  # fmt: skip
    graphs: DecodeGraphs = runner.decode_graphs
    assert runner.kv_caches[0][0].shape[0] == num_blocks + 1  # the scratch block
    g = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    # Three decode rows (bucket 4: one padding row); contexts 5, 9, 2.
    step = StepInput([7, 8, 9], [4, 8, 1], [1, 1, 1], [5, 9, 2], [[0, 1], [2, 3, 4], [5]], 3)
    assert graphs.fits(step.query_lens, step.num_decode_seqs, step.block_tables)
    hidden = runner.forward(step)
    assert hidden.shape[0] == 3 and graphs.num_replays == 1
    written = {1 * bs + 0, 4 * bs + 0, 5 * bs + 1}  # each row's last position's slot
    scratch = set(range(num_blocks * bs, (num_blocks + 1) * bs))
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        changed = ((k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)).flatten()
        slots = set(torch.nonzero(changed).flatten().tolist())
        assert written <= slots <= written | scratch
        assert slots & scratch  # the padding row wrote there


def test_steps_the_path_does_not_take(tiny_dirs):
    from tinyserve.models.loader import load_model

    model, _ = load_model(str(tiny_dirs["llama"]), torch.float32, "cpu", cpu_kernels=False)
    runner = ModelRunner(model, 16, 4, torch.device("cpu"), decode_graphs="eager",
                         max_num_seqs=2, max_model_len=16)  # fmt: skip
    graphs = runner.decode_graphs
    assert graphs.fits([1, 1], 2, [[0], [1]])
    assert not graphs.fits([1, 3], 1, [[0], [1]])  # a prefill chunk: mixed, eager
    assert not graphs.fits([1, 4], 2, [[0], [1, 2]])  # drafts being verified
    assert not graphs.fits([1], 0, [[0]])  # a prompt's last token, not a generated one
    assert not graphs.fits([1, 1, 1], 3, [[0], [1], [2]])  # above the largest bucket (2)
    assert not graphs.fits([1], 1, [[0, 1, 2, 3, 4]])  # wider than max_model_len
    off = ModelRunner(model, 16, 4, torch.device("cpu"))
    assert off.decode_graphs is None and off.kv_caches[0][0].shape[0] == 16


@pytest.mark.device
def test_captured_replay_matches_eager_on_cuda(tiny_dirs, test_device):
    if not test_device.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device (TINYSERVE_TEST_DEVICE=cuda)")
    from tinyserve.models.loader import load_model

    dev = torch.device(test_device)
    model, _ = load_model(str(tiny_dirs["llama"]), torch.float32, dev)
    runners = {
        mode: ModelRunner(
            model, 32, 4, dev, decode_graphs=mode, max_num_seqs=8, max_model_len=64
        )  # fmt: skip
        for mode in ("eager", "capture")
    }
    runners["capture"].decode_graphs.capture()
    assert sorted(runners["capture"].decode_graphs.graphs) == [1, 2, 4, 8]
    g = torch.Generator().manual_seed(1)
    for r in runners.values():  # the same cache contents in both
        for k, v in r.kv_caches:
            k.copy_(torch.randn(k.shape, generator=g).to(dev))
            v.copy_(torch.randn(v.shape, generator=g).to(dev))
        g.manual_seed(1)
    for n in (1, 3, 8):
        lens = [5 + 7 * i for i in range(n)]
        tables = [[(3 * i + j) % 32 for j in range(-(-sl // 4))] for i, sl in enumerate(lens)]
        step = StepInput(list(range(10, 10 + n)), [sl - 1 for sl in lens], [1] * n, lens,
                         tables, n)  # fmt: skip
        eager = runners["eager"].forward(step)
        replay = runners["capture"].forward(step)
        torch.testing.assert_close(replay, eager, rtol=1e-4, atol=1e-4)

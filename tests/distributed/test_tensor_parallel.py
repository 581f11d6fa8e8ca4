"""Tensor parallel on CPU with gloo: sharded logits equal the single-process model's, the
engine gives the same greedy tokens at TP=2 and TP=3, bad sizes fail clearly."""

from __future__ import annotations

import re

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.tp_ranks import teacher_forced_logits
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.entrypoints.llm import LLM
from tinyserve.models.loader import load_model
from tinyserve.sampling_params import SamplingParams
from tinyserve.testing.checkpoints import (
    LLAMA3_ROPE,
    build_hf,
    llama_config,
    phi3_longrope,
    qwen2_config,
    random_tokens,
    save_hf,
    tiny_config,
)
from tinyserve.testing.paged_runner import PagedRunner
from tinyserve.testing.server import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # 8 heads / 4 KV heads / 256-wide MLP: divisible by 2 and 4.
    shape = dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=256)
    llama = save_hf(build_hf(llama_config(rope_scaling=LLAMA3_ROPE, **shape)), root / "llama")
    qwen2 = save_hf(build_hf(qwen2_config(**shape), seed=7), root / "qwen2")
    # Phi-3's fused checkpoint tensors split before each rank takes its slice, with its
    # partial-rotary row order and LongRoPE (heads of 16: 12 rotated); Gemma 3's layer.
    phi3 = tiny_config("phi3", hidden_size=128, **shape, **phi3_longrope(12))
    gemma3 = tiny_config("gemma3", attention_bias=True, **shape)  # o_proj bias: rank 0 adds it
    return {"llama": str(llama), "qwen2": str(qwen2),
            "phi3": str(save_hf(build_hf(phi3, seed=5), root / "phi3")),
            "gemma3": str(save_hf(build_hf(gemma3, seed=6), root / "gemma3"))}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
def test_tp2_logits_match_tp1_prefill_and_decode(tiny_paths, arch, tmp_path):
    path = tiny_paths[arch]
    tokens, prompt_len = random_tokens(40, seed=11), 24  # prefill 24, then 16 decode steps
    out = tmp_path / "rank0.pt"
    mp.spawn(
        teacher_forced_logits,
        args=(2, f"tcp://127.0.0.1:{free_port()}", path, tokens, prompt_len, str(out)),
        nprocs=2,
    )
    tp2 = torch.load(out)
    model, _ = load_model(path, torch.float32, "cpu")
    tp1 = PagedRunner(model, block_size=4, num_blocks=64, seed=3).prefill_then_decode(
        tokens, prompt_len
    )
    diff = (tp2["logits"] - tp1).abs()
    assert diff[:prompt_len].max() < 1e-4, f"prefill max |diff| {diff[:prompt_len].max()}"
    assert diff[prompt_len:].max() < 1e-4, f"decode max |diff| {diff[prompt_len:].max()}"
    assert tp1.abs().max() > 0.1  # the logits are not trivially small
    # Each rank held half the heads and KV heads; two all-reduces per layer per forward.
    cfg = model.config
    assert tp2["qkv_rows"] == (cfg.q_size + 2 * cfg.kv_size) // 2
    assert tp2["kv_heads"] == cfg.num_key_value_heads // 2
    assert tp2["all_reduces"] == 2 * cfg.num_hidden_layers * tp2["steps"]


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_tp2_greedy_equals_tp1(tiny_paths):
    prompts = [random_tokens(n, seed=n) for n in (5, 17, 33, 9)]
    kw = dict(dtype="float32", device="cpu", load_tokenizer=False, block_size=4)
    with LLM(tiny_paths["qwen2"], **kw) as llm:
        want = _greedy(llm, prompts, 12)
    with LLM(tiny_paths["qwen2"], tensor_parallel_size=2, **kw) as llm:
        assert (
            llm.engine.executor.tp_driver is not None
            and len(llm.engine.executor.tp_driver.processes) == 1
        )
        got = _greedy(llm, prompts, 12)
        procs = list(llm.engine.executor.tp_driver.processes)
    assert got == want
    assert all(not p.is_alive() for p in procs)  # close() let the workers exit


def test_engine_tp2_serves_a_hybrid_model(tiny_paths, tmp_path):
    """Gemma 3 with a 6-position window: a block table per layer group (every rank runs the
    driver's broadcast tables, utils/kv_groups.py), windowed groups' blocks released past
    the window: tokens and logprobs at TP=2 equal one process's."""
    path = save_hf(build_hf(tiny_config("gemma3", sliding_window=6, num_attention_heads=8,
                                        num_key_value_heads=4, intermediate_size=256),
                            seed=6), tmp_path / "gemma3")  # fmt: skip
    prompts = [random_tokens(n, seed=n) for n in (30, 21, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32", device="cpu", load_tokenizer=False, block_size=4,
              max_num_batched_tokens=8)  # fmt: skip

    def run(**more):
        with LLM(str(path), **kw, **more) as llm:
            assert llm.engine.executor.kv_groups is not None
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    want, got = run(), run(tensor_parallel_size=2)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens and lps == pytest.approx(want_lps, abs=1e-4)
        assert len(lps) == 20


def test_speculative_decoding_under_tensor_parallel(tiny_paths):
    """The driver drafts and verifies; the ranks run the broadcast batch with the drafts in
    it: greedy tokens at TP=2 with speculation equal one process without it."""
    loop = random_tokens(6, seed=3)
    prompts = [loop * 3, random_tokens(9, seed=9) * 2]  # repeated: the proposer has matches
    kw = dict(dtype="float32", device="cpu", load_tokenizer=False, block_size=4)
    with LLM(tiny_paths["qwen2"], **kw) as llm:
        want = _greedy(llm, prompts, 16)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    with LLM(tiny_paths["qwen2"], tensor_parallel_size=2, speculative_config=spec, **kw) as llm:
        got = _greedy(llm, prompts, 16)
        stats = llm.engine.core.proposer.stats
    assert got == want
    assert stats.num_drafts > 0


def test_tp3_on_smollm2_same_greedy_tokens_as_tp1(smollm2_gguf_path):
    """SmolLM2 has 9 heads and 3 KV heads: TP=3 gives each rank 3 heads and 1 KV head. The
    ranks hold float32 shards of the GGUF's weights and multiply float32 activations, so one
    process runs at that precision too (its default on a CPU with AVX512-BF16 rounds the
    activations and attention's products to bf16: another precision, whose greedy tokens may
    leave float32's at a near tie — one of these prompts did at its 14th token)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Three colours are"]
    kw = dict(dtype="float32", device="cpu")
    with LLM(str(smollm2_gguf_path), kernel_activations="float32", **kw) as llm:
        want = _greedy(llm, prompts, 16)
    with LLM(str(smollm2_gguf_path), tensor_parallel_size=3, **kw) as llm:
        got = _greedy(llm, prompts, 16)
    assert got == want


@pytest.mark.parametrize(
    ("size", "arch", "count"),
    [(3, "llama", "num_attention_heads (8)"), (16, "qwen2", "num_attention_heads (8)")],
)
def test_indivisible_sizes_fail_before_starting_workers(tiny_paths, size, arch, count):
    msg = rf"tensor_parallel_size {size} does not divide.*{re.escape(count)}"
    with pytest.raises(ValueError, match=msg):
        LLMEngine(model=tiny_paths[arch], tensor_parallel_size=size, load_tokenizer=False)
    assert not mp.active_children()


def test_smollm2_tp2_names_the_head_counts(smollm2_gguf_path):
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads \(9\)"):
        LLMEngine(model=str(smollm2_gguf_path), tensor_parallel_size=2)


def test_constrained_decoding_under_tensor_parallel(smollm2_gguf_path, tmp_path):
    """Masks live on the driver (rank 0 samples): a seeded constrained request gives the same
    tokens at TP=2 as in one process, and they match the regex."""
    from tinyserve.models.default_model import tokenizer_dir_for
    from tinyserve.sampling_params import StructuredOutputsParams
    from tinyserve.testing.checkpoints import build_fuzz_model

    path = str(build_fuzz_model(tmp_path / "model", tokenizer_dir_for(smollm2_gguf_path)))
    so = StructuredOutputsParams(regex=r"[a-z]{2,6}@[a-z]{3,8}\.(com|org)")
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs=so)
    texts = []
    for tp in (1, 2):
        with LLM(model=path, tensor_parallel_size=tp, dtype="float32", device="cpu",
                 num_blocks=64) as llm:  # fmt: skip
            (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        texts.append((out.outputs[0].text, out.outputs[0].token_ids))
    assert texts[0] == texts[1]
    assert re.fullmatch(r"[a-z]{2,6}@[a-z]{3,8}\.(com|org)", texts[0][0]), texts[0][0]



def test_every_rank_runs_the_drivers_numerics(tiny_paths):
    """Every rank loads from the driver's own LoadConfig (issue 38: the worker spec dropped
    kernel_activations and fused_step, so ranks > 0 loaded with the defaults) and reports
    its numerics path at start-up; the driver refuses to start on a mismatch. Non-default
    settings here: int8 weights, no fused step, float32 kernel activations."""
    kw = dict(dtype="float32", device="cpu", load_tokenizer=False, block_size=4,
              quantization="int8", fused_step=False, kernel_activations="float32")  # fmt: skip
    with LLM(tiny_paths["llama"], tensor_parallel_size=2, **kw) as llm:
        paths = llm.engine.executor.rank_paths
    assert len(paths) == 2 and paths[0] == paths[1], paths
    assert "kernel-q8_0" in paths[0] and "fused step False" in paths[0]  # int8 weights
    # The path tells settings apart (so a rank loaded with other settings is caught).
    with LLM(tiny_paths["llama"], **{**kw, "quantization": None, "fused_step": True}) as llm:
        assert llm.engine.executor.rank_paths[0] != paths[0]

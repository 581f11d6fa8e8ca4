"""The families beyond Llama and Qwen2 (issue 41), each a tiny random transformers checkpoint
with its own feature switched on and weighted away from the default: our loader + decoder +
paged cache give transformers' fp32 logits at prefill and at every teacher-forced decode
step, on the CPU kernels and on the torch path; a batched step gives each sequence its
logits alone, bitwise; and each feature matters (without it the logits differ)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.kernels import attention
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, hf_logits, random_tokens, save_hf, tiny_config
from tinyserve.testing.paged_runner import PagedRunner, batched_and_alone
from tinyserve.worker.executor import resolve_max_model_len

FAMILIES = ["qwen3", "mistral", "granite", "smollm3"]
PROMPT_LEN, DECODE_STEPS, BLOCK_SIZE = 20, 12, 4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    hf = build_hf(tiny_config(request.param))
    return request.param, save_hf(hf, tmp_path_factory.mktemp(request.param)), hf


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_prefill_and_teacher_forced_decode_match_transformers(family, kernels):
    name, path, hf = family
    ours, _ = load_model(path, dtype=torch.float32, cpu_kernels=kernels)
    assert ours.config.architecture == type(hf).__name__
    on_kernels = kernels and attention.library() is not None
    assert ours.attention_method.name == ("kernel" if on_kernels else "torch")
    assert (ours.model.step_plan is not None) == on_kernels  # every family: the one-call step
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, seed=7)
    expected = hf_logits(hf, tokens)
    runner = PagedRunner(ours, BLOCK_SIZE, num_blocks=64, seed=3)
    prefill = runner.step([("s", tokens[:PROMPT_LEN])])[0]
    torch.testing.assert_close(prefill, expected[:PROMPT_LEN], atol=1e-4, rtol=0)
    for pos in range(PROMPT_LEN, len(tokens)):
        row = runner.step([("s", [tokens[pos]])], decode={"s"})[0]
        torch.testing.assert_close(row[0], expected[pos], atol=1e-4, rtol=0,
                                   msg=lambda m, p=pos: f"{name} position {p}: {m}")  # fmt: skip


def test_a_batched_step_gives_each_sequence_its_logits_alone_bitwise(family):
    name, path, _ = family
    ours, _ = load_model(path, dtype=torch.float32)
    for label, batched, alone in batched_and_alone(ours, BLOCK_SIZE):
        assert torch.equal(batched, alone), f"{name} {label}"


# What each family's feature is, turned off: the logits must then move.
WITHOUT = {
    "qwen3": lambda hf: [torch.nn.init.ones_(n.weight) for layer in hf.model.layers
                         for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)],
    "granite": lambda hf: setattr(hf.config, "logits_scaling", 1.0),
    "smollm3": lambda hf: [setattr(layer.self_attn, "use_rope", 1) for layer in hf.model.layers],
}  # fmt: skip


@pytest.mark.parametrize("name", list(WITHOUT))
def test_each_feature_moves_the_logits(name):
    hf = build_hf(tiny_config(name))
    tokens = random_tokens(PROMPT_LEN, seed=7)
    before = hf_logits(hf, tokens)
    with torch.no_grad():
        WITHOUT[name](hf)
    assert (hf_logits(hf, tokens) - before).abs().max() > 1e-2


def test_granite_multipliers_each_reach_the_model(tmp_path):
    """The four scalars, one at a time back to 1: each changes our logits."""
    tokens = random_tokens(12, seed=4)
    base = tiny_config("granite")
    logits = {}
    for field in (None, "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling"):  # fmt: skip
        cfg = base.to_dict() | ({field: 1.0} if field else {})
        path = save_hf(build_hf(type(base)(**cfg)), tmp_path / str(field))
        ours, _ = load_model(path, dtype=torch.float32)
        logits[field] = PagedRunner(ours, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0]
    for field, got in logits.items():
        if field is not None:
            assert (got - logits[None]).abs().max() > 1e-3, field


def _config(**cfg) -> ModelConfig:
    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 32768}  # fmt: skip
    return ModelConfig.from_hf_config({**base, **cfg})


def test_a_sliding_window_does_not_cap_the_context_and_is_per_layer():
    """Windowed attention runs through the paged cache (test_sliding_window.py): the context
    is the model's; each layer's window is the config's where its layer type is windowed."""
    windowed = _config(sliding_window=4096)
    assert resolve_max_model_len(windowed, None, 10**6) == 32768
    assert resolve_max_model_len(windowed, 8192, 10**6) == 8192
    assert [windowed.layer_window(i) for i in range(2)] == [4096, 4096]
    assert resolve_max_model_len(_config(sliding_window=None), None, 10**6) == 32768
    off = _config(architectures=["Qwen3ForCausalLM"], sliding_window=4096, use_sliding_window=False)
    assert off.sliding_window is None and off.layer_window(0) is None
    full_layers = _config(sliding_window=4096, layer_types=["full_attention"] * 2)
    assert full_layers.sliding_window is None
    mixed = _config(sliding_window=64, layer_types=["full_attention", "sliding_attention"])
    assert [mixed.layer_window(i) for i in range(2)] == [None, 64]
    # Qwen2 before layer_types: windowed from max_window_layers on (transformers' rule).
    qwen2 = _config(architectures=["Qwen2ForCausalLM"], sliding_window=32,
                    use_sliding_window=True, max_window_layers=1)  # fmt: skip
    assert [qwen2.layer_window(i) for i in range(2)] == [None, 32]
    with pytest.raises(ValueError, match="window_layers has 1 entries"):
        ModelConfig(**{**dataclasses.asdict(windowed), "window_layers": (1,)})


@pytest.mark.parametrize(
    "cfg, field",
    [({"mlp_bias": True}, "mlp_bias"), ({"no_rope_layers": [1]}, "no_rope_layers"),
     ({"architectures": ["Gemma4ForCausalLM"]}, "unsupported architecture")],
)  # fmt: skip
def test_what_no_family_serves_is_refused_by_name(cfg, field):
    with pytest.raises(ValueError, match=field):
        _config(**cfg)


GGUF_CONFIGS = {
    "qwen3": {},
    "mistral": {},
    "granite": {},
    # GGUF has no key for SmolLM3's NoPE layers: llama.cpp takes every 4th (its default too).
    "smollm3": {"num_hidden_layers": 4, "no_rope_layers": None},
    # llama.cpp infers Gemma 3's local layers (every 6th global) and softmax scale (head_dim):
    # the checkpoint has them so; its norms are written as 1 + w; a local RoPE base of its own.
    "gemma3": {
        "num_hidden_layers": 6,
        "layer_types": None,
        "query_pre_attn_scalar": 32,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
        },
    },
}


@pytest.mark.parametrize("name", list(GGUF_CONFIGS))
def test_gguf_equals_safetensors_and_quantised_blocks_serve(name, tmp_path):
    """The family's GGUF as llama.cpp's converter writes it: at F32 the same logits as its
    safetensors to the bit; with Q4_1 / Q8_0 projections, transformers' logits with those
    exact (dequantised) weights, on the kernels' own blocks."""
    from tinyserve.testing.gguf_writer import write_gguf

    hf = build_hf(tiny_config(name, **GGUF_CONFIGS[name]))
    tokens = random_tokens(16, seed=9)
    st, _ = load_model(save_hf(hf, tmp_path / "st"), dtype=torch.float32)
    write_gguf(hf, tmp_path / "f32.gguf", {})
    gg, source = load_model(tmp_path / "f32.gguf", dtype=torch.float32)
    assert source.kind == "gguf"
    # GGUF keeps eps as a float32 (as the kernels take it); no token ids in these files;
    # Mistral is written as "llama" (the same layer).
    floats = ("rms_norm_eps", "residual_multiplier", "attention_multiplier")  # float32 there
    same = {k: getattr(gg.config, k) for k in ("eos_token_ids", "bos_token_id", "architecture",
                                               *floats)}  # fmt: skip
    assert gg.config.architecture == st.config.architecture.replace("Mistral", "Llama")
    assert gg.config == dataclasses.replace(st.config, **same)
    for k in floats:
        want = getattr(st.config, k)
        assert getattr(gg.config, k) == (want and pytest.approx(want, rel=1e-6)), k
    one = PagedRunner(st, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0]
    two = PagedRunner(gg, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0]
    assert torch.equal(one, two)
    mix = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q8_0",
           "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}  # fmt: skip
    exact = write_gguf(hf, tmp_path / "q.gguf", mix)
    q, _ = load_model(tmp_path / "q.gguf", dtype=torch.float32, kernel_activations="float32")
    if attention.library() is not None:
        assert {m.method.name for n, m in q.linear_layers().items() if "layers" in n} == {
            "kernel-q4_1", "kernel-q8_0"}  # fmt: skip
    hf.load_state_dict({**hf.state_dict(), **exact})
    got = PagedRunner(q, BLOCK_SIZE, num_blocks=16).step([("s", tokens)])[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_a_gguf_without_a_vocab_size_key_takes_its_token_lists_length(tmp_path):
    """llama.cpp's converter writes no {arch}.vocab_size for most families: the vocabulary
    is the tokenizer's token list (read without its strings)."""
    from tinyserve.models.gguf_checkpoint import GGUFCheckpoint
    from tinyserve.testing.gguf_writer import write_gguf

    hf = build_hf(tiny_config("qwen3"))
    vocab = hf.config.vocab_size
    write_gguf(hf, tmp_path / "t.gguf", {},
               extra=lambda w: w.add_token_list([f"t{i}" for i in range(vocab)]))  # fmt: skip
    config, _ = GGUFCheckpoint(tmp_path / "t.gguf").config_and_rope()
    assert config.vocab_size == vocab


def test_the_tokenizer_of_a_family_gguf_transformers_cannot_read(
    tmp_path, smollm2_gguf_path, smollm2_tokenizer
):
    """transformers' GGUF reader refuses granite and smollm3 files before it looks at their
    tokenizer; the loader converts it from the tokenizer fields alone (models/gguf_tokenizer.py)."""
    from tinyserve.models.gguf_tokenizer import tokenizer_fields
    from tinyserve.models.loader import load_tokenizer, resolve_model_source
    from tinyserve.testing.gguf_writer import write_gguf

    path = tmp_path / "granite.gguf"
    write_gguf(
        build_hf(tiny_config("granite")), path, {}, extra=tokenizer_fields(smollm2_gguf_path)
    )
    tok = load_tokenizer(resolve_model_source(str(path)))
    text = "Hello, world! <|im_start|>user"
    assert tok.encode(text) == smollm2_tokenizer.encode(text)

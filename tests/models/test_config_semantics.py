"""A config.json read as transformers reads it for each family: which projections carry a
bias, the defaults of keys a config leaves out, and what the forward pass cannot compute (a
ValueError naming it). Each case here was loaded and served with wrong logits before, at
most with a warning (a model-families bug hunt)."""

from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import build_hf, hf_logits, random_tokens, save_hf, tiny_config
from tinyserve.testing.paged_runner import PagedRunner

SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _config(arch: str, **keys) -> ModelConfig:
    return ModelConfig.from_hf_config({"architectures": [arch], **SHAPE, **keys})


@pytest.mark.parametrize("family", ["llama", "qwen3", "granite", "gemma3", "smollm3"])
def test_attention_bias_puts_a_bias_on_o_proj_too(family, tmp_path):
    """transformers' attention_bias is q, k, v and o_proj in these families; o_proj's was
    dropped ("ignoring unexpected tensor"): max |logit diff| 0.3-3.8 from the first row."""
    hf = build_hf(tiny_config(family, attention_bias=True))
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    ours, _ = load_model(save_hf(hf, tmp_path / family), dtype=torch.float32)
    tokens = random_tokens(16, seed=3)
    got = PagedRunner(ours, 4, num_blocks=32, seed=1).step([("s", tokens)])[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_which_projections_carry_a_bias():
    # Qwen2's q/k/v always have one (transformers does not read the key); o_proj never.
    qwen2 = _config("Qwen2ForCausalLM", attention_bias=False)
    assert (qwen2.attention_bias, qwen2.o_proj_bias) == (True, False)
    # Mistral's and Phi-3's attention has none whatever the key says (Mistral's refused to
    # load: "missing weights: q_proj.bias").
    for arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        c = _config(arch, attention_bias=True)
        assert (c.attention_bias, c.o_proj_bias) == (False, False)
    llama = _config("LlamaForCausalLM", attention_bias=True)
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)
    assert not _config("LlamaForCausalLM").o_proj_bias


def test_keys_left_out_take_the_familys_default():
    # transformers 4.x's save_pretrained leaves out a key equal to its default
    for arch in ("Gemma3ForCausalLM", "SmolLM3ForCausalLM"):
        assert _config(arch).tie_word_embeddings  # was False: "missing weights: lm_head"
    assert not _config("LlamaForCausalLM").tie_word_embeddings
    assert _config("Phi3ForCausalLM").rms_norm_eps == 1e-5
    assert _config("MistralForCausalLM").sliding_window == 4096
    assert _config("MistralForCausalLM", sliding_window=None).sliding_window is None
    # Qwen2: windowed from max_window_layers (28 unless given) on: no layer of 3 here; every
    # layer was windowed
    qwen2 = _config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8)
    assert all(qwen2.layer_window(i) is None for i in range(3))
    qwen2 = _config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8,
                    max_window_layers=1)  # fmt: skip
    assert [qwen2.layer_window(i) for i in range(3)] == [None, 8, 8]
    # SmolLM3: every no_rope_layer_interval-th layer without RoPE (4 unless given); RoPE
    # everywhere before
    smol = _config("SmolLM3ForCausalLM", num_hidden_layers=4, no_rope_layer_interval=2)
    assert smol.no_rope_layers == (1, 0, 1, 0)
    assert _config("SmolLM3ForCausalLM", num_hidden_layers=4).no_rope_layers == (1, 1, 1, 0)


@pytest.mark.parametrize(
    "arch, keys, named",
    [
        ("Qwen3ForCausalLM", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("LlamaForCausalLM", {"hidden_act": "relu"}, "hidden_act"),
        ("Gemma3ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation"),
    ],
)  # fmt: skip
def test_what_the_forward_pass_cannot_compute_is_refused(arch, keys, named):
    with pytest.raises(ValueError, match=named):
        _config(arch, **keys)


def test_the_activations_served_are_taken():
    _config("LlamaForCausalLM", hidden_act="silu")
    _config("Gemma3ForCausalLM", hidden_activation="gelu_pytorch_tanh")


def test_a_gguf_with_rope_scaling_other_than_linear_is_refused():
    """YaRN in a GGUF was served unscaled (the safetensors copy was refused)."""
    fields = {"general.architecture": "qwen2", "qwen2.embedding_length": 64,
              "qwen2.attention.head_count": 4, "qwen2.block_count": 2,
              "qwen2.feed_forward_length": 128, "qwen2.rope.scaling.type": "yarn",
              "qwen2.rope.scaling.factor": 4.0}  # fmt: skip
    shapes = {"token_embd.weight": (256, 64)}
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        ModelConfig.from_gguf_metadata(fields, shapes, "x.gguf")
    for none in ({}, {"qwen2.rope.scaling.type": "none"}):
        base = {k: v for k, v in fields.items() if "scaling" not in k}
        assert (
            ModelConfig.from_gguf_metadata({**base, **none}, shapes, "x.gguf").rope_scaling is None
        )


def test_a_gguf_answer_ends_at_its_end_of_turn_token_too():
    fields = {"general.architecture": "llama", "llama.embedding_length": 64,
              "llama.attention.head_count": 4, "llama.block_count": 2,
              "llama.feed_forward_length": 128, "tokenizer.ggml.eos_token_id": 7,
              "tokenizer.ggml.eot_token_id": 9}  # fmt: skip
    config = ModelConfig.from_gguf_metadata(fields, {"token_embd.weight": (256, 64)}, "x.gguf")
    assert config.eos_token_ids == (7, 9)


def test_a_llamafied_checkpoint_without_o_proj_biases_loads_with_zeros(tmp_path):
    """attention_bias carrying q/k/v biases only (Qwen converted to Llama): transformers
    fills the absent o_proj biases with zeros; refused as 'missing weights' in between."""
    from safetensors.torch import load_file, save_file

    hf = build_hf(tiny_config("llama", attention_bias=True))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    path = save_hf(hf, tmp_path / "llamafied")
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("o_proj.bias")},
              path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    ours, _ = load_model(path, dtype=torch.float32)
    tokens = random_tokens(12, seed=5)
    got = PagedRunner(ours, 4, num_blocks=32, seed=1).step([("s", tokens)])[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_an_unsupported_architecture_is_named_before_its_keys():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        _config("GPT2LMHeadModel", hidden_act="gelu_new")

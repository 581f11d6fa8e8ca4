"""The loader: sharded safetensors, GGUF (F32/F16/Q8_0/Q4_0/Q4_1, llama q/k row permutation,
baked-in RoPE factors), and errors that say what to fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.support.kernels import held_weight
from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import (
    LLAMA3_ROPE,
    build_hf,
    hf_logits,
    llama_config,
    random_tokens,
    save_hf,
)
from tinyserve.testing.gguf_writer import write_gguf
from tinyserve.testing.paged_runner import PagedRunner

TOKENS = random_tokens(24, seed=3)


def our_logits(model, tokens=TOKENS, prompt_len=16) -> torch.Tensor:
    return PagedRunner(model, block_size=4, num_blocks=16).prefill_then_decode(tokens, prompt_len)


@pytest.fixture(scope="module")
def llama_hf():
    return build_hf(llama_config())


@pytest.fixture(scope="module")
def llama_dir(llama_hf, tmp_path_factory):
    return save_hf(llama_hf, tmp_path_factory.mktemp("llama"))


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- safetensors


def test_sharded_checkpoint_loads_like_single_file(llama_hf, llama_dir, tmp_path):
    sharded = save_hf(llama_hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert not (sharded / "model.safetensors").exists()

    single, _ = load_model(llama_dir, dtype=torch.float32)
    ours, _ = load_model(sharded, dtype=torch.float32)
    for (name, p1), (_, p2) in zip(single.named_parameters(), ours.named_parameters(), strict=True):
        assert torch.equal(p1, p2), name
    for name, layer in single.linear_layers().items():
        assert torch.equal(held_weight(layer), held_weight(ours.linear_layers()[name])), name
    expected = our_logits(single)
    assert torch.equal(our_logits(ours), expected)
    torch.testing.assert_close(expected, hf_logits(llama_hf, TOKENS), atol=1e-4, rtol=0)


def test_a_tied_head_on_the_float32_kernels_is_the_table(llama_hf, llama_dir):
    """A dense float32 checkpoint on the float32 kernels: the tied table is not held beside
    the head's kernel copy (the lookup reads that), and every weight the model computes
    with is the checkpoint's tensor exactly."""
    from tinyserve.layers.linear import on_torch

    ours, _ = load_model(llama_dir, dtype=torch.float32)
    if any(on_torch(m) for m in ours.linear_layers().values()):
        pytest.skip("the CPU kernels are not built here")
    embed = ours.model.embed_tokens
    assert embed.rows_from is not None and embed.weight.numel() == 0
    for name, want in llama_hf.state_dict().items():
        if name.endswith("proj.weight") or name.endswith("embed_tokens.weight"):
            assert torch.equal(_our_weight(ours, name), want), name


def test_checkpoint_dtype_reads_every_shard(tmp_path):
    """One dtype for the 2-D weights of every shard, else None: an int8 load narrows to a
    checkpoint's 16-bit type only where no shard stores wider weights (exact copies)."""
    from tinyserve.models.loader import checkpoint_dtype

    hf = build_hf(llama_config()).to(torch.bfloat16)  # (not the module's fixture: .to is in place)
    assert checkpoint_dtype(save_hf(hf, tmp_path / "bf16", max_shard_size="20KB")) == torch.bfloat16
    hf.model.layers[-1].mlp.down_proj.to(torch.float32)  # in a later shard than the first
    assert checkpoint_dtype(save_hf(hf, tmp_path / "mixed", max_shard_size="20KB")) is None


def test_sharded_checkpoint_with_a_missing_shard(llama_hf, tmp_path):
    sharded = save_hf(llama_hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (sharded / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        load_model(sharded)


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "GPT2LMHeadModel"])
def test_unknown_architecture(llama_dir, tmp_path, arch):
    path = _copy(llama_dir, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=arch) as e:
        load_model(path)
    assert "config.json" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_folder_without_safetensors(llama_dir, tmp_path):
    path = tmp_path / "noweights"
    path.mkdir()
    shutil.copy(llama_dir / "config.json", path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors") as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        load_model(tmp_path)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize("how", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(llama_dir, tmp_path, how):
    path = _copy(llama_dir, tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    if how == "garbage":
        f.write_bytes(b"\x13\x37" * 5000)
    elif how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    else:
        f.write_bytes(b"")
    with pytest.raises(ValueError, match="model.safetensors") as e:
        load_model(path)
    assert str(f) in str(e.value)


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
        "model.layers.2.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ],
)
def test_missing_tensor_is_named(llama_hf, llama_dir, tmp_path, key):
    from safetensors.torch import save_file

    path = _copy(llama_dir, tmp_path)
    sd = {k: v.contiguous() for k, v in llama_hf.state_dict().items() if k != "lm_head.weight"}
    assert key in sd
    del sd[key]
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing") as e:
        load_model(path)
    # The message names the checkpoint tensor to add, not only our fused parameter.
    assert key in str(e.value)
    others = [k for k in sd if k.endswith(".weight")]
    assert not any(f"{k}," in str(e.value) or str(e.value).endswith(k) for k in others)


def test_shape_mismatch_vocab(llama_dir, tmp_path):
    other = build_hf(llama_config(vocab_size=300))
    path = save_hf(other, tmp_path / "ckpt")
    shutil.copy(llama_dir / "config.json", path / "config.json")  # says vocab 256
    with pytest.raises(ValueError) as e:
        load_model(path)
    msg = str(e.value)
    assert "model.embed_tokens.weight" in msg
    assert "[300, 64]" in msg and "[256, 64]" in msg
    assert "model.safetensors" in msg


def test_shape_mismatch_intermediate(llama_dir, tmp_path):
    other = build_hf(llama_config(intermediate_size=96))
    path = save_hf(other, tmp_path / "ckpt")
    shutil.copy(llama_dir / "config.json", path / "config.json")  # says intermediate 128
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight") as e:
        load_model(path)
    msg = str(e.value)
    name = msg.split("tensor ")[1].split(" ")[0]
    if "down_proj" in name:
        assert "[64, 96]" in msg and "[64, 128]" in msg
    else:  # one shard of the fused gate_up projection
        assert "[96, 64]" in msg and "[128, 64]" in msg


# ---------------------------------------------------------------- sources


def test_hub_id_while_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    with pytest.raises(ValueError, match="tinyserve-test/does-not-exist") as e:
        load_model("tinyserve-test/does-not-exist")
    msg = str(e.value)
    assert "hub" in msg.lower() and "HF_HUB_OFFLINE" in msg


@pytest.mark.parametrize("name", ["/no/such/dir/model", "./no-such-model", "no-such-model"])
def test_nonexistent_local_path(name):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(name)


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_model(f)


# ---------------------------------------------------------------- GGUF


def _our_weight(model, hf_name: str) -> torch.Tensor:
    from tinyserve.models.weights import map_checkpoint_name

    target, shard = map_checkpoint_name(hf_name)
    if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
        target = "model.embed_tokens.weight"
    p = dict(model.named_parameters())[target]
    owner = dict(model.named_modules())[target.rsplit(".", 1)[0]]
    if target.endswith(".weight"):  # (the kernels' copy where the loader freed its own)
        p = held_weight(owner)
    if shard is not None:
        p = p.narrow(0, *owner.shard_rows(shard))
    return p


QUANT_MIX = {
    "attn_q": "Q8_0",
    "attn_k": "Q4_0",
    "attn_v": "Q4_1",
    "attn_output": "F16",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q8_0",
    "ffn_down": "Q4_0",
    "token_embd": "F16",
}


def test_gguf_f32_round_trip_matches_transformers(llama_hf, tmp_path):
    f = tmp_path / "tiny-f32.gguf"
    expected = write_gguf(llama_hf, f, {})
    ours, source = load_model(f, dtype=torch.float32)
    assert source.kind == "gguf"
    hf_sd = llama_hf.state_dict()
    for name, want in expected.items():
        got = _our_weight(ours, name)
        assert torch.equal(got, want), name
        assert torch.equal(got, hf_sd[name]), name  # un-permute really inverts the permute
    torch.testing.assert_close(our_logits(ours), hf_logits(llama_hf, TOKENS), atol=1e-4, rtol=0)


def test_gguf_quantized_weights_equal_gguf_dequantize(llama_hf, tmp_path):
    f = tmp_path / "tiny-mixed.gguf"
    expected = write_gguf(llama_hf, f, QUANT_MIX)
    ours, _ = load_model(f, dtype=torch.float32)
    hf_sd = llama_hf.state_dict()
    for name, want in expected.items():
        got = _our_weight(ours, name)
        assert torch.equal(got, want), name
        # Quantised, but still the same matrix in the same row order.
        err = (got - hf_sd[name]).abs().max() / hf_sd[name].abs().max()
        assert err < 0.15, (name, float(err))
    # The model computes with exactly those weights.
    ref = build_hf(llama_config())
    state = {k: v for k, v in {**hf_sd, **expected}.items() if k != "lm_head.weight"}
    ref.load_state_dict(state, strict=False)  # tied: lm_head follows the F16 embedding
    assert torch.equal(ref.lm_head.weight, expected["model.embed_tokens.weight"])
    torch.testing.assert_close(our_logits(ours), hf_logits(ref, TOKENS), atol=1e-4, rtol=0)


def test_gguf_rope_freqs_carry_llama3_scaling(tmp_path):
    """A llama3-scaled model's GGUF bakes the scaling into ``rope_freqs`` (no scaling keys)."""
    hf = build_hf(llama_config(rope_parameters=dict(LLAMA3_ROPE)))
    inv_scaled = hf.model.rotary_emb.inv_freq.float()
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    base = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    factors = base / inv_scaled
    assert (factors > 1.5).any()  # the scaling is not a no-op
    f = tmp_path / "tiny-llama3.gguf"
    write_gguf(hf, f, {}, rope_freqs=factors)
    ours, _ = load_model(f, dtype=torch.float32)
    tokens = random_tokens(40, seed=8)
    got = our_logits(ours, tokens, prompt_len=20)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_gguf_unsupported_architecture(llama_hf, tmp_path, arch):
    f = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(llama_hf, f, {}, arch=arch)
    with pytest.raises(ValueError, match=arch) as e:
        load_model(f)
    assert "not supported" in str(e.value) and str(f) in str(e.value)


@pytest.mark.parametrize("how", ["garbage", "truncated_header", "truncated_data", "empty"])
def test_corrupt_gguf(llama_hf, tmp_path, how):
    good = tmp_path / "good.gguf"
    write_gguf(llama_hf, good, {})
    data = good.read_bytes()
    f = tmp_path / "bad.gguf"
    f.write_bytes(
        {
            "garbage": b"\x00\x01garbage" * 1000,
            "truncated_header": data[:200],
            "truncated_data": data[: len(data) - 1000],
            "empty": b"",
        }[how]
    )
    with pytest.raises(ValueError, match="bad.gguf") as e:
        load_model(f)
    assert str(f) in str(e.value)

"""The loader: sharded safetensors, GGUF (F32/F16/Q8_0/Q4_0/Q4_1, llama q/k row permutation,
baked-in RoPE factors), and errors that say what to fix."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tinyserve.models.loader import load_model
from tinyserve.testing.checkpoints import (
    LLAMA3_ROPE,
    build_hf,
    hf_logits,
    llama_config,
    random_tokens,
    save_hf,
)
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
    expected = our_logits(single)
    assert torch.equal(our_logits(ours), expected)
    torch.testing.assert_close(expected, hf_logits(llama_hf, TOKENS), atol=1e-4, rtol=0)


def test_sharded_checkpoint_with_a_missing_shard(llama_hf, tmp_path):
    sharded = save_hf(llama_hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (sharded / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        load_model(sharded)


@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", "GPT2LMHeadModel"])
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


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q/k for the llama architecture."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:])]}"


def write_llama_gguf(hf, path, qtypes: dict[str, str], arch: str = "llama", rope_freqs=None):
    """Write ``hf`` as a GGUF; ``qtypes`` maps a projection suffix (e.g. "attn_q") to a GGML
    type name, others are F32. Returns {hf name: the exact fp32 weight a reader should get}."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    expected = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = _gguf_name(name)
        data = t.detach().float().numpy().copy()
        heads = None
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            q = gname.endswith("attn_q.weight")
            heads = cfg.num_attention_heads if q else cfg.num_key_value_heads
            data = _permute(data, heads)
        kind = next((v for k, v in qtypes.items() if f".{k}." in f".{gname}"), "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(gname, data)
            stored = data
        elif kind == "F16":
            w.add_tensor(gname, data.astype(np.float16))
            stored = data.astype(np.float16).astype(np.float32)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype).reshape(data.shape)
        if heads is not None:
            stored = _unpermute(stored, heads)
        expected[name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _our_weight(model, hf_name: str) -> torch.Tensor:
    from tinyserve.models.weights import map_checkpoint_name

    target, shard = map_checkpoint_name(hf_name)
    if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
        target = "model.embed_tokens.weight"
    p = dict(model.named_parameters())[target]
    if shard is not None:
        owner = dict(model.named_modules())[target.rsplit(".", 1)[0]]
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
    expected = write_llama_gguf(llama_hf, f, {})
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
    expected = write_llama_gguf(llama_hf, f, QUANT_MIX)
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
    write_llama_gguf(hf, f, {}, rope_freqs=factors)
    ours, _ = load_model(f, dtype=torch.float32)
    tokens = random_tokens(40, seed=8)
    got = our_logits(ours, tokens, prompt_len=20)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_gguf_unsupported_architecture(llama_hf, tmp_path, arch):
    f = tmp_path / f"tiny-{arch}.gguf"
    write_llama_gguf(llama_hf, f, {}, arch=arch)
    with pytest.raises(ValueError, match=arch) as e:
        load_model(f)
    assert "not supported" in str(e.value) and str(f) in str(e.value)


@pytest.mark.parametrize("how", ["garbage", "truncated_header", "truncated_data", "empty"])
def test_corrupt_gguf(llama_hf, tmp_path, how):
    good = tmp_path / "good.gguf"
    write_llama_gguf(llama_hf, good, {})
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

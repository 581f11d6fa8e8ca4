"""A dense checkpoint's weights in bf16 on the CPU kernels (``--quantization bf16``: gemm.c's
kind 3, bf16 pairs read as they are by the vdpbf16ps tiles of gemm_bf16.h and the AMX tiles
of gemm_amx.h): the float64 product of the bf16 activations and the bf16 weights to float32
accumulation, the same bits per row whatever the row count and thread count (the tiles' one
contract: batch invariance, which torch's bf16 GEMM does not keep), served only with bf16
activations; through the loader every linear of a safetensors checkpoint takes it and frees
its float32 copy."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.support.kernels import logits_gap, typed
from tinyserve.kernels import build, gemm
from tinyserve.models.loader import load_model

ROWS = (1, 2, 3, 5, 7, 12, 13, 16, 17, 24, 25, 64, 129, 300)
needs_kernel = pytest.mark.skipif(
    not gemm.available(), reason="needs an x86 CPU with AVX2/FMA and a C compiler"
)
needs_bf16 = pytest.mark.skipif(
    not gemm.bf16_available(), reason="needs a CPU with AVX512-BF16 (vdpbf16ps)"
)


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(203, 320, generator=g) * 0.05  # 203 outputs: a tail group
    x = torch.randn(300, 320, generator=g) * 3
    x[7] = 0.0
    want = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    return w, x, want


def _check(matmul, want: torch.Tensor, x: torch.Tensor) -> None:
    full = matmul(x, 2)
    assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(full[7], torch.zeros(want.shape[1]))
    for rows in ROWS:
        for threads in (1, 2):
            assert torch.equal(matmul(x[:rows], threads), full[:rows]), (rows, threads)
    assert torch.equal(matmul(x[150:161], 1), full[150:161])


@needs_bf16
def test_bf16_weights_equal_their_reference_and_are_batch_invariant():
    w, x, want = _case()
    pw = gemm.from_dense_bf16(w)
    assert pw.kind == gemm.BF16 and torch.equal(pw.dequantize(), w.to(torch.bfloat16).float())
    _check(lambda xs, t: gemm.matmul(xs, pw, num_threads=t, bf16=True), want, x)
    with pytest.raises(ValueError, match="bf16 activations only"):
        gemm.matmul(x, pw)


@needs_kernel
def test_bf16_weights_on_emulated_amx_tiles():
    """The AMX path (B tiles read in place from the weight) in amx_tile.h's emulation, for
    each group width this CPU builds: any CPU."""
    w, x, want = _case()
    pw = gemm.from_dense_bf16(w)
    levels = ["avx2"] + [lv for lv in ("avx512_bf16", "avx512") if lv in build.usable_levels()][:1]
    for level in levels:
        lib = ctypes.CDLL(str(build.built("gemm", level, emulate_amx=True)))
        kw = gemm.KernelWeight.of(pw, lib.gemm_group_width())

        def matmul(xs, threads, lib=lib, kw=kw):
            return gemm._run(typed(lib, "gemm"), "matmul", xs, kw, threads, None, gemm.BF16_ACT)

        _check(matmul, want, x)


@needs_bf16
@pytest.mark.parametrize("tied", [True, False])
def test_quantization_bf16_serves_a_dense_checkpoint(tmp_path, tied):
    """Every linear (the LM head included) on bf16 weights; the logits within 5% of the
    float32 model's range through prefill and decode (bf16 weights and activations: ~2^-8
    each); the layers' float32 copies freed (an untied head's too) and the embedding's table
    held in bf16 — or, tied, not held at all: the lookup reads the head's bf16 copy — K and V
    cached in bf16 under "auto"."""
    from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf
    from tinyserve.worker.kv_cache import resolve_kv_cache_dtype

    path = save_hf(build_hf(llama_config(tie_word_embeddings=tied)), tmp_path / "llama")
    fp32, _ = load_model(path, torch.float32, "cpu")
    bf16, _ = load_model(path, torch.float32, "cpu", quantization="bf16")
    layers = bf16.linear_layers()
    assert {m.method.name for m in layers.values()} == {"kernel-bf16"}
    assert all(m.weight.numel() == 0 for m in layers.values() if m is not bf16.model.embed_tokens)
    table = bf16.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and table.numel() > 0 if not tied else table.numel() == 0
    ids = torch.arange(bf16.config.vocab_size)  # the lookup's rows: the table's in bf16
    want = fp32.model.embed_tokens(ids).to(torch.bfloat16).float()
    assert torch.equal(bf16.model.embed_tokens(ids), want)
    assert resolve_kv_cache_dtype("auto", bf16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", fp32) == torch.float32
    rel = logits_gap(fp32, bf16)
    assert 0 < rel < 0.05, rel
    with pytest.raises(ValueError, match="quantization: bf16 runs through the CPU kernels"):
        load_model(path, torch.float32, "cpu", cpu_kernels=False, quantization="bf16")
    with pytest.raises(ValueError, match="kernel_activations: float32 cannot serve bf16"):
        load_model(path, torch.float32, "cpu", quantization="bf16", kernel_activations="float32")


@needs_kernel
@pytest.mark.parametrize(
    "quantization, tied, intermediate, stored",
    [("bf16", True, 128, torch.bfloat16), ("bf16", False, 128, torch.bfloat16),
     ("int8", False, 128, torch.bfloat16), ("bf16", True, 100, torch.bfloat16),
     ("bf16", False, 128, torch.float32), ("int8", True, 128, torch.float32)],
)  # fmt: skip
def test_quantized_loads_never_hold_the_matmuls_in_float32(
    tmp_path, monkeypatch, quantization, tied, intermediate, stored
):
    """A checkpoint loaded for bf16 (or int8) weights: every matmul weight the kernels take
    is copied into a bf16 tensor, never a float32 one (the load's peak was the float32
    model: twice a bf16 checkpoint) — for int8 only where the checkpoint is 16-bit (exact);
    a float32 one is rounded to bf16 on the copy only for bf16 weights — and the kernels
    hold what the float32 load packed (from_dense_bf16 / quantize_int8 of the same weights,
    bit for bit). A width the kernels do not take (intermediate 100: down's K % 32) stays
    float32 on torch's GEMM."""
    if quantization == "bf16" and not gemm.bf16_available():
        pytest.skip("needs a CPU with AVX512-BF16 (vdpbf16ps)")
    from tinyserve.layers import linear
    from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf

    hf = build_hf(llama_config(tie_word_embeddings=tied, intermediate_size=intermediate))
    path = save_hf(hf.to(stored), tmp_path / "llama")
    fp32, _ = load_model(path, torch.float32, "cpu")
    plain, _ = load_model(path, torch.float32, "cpu", cpu_kernels=False)  # weights as loaded
    copies: list[tuple[torch.dtype, int]] = []
    real_copy = linear.copy_weight

    def copy_weight(dest, src, sliced=False):
        if dest.dim() == 2:
            copies.append((dest.dtype, dest.shape[1]))
        real_copy(dest, src, sliced)

    monkeypatch.setattr(linear, "copy_weight", copy_weight)
    net, _ = load_model(path, torch.float32, "cpu", quantization=quantization)
    monkeypatch.undo()
    narrow = torch.float32 if quantization == "int8" and stored == torch.float32 else torch.bfloat16
    assert copies and {t for t, k in copies if k % 32 == 0} == {narrow}
    assert {t for t, k in copies if k % 32} == ({torch.float32} if intermediate % 32 else set())
    pack = gemm.from_dense_bf16 if quantization == "bf16" else gemm.quantize_int8
    for name, layer in net.linear_layers().items():
        want = plain.linear_layers()[name].weight.detach()
        if want.shape[1] % 32:
            assert linear.on_torch(layer) and torch.equal(layer.weight, want), name
            continue
        got, ref = layer.method.kernel, pack(want).kernel
        assert torch.equal(got.qs, ref.qs) and (got.d is None or torch.equal(got.d, ref.d)), name
    ids = torch.arange(40)
    rows = net.model.embed_tokens(ids)
    want = fp32.model.embed_tokens(ids)  # bf16 weights: the table in bf16 (hold_bf16)
    want = want.to(torch.bfloat16).float() if quantization == "bf16" else want
    assert rows.dtype == torch.float32 and torch.equal(rows, want)
    gap = logits_gap(fp32, net)
    assert 0 < gap < 0.05, gap


@needs_bf16
def test_an_untied_gguf_table_is_held_in_bf16_beside_bf16_weights(tmp_path):
    """--quantization bf16 on a GGUF with an untied head: the embedding's table (not a head,
    so never on the kernels) is held in bf16 as before, its rows the float32 table's rounded."""
    from tinyserve.testing.checkpoints import build_hf, llama_config
    from tinyserve.testing.gguf_writer import write_gguf

    path = tmp_path / "untied.gguf"
    write_gguf(build_hf(llama_config(tie_word_embeddings=False)), path, {"ffn_up": "Q8_0"})
    net, _ = load_model(path, torch.float32, quantization="bf16")
    ref, _ = load_model(path, torch.float32)
    assert net.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.arange(50)
    want = ref.model.embed_tokens(ids).to(torch.bfloat16).float()
    assert torch.equal(net.model.embed_tokens(ids), want)

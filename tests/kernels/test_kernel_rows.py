"""Embedding rows read from a weight in gemm.c's layout (kernels/rows.py: a tied LM head's
kernel copy serves as the table): ops.c's kernel_rows and its torch reference both equal the
rows of the weight the loader held (PackedWeight.dequantize: bf16 and float32 as they are,
Q8_0 d * q, Q4_1 d * q + m), for every kind, a padded last group, repeated ids; and through
the loader a tied head's table is not held while the model's lookups give the same rows."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels import gemm, ops
from tinyserve.kernels.rows import kernel_rows, kernel_rows_reference
from tinyserve.models.loader import load_model

needs_kernels = pytest.mark.skipif(
    not gemm.available() or ops.library() is None, reason="needs the CPU kernels (x86, AVX2)"
)


def _weights(n: int, k: int) -> dict[str, gemm.PackedWeight]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g)
    q41 = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    return {
        "f32": gemm.from_dense(w),
        "bf16": gemm.from_dense_bf16(w),
        "q8_0": gemm.quantize_int8(w),
        "q4_1": gemm.PackedWeight(
            gemm.Q4_1,
            q41,
            torch.rand(n, k // 32, generator=g),
            torch.randn(n, k // 32, generator=g),
            (n, k),
        ),  # fmt: skip
    }


@needs_kernels
@pytest.mark.parametrize("width", [8, 16])  # AVX2's and AVX-512's group widths
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0", "q4_1"])
def test_kernel_rows_equal_the_held_weights_rows(kind, width):
    n, k = 203, 96  # 203 outputs: a padded last group at either group width
    pw = _weights(n, k)[kind]
    kw = gemm.KernelWeight.of(pw, width)
    ids = torch.tensor([0, 202, 5, 5, 17, 200, 1, 16, 15, 31, 32, 191, 192])
    want = pw.dequantize()[ids]
    for rows in (kernel_rows, kernel_rows_reference):
        got = rows(kw, ids)
        assert got.dtype == torch.float32 and torch.equal(got, want), rows.__name__
        assert torch.equal(rows(kw, ids.view(13, 1)), want.view(13, 1, k))  # F.embedding's shape
        for bad in (-1, n, 207):  # (207: in the padded last group's zeros)
            with pytest.raises(IndexError, match="outside"):
                rows(kw, torch.tensor([3, bad]))
    assert torch.equal(kernel_rows(kw, ids[:1]), want[:1])  # a decode step's one row
    assert kernel_rows(kw, ids[:0]).shape == (0, k)


def test_a_gguf_loads_on_torch_where_the_kernels_are_not_built(tmp_path, monkeypatch):
    """Without the kernels (another CPU, no compiler) a GGUF's blocks are dequantised and
    served by torch's GEMM, the table held and read as before (no head kernel to read)."""
    from tinyserve.layers.linear import on_torch
    from tinyserve.testing.checkpoints import build_hf, llama_config
    from tinyserve.testing.gguf_writer import write_gguf

    path = tmp_path / "q.gguf"
    write_gguf(build_hf(llama_config()), path, {"token_embd": "Q8_0", "attn_q": "Q4_1"})
    monkeypatch.setattr(gemm, "available", lambda: False)
    net, _ = load_model(path, torch.float32)
    assert all(on_torch(m) for m in net.linear_layers().values())
    assert net.model.embed_tokens.rows_from is None and net.model.embed_tokens.weight.numel()


@needs_kernels
def test_a_tied_gguf_head_serves_the_lookup_and_its_table_is_freed(tmp_path):
    """A tied Llama GGUF with Q8_0 token_embd (as SmolLM2's): its head on the kernels, the
    embedding's rows read from the head's blocks (no table held), the same rows and logits
    as the torch load that holds the dequantised table."""
    from tinyserve.testing.checkpoints import build_hf, llama_config, random_tokens
    from tinyserve.testing.gguf_writer import write_gguf
    from tinyserve.testing.paged_runner import PagedRunner

    hf = build_hf(llama_config(tie_word_embeddings=True))
    path = tmp_path / "tied.gguf"
    write_gguf(hf, path, {"token_embd": "Q8_0"})
    net, _ = load_model(path, torch.float32, kernel_activations="float32")
    embed = net.model.embed_tokens
    assert embed.rows_from is not None and embed.weight.numel() == 0
    ref, _ = load_model(path, torch.float32, cpu_kernels=False)
    ids = torch.arange(net.config.vocab_size)
    assert torch.equal(embed(ids), ref.model.embed_tokens(ids))
    tokens = random_tokens(12, seed=4)
    got = PagedRunner(net, 16, num_blocks=8).step([("s", tokens)])[0]
    want = PagedRunner(ref, 16, num_blocks=8).step([("s", tokens)])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

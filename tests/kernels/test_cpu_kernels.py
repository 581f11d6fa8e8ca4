"""The CPU kernels (tinyserve/kernels): block parsing equals the gguf package's
dequantisation; the matmul equals a float64 reference on those weights for every weight
kind; each output is bitwise the same whatever the row count, tiling and thread count (the
batch-invariance contract); int8 stays within its stated bound; the block-table attention
equals the reference attention; SmolLM2's logits through the kernels stay within float
rounding of the torch path."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from tests.support.kernels import logits_gap, random_blocks, tp1, typed
from tinyserve.kernels import attention as attention_kernel
from tinyserve.kernels import build, gemm
from tinyserve.layers.attention import reference_paged_attention
from tinyserve.layers.linear import PackedMethod
from tinyserve.models.loader import load_model
from tinyserve.testing.paged_runner import PagedRunner, mixed_steps, random_paged_case

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


needs_kernel = pytest.mark.skipif(
    not gemm.available(), reason="needs an x86 CPU with AVX2/FMA/F16C and a C compiler"
)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_blocks_dequantise_like_the_gguf_package(qtype):
    raw = random_blocks(qtype, 37, 96, seed=1)
    qw = gemm.from_gguf(raw, int(qtype), (37, 96))
    want = torch.from_numpy(dequantize(raw, qtype).reshape(37, 96).astype(np.float32))
    assert torch.equal(qw.dequantize(), want)


@needs_kernel
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_equals_dense_fp32(qtype, rows, threads):
    n, k = 203, 320  # n not a multiple of anything; k = 10 blocks
    qw = gemm.from_gguf(random_blocks(qtype, n, k, seed=rows), int(qtype), (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = (x.double() @ qw.dequantize().double().T).float()
    got = gemm.matmul(x, qw, num_threads=threads)
    assert got.shape == (rows, n)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
def test_take_rows_and_cat_rows_keep_rows_with_their_blocks():
    a = gemm.from_gguf(random_blocks(Q4_1, 8, 64, 2), int(Q4_1), (8, 64))
    b = gemm.from_gguf(random_blocks(Q4_1, 4, 64, 3), int(Q4_1), (4, 64))
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    fused = gemm.cat_rows([a.take_rows(order), b])
    want = torch.cat([a.dequantize()[order], b.dequantize()])
    assert torch.equal(fused.dequantize(), want)
    x = torch.randn(2, 64)
    assert torch.allclose(gemm.matmul(x, fused), x @ want.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f32", "int8"])
@pytest.mark.parametrize("n", [8, 203])
@pytest.mark.parametrize("gw", [8, 16])
def test_kernel_layout_groups_outputs_by_the_vector_width(kind, n, gw):
    """gemm.c's layout holds exactly the checkpoint's codes, scales and minima: every output
    gw*g + c is lane c of group g (gw = 8 for AVX2, 16 for AVX-512), and the padding of the
    last group is zero."""
    k = 96
    w = packed_weight(kind, n, k, seed=n)
    kw = gemm.KernelWeight.of(w, gw)
    groups = (n + gw - 1) // gw
    assert kw.qs.shape[0] == groups and kw.qs.shape[-1] == gw and kw.shape == w.shape
    for c in range(n):
        g, lane = divmod(c, gw)
        if kind == "q4_1":  # [G, K/32, 16, gw]: byte p of each block
            assert torch.equal(kw.qs[g, ..., lane], w.qs[c])
        elif kind == "f32":  # [G, K, gw]
            assert torch.equal(kw.qs[g, :, lane], w.qs[c])
        else:  # [G, K/32, 32, gw]
            assert torch.equal(kw.qs[g, ..., lane].reshape(k), w.qs[c])
        for name in ("d", "m"):
            a, b = getattr(w, name), getattr(kw, name)
            assert (a is None and b is None) or torch.equal(b[g, :, lane], a[c]), name
    pad = groups * gw - n
    for t in (kw.qs, kw.d, kw.m):
        if t is not None and pad:
            assert not t[-1, ..., gw - pad :].any()


@needs_kernel
def test_the_built_gemm_reads_its_own_group_width():
    want = 8 if build.isa_level() == "avx2" else 16
    assert gemm.group_width() == want
    assert packed_weight("q4_1", 40, 64, seed=1).kernel.qs.shape[-1] == want


def test_isa_level_can_be_lowered_by_name_but_not_raised(monkeypatch):
    usable = build.usable_levels()
    monkeypatch.setenv("TINYSERVE_CPU_ISA", "avx2")
    assert build.isa_level() == ("avx2" if "avx2" in usable else (usable or [None])[0])
    monkeypatch.setenv("TINYSERVE_CPU_ISA", next(iter(build.ISA_LEVELS)))  # the highest
    assert build.isa_level() == (usable or [None])[0]  # the best there is, never more
    for level in usable:
        monkeypatch.setenv("TINYSERVE_CPU_ISA", level)
        assert build.isa_level() == level
    monkeypatch.setenv("TINYSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="TINYSERVE_CPU_ISA"):
        build.isa_level()


def test_packed_method_keeps_the_checkpoint_layout_only_for_int8_decode():
    w = packed_weight("q4_1", 16, 64, seed=3)
    assert PackedMethod(w).packed is None  # the blocks are held once, in gemm.c's layout
    assert PackedMethod(w, int8_decode=True).packed is w


def packed_weight(kind: str, n: int, k: int, seed: int) -> gemm.PackedWeight:
    if kind == "q4_1":
        return gemm.from_gguf(random_blocks(Q4_1, n, k, seed), int(Q4_1), (n, k))
    if kind == "q8_0":
        return gemm.from_gguf(random_blocks(Q8_0, n, k, seed), int(Q8_0), (n, k))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return gemm.from_dense(w) if kind == "f32" else gemm.quantize_int8(w)


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f32", "int8"])
def test_every_kind_matches_the_reference_and_is_batch_invariant(kind):
    n, k = 203, 320
    w = packed_weight(kind, n, k, seed=7)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(8))
    want = (x.double() @ w.dequantize().double().T).float()
    full = gemm.matmul(x, w, num_threads=2)
    assert (full - want).abs().max() <= 1e-5 * want.abs().max()
    # Any leading slice of the rows (1: decode tiles; 2..8: few-row tiles, each row count
    # its own specialisation; 7..16: pieces of 3-5 rows on AVX2 (gemm.c few_rows_piece),
    # panel tiles on AVX-512 from 9; then panel tiles with remainders; > 48: several
    # panels), any thread count: bitwise the same rows.
    for rows in (*range(1, 18), 33, 49, 64):
        for threads in (1, 2):
            assert torch.equal(gemm.matmul(x[:rows], w, num_threads=threads), full[:rows])
    # A row's result does not depend on which rows come before it either.
    assert torch.equal(gemm.matmul(x[37:38], w), full[37:38])


needs_two_levels = pytest.mark.skipif(
    not gemm.available() or len(build.usable_levels()) < 2,
    reason="needs a CPU with AVX-512 F/BW/VL/DQ besides AVX2 (and cc) to compare the builds",
)


@pytest.fixture(scope="module")
def every_level():
    """{(name, level): library} for gemm.c and qgemm.c at every ISA level this CPU runs,
    through the kernel cache (build.built), the ~30 s gemm.c compiles run side by side: once
    per machine, not once per test."""
    from concurrent.futures import ThreadPoolExecutor

    keys = [(name, level) for level in build.usable_levels() for name in ("gemm", "qgemm")]
    # gemm.c has no VNNI code: its avx512_vnni build is the avx512 one byte for byte (checked
    # on a Zen 4), so where both run that ~30 s compile is made once.
    no_vnni = b"VNNI" not in build.source_bytes("gemm")

    def lib_key(key):
        return ("gemm", "avx512") if no_vnni and key == ("gemm", "avx512_vnni") else key

    builds = sorted({lib_key(key) for key in keys})
    with ThreadPoolExecutor(max_workers=max(1, build.kernel_threads())) as pool:
        paths = dict(zip(builds, pool.map(lambda key: build.built(*key), builds), strict=True))
    return {key: ctypes.CDLL(str(paths[lib_key(key)])) for key in keys}


@needs_two_levels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f32", "int8"])
def test_every_isa_level_computes_the_same_bits(kind, every_level):
    """The AVX2 build (8 lanes) and the AVX-512 builds (16 lanes, other tiles) do the same
    float operations per output, so a server's logits do not depend on which of them this
    CPU picked; qgemm.c's VNNI dot products give maddubs/madd's integers."""
    n, k = 203, 320
    w = packed_weight(kind, n, k, seed=11)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(12))
    native = gemm.matmul(x, w, num_threads=2)
    native_q8 = gemm.matmul_q8(x, w, num_threads=2) if kind != "f32" else None
    for level in build.usable_levels():
        lib = every_level["gemm", level]
        fn = typed(lib, "gemm")
        kw = gemm.KernelWeight.of(w, lib.gemm_group_width())
        assert kw.qs.shape[-1] == (8 if level == "avx2" else 16)
        qfn = typed(every_level["qgemm", level], "qgemm") if native_q8 is not None else None
        for rows in (1, 2, 3, 5, 7, 8, 9, 33, 70):
            for threads in (1, 2):
                got = gemm._run(fn, "matmul", x[:rows], kw, threads, None)
                assert torch.equal(got, native[:rows]), (level, rows, threads)
                if qfn is not None:
                    got = gemm._run(qfn, "matmul_q8", x[:rows], w, threads, None)
                    assert torch.equal(got, native_q8[:rows]), ("q8", level, rows, threads)


needs_q8 = pytest.mark.skipif(
    not gemm.q8_available(), reason="needs an x86 CPU with AVX2/FMA/F16C and a C compiler"
)


@needs_q8
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_int8_activation_kernel_equals_its_reference_and_is_batch_invariant(qtype):
    """qgemm.c: x rounded per row and block of 32 (gemm.quantize_activations, the kernel's
    rounding spelled in torch), then exact integer dots: equals the float64 product of the
    rounded x and the dequantised weight to float32 accumulation, stays within the stated
    rounding bound of the unrounded product, and is bitwise the same for any row count,
    position in the batch and thread count."""
    n, k, m = 203, 320, 100
    w = gemm.from_gguf(random_blocks(qtype, n, k, seed=5), int(qtype), (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)) * 3
    x[7] = 0.0  # an all-zero row: scale 0, no division by zero
    x[9, :32] = 0.0  # and an all-zero block
    qx, dx = gemm.quantize_activations(x)
    assert qx.abs().max() <= 127 and torch.equal(qx, qx.round())
    rounded = (qx.view(m, k // 32, 32) * dx[..., None]).view(m, k)
    want = rounded.double() @ w.dequantize().double().T
    full = gemm.matmul_q8(x, w, num_threads=2)
    assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(full[7], torch.zeros(n))
    exact = x.double() @ w.dequantize().double().T
    err = (full.double() - exact).abs()
    assert (err <= gemm.q8_error_bound(x, w) + 1e-5 * exact.abs().max()).all()
    assert err.max() > 0  # the rounding is real: this is not the float kernel
    for rows in (1, 2, 3, 4, 5, 9, 33, 64, 99):
        for threads in (1, 2):
            assert torch.equal(gemm.matmul_q8(x[:rows], w, num_threads=threads), full[:rows])
    assert torch.equal(gemm.matmul_q8(x[41:42], w), full[41:42])
    with pytest.raises(ValueError, match="no integer kernel"):
        gemm.matmul_q8(x, gemm.from_dense(torch.randn(8, k)))


@needs_q8
def test_packed_method_sends_decode_rows_to_the_int8_kernel_and_prompt_rows_to_float():
    from tinyserve.layers.linear import LinearBase

    w = gemm.from_gguf(random_blocks(Q4_1, 70, 96, seed=9), int(Q4_1), (70, 96))
    layer = LinearBase(96, 70, bias=False, dtype=torch.float32, tp=tp1())
    layer.set_method(PackedMethod(w, int8_decode=True))
    assert layer.method.name == "kernel-q4_1+int8-decode"
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(10))
    y = layer(x, num_decode=2)
    assert torch.equal(y[:2], gemm.matmul_q8(x[:2], w))
    assert torch.equal(y[2:], gemm.matmul(x[2:], w))
    assert torch.equal(layer(x), gemm.matmul(x, w))  # no decode rows: all float
    assert torch.equal(layer(x, num_decode=6), gemm.matmul_q8(x, w))
    # A float weight has no integer kernel: the flag does not apply to it.
    assert PackedMethod(gemm.from_dense(torch.randn(8, 96)), int8_decode=True).name == "kernel-f32"


@needs_kernel
def test_int8_per_channel_error_bound():
    """Weight-only int8, one scale per output channel: |w - w_q| <= s / 2 with
    s = max|w_row| / 127, so |y - y_q| <= (s / 2) * sum|x|. Checked per output."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    q = gemm.quantize_int8(w)
    scale = w.abs().amax(dim=1) / 127
    assert ((q.dequantize() - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    err = (gemm.matmul(x, q) - x @ w.T).abs()
    bound = x.abs().sum(dim=1, keepdim=True) * scale[None, :] / 2
    assert (err <= bound + 1e-4).all()


needs_attention_kernel = pytest.mark.skipif(
    attention_kernel.library() is None, reason="needs an x86 CPU with AVX2/FMA and a C compiler"
)


@needs_attention_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [(9, 3, 64, 16), (4, 2, 16, 4), (4, 4, 32, 1), (8, 1, 128, 8), (20, 1, 16, 4)],
)
def test_block_table_attention_matches_the_reference(heads, kv_heads, dim, block_size):
    from tinyserve.layers.attention import AttentionMetadata, paged_attention

    # Contexts of one key to several 64-key chunks (the kernel's split), rows on both sides
    # of a chunk boundary (64 / 65 keys), a run of 16 rows (two 8-row groups).
    query_lens = [1, 1, 7, 1, 16, 3, 2]
    seq_lens = [1, 37, 140, 2 * block_size, 200, 3 * block_size + 1, 65]
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, block_size, query_lens,
                                           seq_lens, seed=heads)  # fmt: skip
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, use_kernel=True)
    assert meta.kernel is not None and meta.groups == []  # no padded masks built
    got = paged_attention(q, kc, vc, meta, dim**-0.5)
    want = reference_paged_attention(q, kc, vc, query_lens, seq_lens, tables, dim**-0.5)
    assert (got - want).abs().max() < 1e-5
    # Each sequence alone gives bitwise the same rows as in the batch.
    start = 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        alone = AttentionMetadata.build([ql], [sl], [tables[i]], block_size, use_kernel=True)
        out = paged_attention(q[start : start + ql], kc, vc, alone, dim**-0.5)
        assert torch.equal(out, got[start : start + ql])
        start += ql


@needs_attention_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("run,seq_len", [(13, 70), (13, 80), (5, 130)])
def test_each_row_of_a_run_is_bitwise_that_row_alone_at_every_isa_level(kv_dtype, run, seq_len):
    """Speculation's greedy identity rests on this: a verification run's row at position p
    (rows of one sequence read each chunk's keys and values together, several queries a
    pass) gives bitwise what a decode row at p alone gives, on either side of a chunk
    boundary and where a row's keys in a chunk end on a multiple of 8 before a later row's,
    and the AVX2 build (one query a pass) gives the AVX-512 build's bits."""
    from concurrent.futures import ThreadPoolExecutor

    heads, kv_heads, dim, bs = 9, 3, 64, 16
    q, kc, vc, tables = random_paged_case(heads, kv_heads, dim, bs, [run], [seq_len], seed=5)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    levels = build.usable_levels()
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda lv: build.built("attention", lv), levels))
    libs = [attention_kernel.typed(ctypes.CDLL(str(path))) for path in paths]

    def attend(lib, rows: torch.Tensor, last: int) -> torch.Tensor:
        """rows [n, heads, dim]: one sequence's queries at positions last-n+1 .. last."""
        n = rows.shape[0]
        return attention_kernel.paged_attention(
            rows, kc, vc, torch.tensor([0, n]), torch.tensor([last + 1]),
            torch.zeros(n, dtype=torch.int64), torch.tensor(tables, dtype=torch.int32),
            dim**-0.5, lib=lib,
        )  # fmt: skip

    together = attend(libs[0], q, seq_len - 1)
    want = reference_paged_attention(q, kc.float(), vc.float(), [run], [seq_len], tables,
                                     dim**-0.5)  # fmt: skip
    assert (together - want).abs().max() < 1e-5
    for lib in libs:
        assert torch.equal(attend(lib, q, seq_len - 1), together)
        for i in range(run):
            alone = attend(lib, q[i : i + 1], seq_len - run + i)
            assert torch.equal(alone[0], together[i]), i


@needs_kernel
def test_smollm2_logits_through_the_kernels_and_through_torch(smollm2_gguf_path):
    with_k, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", kernel_activations="float32")
    without, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", cpu_kernels=False)
    layers = with_k.linear_layers()
    assert len(layers) == 4 * with_k.config.num_hidden_layers + 1  # 4 per layer + LM head
    kinds = {name: layer.method.name for name, layer in layers.items()}
    assert all(isinstance(layer.method, PackedMethod) for layer in layers.values())
    assert kinds["model.embed_tokens"] == "kernel-q8_0"  # the tied head, from its own blocks
    assert {kinds[n] for n in kinds if n.startswith("model.layers.")} == {"kernel-q4_1"}
    assert with_k.attention_backend == "kernel"
    assert without.attention_backend == "torch"
    assert {layer.method.name for layer in without.linear_layers().values()} == {"dense"}
    tokens = list(range(200, 236))
    a = PagedRunner(with_k, 16).prefill_then_decode(tokens, 20)
    b = PagedRunner(without, 16).prefill_then_decode(tokens, 20)
    assert (a - b).abs().max() < 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("TINYSERVE_CPU_KERNELS", "0")
    build.load.cache_clear()
    gemm.library.cache_clear()
    try:
        assert not gemm.available()
    finally:
        monkeypatch.delenv("TINYSERVE_CPU_KERNELS")
        build.load.cache_clear()
        gemm.library.cache_clear()


needs_ops = pytest.mark.skipif(
    __import__("tinyserve.kernels.ops", fromlist=["library"]).library() is None,
    reason="needs an x86 CPU with AVX2/FMA and a C compiler",
)


@needs_ops
def test_fused_residual_rms_norm_and_silu_and_mul_match_torch_row_by_row():
    import torch.nn.functional as F

    from tinyserve.kernels import ops

    gen = torch.Generator().manual_seed(11)
    x, res, w = (
        torch.randn(21, 576, generator=gen),
        torch.randn(21, 576, generator=gen),
        torch.randn(576, generator=gen),
    )
    want = F.rms_norm((x + res).double(), (576,), w.double(), 1e-5)
    summed = res.clone()
    got = ops.rms_norm(x, w, 1e-5, summed)
    assert torch.equal(summed, x + res)  # the residual stream gets the same fp32 sum
    assert (got - want).abs().max() < 1e-5
    plain = ops.rms_norm(x, w, 1e-5)
    assert (plain - F.rms_norm(x.double(), (576,), w.double(), 1e-5)).abs().max() < 1e-5
    gate_up = torch.randn(21, 2 * 1536, generator=gen) * 4
    act = ops.silu_and_mul(gate_up)
    ref = F.silu(gate_up[:, :1536].double()) * gate_up[:, 1536:].double()
    assert (act - ref).abs().max() <= 1e-6 * ref.abs().max()
    for i in (0, 7, 20):  # each row alone: bitwise the same as in the batch
        assert torch.equal(ops.rms_norm(x[i : i + 1], w, 1e-5), plain[i : i + 1])
        assert torch.equal(ops.silu_and_mul(gate_up[i : i + 1].contiguous()), act[i : i + 1])


@needs_ops
def test_head_norm_matches_torch_per_head_and_leaves_v_alone():
    """Qwen3's q/k norm (ops.c head_norm) on fused qkv rows: each q head with q's weight, each
    k head with k's, within float32 rounding of a float64 reference; v untouched; rows
    independent (batch invariance)."""
    import torch.nn.functional as F

    from tinyserve.kernels import ops

    H, KVH, D, T = 4, 2, 32, 19
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen) * 3
    qw, kw = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    got = qkv.clone()
    ops.head_norm(got, qw, kw, H, KVH, 1e-6)
    heads = qkv.double().view(T, H + 2 * KVH, D)
    want = torch.cat([F.rms_norm(heads[:, :H], (D,), qw.double(), 1e-6),
                      F.rms_norm(heads[:, H : H + KVH], (D,), kw.double(), 1e-6),
                      heads[:, H + KVH :]], dim=1).view(T, -1)  # fmt: skip
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(got[:, (H + KVH) * D :], qkv[:, (H + KVH) * D :])
    one = qkv[7:8].clone()
    ops.head_norm(one, qw, kw, H, KVH, 1e-6)
    assert torch.equal(one, got[7:8])


@needs_kernel
def test_int8_quantization_of_a_float_checkpoint_stays_within_its_bound(tmp_path):
    """``--quantization int8`` on a safetensors checkpoint: every linear (LM head included)
    becomes int8 with per-channel scales; logits stay within 5% of the logit range of the
    float32 model (measured 1.8% on this random tiny Llama, whose weights are all of one
    scale; per weight the bound is s/2, tested above), through prefill and decode."""
    from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf

    path = save_hf(build_hf(llama_config()), tmp_path / "llama")
    fp32, _ = load_model(path, torch.float32, "cpu")
    int8, _ = load_model(path, torch.float32, "cpu", quantization="int8")
    assert {m.method.name for m in int8.linear_layers().values()} == {"kernel-q8_0"}
    assert {m.method.name for m in fp32.linear_layers().values()} == {"kernel-f32"}
    rel = logits_gap(fp32, int8)
    assert 0 < rel < 0.05, rel
    with pytest.raises(ValueError, match="quantization"):
        load_model(path, torch.float32, "cpu", quantization="int4")
    with pytest.raises(ValueError, match="quantization: int8 runs through the CPU kernels"):
        load_model(path, torch.float32, "cpu", cpu_kernels=False, quantization="int8")


def _kernel_threads_in_subprocess(env: dict, prefix: list[str] = ()) -> int:
    import os
    import subprocess
    import sys

    code = "from tinyserve.kernels.build import kernel_threads; print(kernel_threads())"
    out = subprocess.run([*prefix, sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout)


def test_kernel_threads_follow_the_usable_cpus_not_mkl_or_cpu_count():
    """``serve`` sets MKL_NUM_THREADS=1, which also makes torch report one thread: the kernels
    must still use every usable CPU (they ran single-threaded in the server: TPOT 60 ms
    against a 34 ms offline step). And a process pinned to one CPU gets one thread."""
    import os
    import shutil

    from tinyserve.utils.cpu import usable_cpus

    env = {"MKL_NUM_THREADS": "1", "TINYSERVE_KERNEL_THREADS": ""}
    assert _kernel_threads_in_subprocess(env) == usable_cpus() == len(os.sched_getaffinity(0))
    if shutil.which("taskset") and usable_cpus() > 1:
        assert _kernel_threads_in_subprocess(env, ["taskset", "-c", "0"]) == 1


needs_step = pytest.mark.skipif(
    __import__("tinyserve.kernels.step", fromlist=["library"]).library() is None,
    reason="needs an x86 CPU with AVX2/FMA/F16C and a C compiler",
)


@needs_step
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "granite", "smollm3"])
def test_layers_in_one_c_call_equal_the_python_loop_bitwise(tmp_path, arch):
    """kernels/step.c runs every layer in one call with the same kernels as llama.py's
    loop: the same numbers to the bit, for prefill chunks, decode rows and their mix (a tiny
    Llama; a Qwen2 whose q/k/v bias step.c adds itself; Qwen3's head norms, Granite's branch
    scale and SmolLM3's NoPE layer, each family's difference in step.c)."""
    from tinyserve.testing.checkpoints import build_hf, save_hf, tiny_config

    path = save_hf(build_hf(tiny_config(arch)), tmp_path / arch)
    fused, _ = load_model(path, torch.float32, "cpu")
    loop, _ = load_model(path, torch.float32, "cpu", fused_step=False)
    assert fused.model.step_plan is not None and loop.model.step_plan is None
    a = mixed_steps(PagedRunner(fused, 4, num_blocks=64, seed=1), random.Random(2))
    b = mixed_steps(PagedRunner(loop, 4, num_blocks=64, seed=1), random.Random(2))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# SmolLM2 through step.c with rounded activations: flags, whether this CPU can, the methods.
_BF16 = "+bf16" if gemm.bf16_available() else ""  # the default activations' suffix here
ROUNDED_STEP = {
    "int8-decode": ({"decode_activations": "int8"}, gemm.q8_available,
                    {f"kernel-q4_1{_BF16}+int8-decode", f"kernel-q8_0{_BF16}+int8-decode"}),
    "bf16": ({"kernel_activations": "bfloat16"}, gemm.bf16_available,
             {"kernel-q4_1+bf16", "kernel-q8_0+bf16"}),
}  # fmt: skip


@needs_step
@pytest.mark.parametrize("mode", list(ROUNDED_STEP))
def test_smollm2_one_c_call_equals_the_python_loop_with_rounded_activations(
    smollm2_gguf_path, mode
):
    """step.c passes each weight's int8-decode and bf16 flags: the same bits as the loop."""
    kwargs, available, names = ROUNDED_STEP[mode]
    if not available():
        pytest.skip(f"{mode} needs " + ("the AVX2 integer kernel" if mode == "int8-decode"
                                        else "a CPU with AVX512-BF16"))  # fmt: skip
    fused, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", **kwargs)
    loop, _ = load_model(smollm2_gguf_path, torch.float32, "cpu", fused_step=False, **kwargs)
    assert fused.model.step_plan is not None
    assert {m.method.name for m in fused.linear_layers().values()} == names
    a = mixed_steps(PagedRunner(fused, 16, num_blocks=32, seed=3), random.Random(4))
    b = mixed_steps(PagedRunner(loop, 16, num_blocks=32, seed=3), random.Random(4))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_no_c_step_without_the_kernels(tmp_path):
    from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf

    path = save_hf(build_hf(llama_config()), tmp_path / "llama")
    net, _ = load_model(path, torch.float32, "cpu", cpu_kernels=False)
    assert net.model.step_plan is None


@needs_step
def test_cache_pointers_follow_every_k_and_v_tensor(tmp_path):
    """The fused step's cached K/V pointer arrays are rebuilt when any cache tensor moves:
    engines sharing one model bring their own caches, and a new one's K tensors may sit where
    a freed one's did while its V tensors do not (the kernel then wrote freed memory)."""
    import ctypes

    from tinyserve.testing.checkpoints import build_hf, llama_config, save_hf

    path = save_hf(build_hf(llama_config()), tmp_path / "llama")
    plan = load_model(path, torch.float32, "cpu")[0].model.step_plan
    ks = [torch.zeros(4, 4, 2, 16) for _ in range(3)]
    first = [(k, torch.zeros_like(k)) for k in ks]
    second = [(k, torch.zeros_like(k)) for k in ks]  # the same K tensors, new V tensors
    for caches in (first, second, first):
        k_arr, v_arr = plan._cache_ptrs(caches)
        assert [ctypes.cast(k_arr, ctypes.POINTER(ctypes.c_void_p))[i] for i in range(3)] == [
            k.data_ptr() for k, _ in caches
        ]
        assert [ctypes.cast(v_arr, ctypes.POINTER(ctypes.c_void_p))[i] for i in range(3)] == [
            v.data_ptr() for _, v in caches
        ]

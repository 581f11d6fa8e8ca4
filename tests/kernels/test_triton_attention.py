"""The Triton paged decode-attention kernel (kernels/triton_attention.py) and its masked
torch fallback (layers/attention.py), against the float64 reference. On a CPU the kernel
runs under Triton's interpreter (the dev extras install Triton); with
``TINYSERVE_TEST_DEVICE=cuda`` it is compiled and runs on the GPU."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels import triton_attention
from tinyserve.layers.attention import (
    AttentionMetadata,
    paged_attention,
    reference_paged_attention,
    write_kv_cache,
)
from tinyserve.layers.decode_attention import masked_decode_attention

pytestmark = pytest.mark.device

# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2's 9/3 x 64, MHA, MQA, a head size
# that is not a power of two, blocks of 1 and 4 tokens.
SHAPES = [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 48, 16), (6, 1, 16, 4), (2, 1, 8, 1)]


def _case(num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed):
    """A cache of random K/V, sequences of ragged lengths (1, exact block multiples, and
    longer than one kernel tile) on shuffled blocks, one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [1, 7, block_size, 2 * block_size + 1, 70, 33]
    need = sum(-(-sl // block_size) for sl in seq_lens)
    num_blocks = need + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for sl in seq_lens:
        n = -(-sl // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    width = max(len(t) for t in tables) + 2  # wider than needed: columns past a length unused
    table_t = torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables],
                           dtype=torch.int32)  # fmt: skip
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    to = dict(device=device)
    return (q.to(**to), k_cache.to(**to), v_cache.to(**to), seq_lens, tables,
            torch.tensor(seq_lens, dtype=torch.int32, **to), table_t.to(**to))  # fmt: skip


def _rel_err(out, ref):
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _needs_triton(device):
    if not triton_attention.available(device):
        pytest.skip(f"Triton cannot run on {device} here (CUDA PyTorch ships it; the CPU "
                    "interpreter needs a process without CUDA)")  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_decode_matches_reference(shape, dtype, test_device):
    _needs_triton(test_device)
    q, kc, vc, seq_lens, tables, sl_t, tab_t = _case(*shape, dtype, test_device, seed=1)
    scale = shape[2] ** -0.5
    out = torch.full_like(q, float("nan"))  # every element must be written
    triton_attention.paged_decode_attention(q, kc, vc, sl_t, tab_t, scale, out=out)
    ref = reference_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), [1] * len(seq_lens),
                                    seq_lens, tables, scale)  # fmt: skip
    assert not out.isnan().any()
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_triton_decode_reads_strided_queries_and_small_tiles(test_device):
    """q as the model passes it (a head slice of the fused qkv rows), tiles of 16."""
    _needs_triton(test_device)
    q, kc, vc, seq_lens, tables, sl_t, tab_t = _case(9, 3, 64, 16, torch.float32,
                                                     test_device, seed=2)  # fmt: skip
    qkv = torch.randn(q.shape[0], 9 + 2 * 3, 64, device=q.device)
    qkv[:, :9] = q
    view = qkv[:, :9]
    assert not view.is_contiguous()
    out = triton_attention.paged_decode_attention(view, kc, vc, sl_t, tab_t, 0.125, block_n=16)
    ref = reference_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), [1] * len(seq_lens),
                                    seq_lens, tables, 0.125)  # fmt: skip
    assert _rel_err(out, ref) < 1e-5


def test_a_row_does_not_depend_on_the_rest_of_the_batch(test_device):
    _needs_triton(test_device)
    q, kc, vc, seq_lens, tables, sl_t, tab_t = _case(9, 3, 64, 16, torch.float32,
                                                     test_device, seed=3)  # fmt: skip
    batched = triton_attention.paged_decode_attention(q, kc, vc, sl_t, tab_t, 0.125)
    for i in range(q.shape[0]):
        alone = triton_attention.paged_decode_attention(
            q[i : i + 1], kc, vc, sl_t[i : i + 1], tab_t[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], batched[i])


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_masked_decode_fallback_matches_reference(shape, test_device):
    q, kc, vc, seq_lens, tables, sl_t, tab_t = _case(*shape, torch.float32, test_device, 4)
    scale = shape[2] ** -0.5
    out = masked_decode_attention(q, kc, vc, sl_t, tab_t, scale)
    ref = reference_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), [1] * len(seq_lens),
                                    seq_lens, tables, scale)  # fmt: skip
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("backend", ["triton", None])
def test_mixed_step_decode_rows_by_block_table(backend, test_device):
    """A step of decode rows and prefill chunks through paged_attention: with
    ``decode_backend="triton"`` the decode rows skip the masked rectangle; both match the
    reference, and the prefill rows are untouched by the choice."""
    if backend == "triton":
        _needs_triton(test_device)
    g = torch.Generator().manual_seed(5)
    bs, h, kvh, d = 4, 6, 2, 16
    query_lens, seq_lens = [1, 1, 5, 1, 3], [9, 1, 12, 17, 3]  # decode rows among prefill
    tables, nxt = [], 0
    for sl in seq_lens:
        n = -(-sl // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    kc = torch.zeros(nxt + 1, bs, kvh, d)
    vc = torch.zeros_like(kc)
    # The cached prefix, then this step's K/V through the slot mapping.
    for t, sl, ql in zip(tables, seq_lens, query_lens, strict=True):
        for p in range(sl - ql):
            kc[t[p // bs], p % bs] = torch.randn(kvh, d, generator=g)
            vc[t[p // bs], p % bs] = torch.randn(kvh, d, generator=g)
    tokens = sum(query_lens)
    q = torch.randn(tokens, h, d, generator=g)
    k_new, v_new = torch.randn(tokens, kvh, d, generator=g), torch.randn(tokens, kvh, d,
                                                                          generator=g)  # fmt: skip
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, decode_backend=backend)
    dev = torch.device(test_device)
    kc, vc = kc.to(dev), vc.to(dev)
    write_kv_cache(k_new.to(dev), v_new.to(dev), kc, vc, meta.slot_mapping.to(dev))
    from tinyserve.worker.staging import HostToDevice

    (meta,) = HostToDevice(dev, pack=dev.type != "cpu")([meta])
    decode_group = [gr for gr in meta.groups if gr.is_decode][0]
    assert (decode_group.attn_mask is None) == (backend is not None)
    out = paged_attention(q.to(dev), kc, vc, meta, d**-0.5)
    ref = reference_paged_attention(q, kc.cpu(), vc.cpu(), query_lens, seq_lens, tables,
                                    d**-0.5)  # fmt: skip
    assert _rel_err(out, ref) < 1e-5

"""The attention kernels' test helpers: a paged call from plain lists, and the float64
reference of the bf16-product contract (AMX tiles, attention_amx.h; AVX-512 BF16 dot
products, attention_dp.h)."""

from __future__ import annotations

import torch

from tinyserve.kernels import attention as attention_kernel


def attend(lib, q, kc, vc, query_lens, seq_lens, tables, scale, tiles=True, window=None):
    """paged_attention over ``tables`` (lists of block ids), rows of ``query_lens`` per
    sequence; ``lib`` None: this CPU's build; ``tiles``: the bf16-product entry points."""
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    sot = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    width = max(len(t) for t in tables)
    tb = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return attention_kernel.paged_attention(q, kc, vc, qsl, torch.tensor(seq_lens), sot, tb,
                                            scale, lib=lib, tiles=tiles,
                                            window=window)  # fmt: skip


def bf16_reference(q, kc, vc, query_lens, seq_lens, tables, scale, window=None):
    """The bf16-product contract (attention_amx.h, attention_dp.h) in float64: q, k, v rounded to bf16 (nearest even), the
    softmax weights rounded to bf16 before they weight the values and are summed; with a
    ``window``, over each query's last ``window`` keys."""

    def bf(t):
        return t.to(torch.bfloat16).double()

    kvh, d = kc.shape[2], kc.shape[3]
    out, row = [], 0
    for ql, sl, table in zip(query_lens, seq_lens, tables, strict=True):
        k = bf(kc[table].reshape(-1, kvh, d)[:sl])
        v = bf(vc[table].reshape(-1, kvh, d)[:sl])
        for i in range(ql):
            pos = sl - ql + i
            qi = bf(q[row + i])  # [H, D]
            g = qi.shape[0] // kvh
            lo = 0 if window is None else max(0, pos - window + 1)
            kk, vv = (
                k[lo : pos + 1].repeat_interleave(g, 1),
                v[lo : pos + 1].repeat_interleave(g, 1),
            )
            s = torch.einsum("hd,jhd->hj", qi, kk) * scale
            e = torch.exp(s - s.max(1, keepdim=True).values)
            p = e.float().to(torch.bfloat16).double()
            out.append(torch.einsum("hj,jhd->hd", p, vv) / p.sum(1, keepdim=True))
        row += ql
    return torch.stack(out)


def assert_rows_alone(lib, q, kc, vc, query_lens, seq_lens, tables, scale, batch, every=7,
                      window=None):  # fmt: skip
    """``batch`` (the call over every sequence) equals each sequence alone, and each
    ``every``-th row of a sequence equals that row as one decode row alone."""
    start = 0
    for ql, sl, table in zip(query_lens, seq_lens, tables, strict=True):
        alone = attend(
            lib, q[start : start + ql], kc, vc, [ql], [sl], [table], scale, window=window
        )
        assert torch.equal(alone, batch[start : start + ql])
        for i in range(0, ql, every):
            row = attend(lib, q[start + i : start + i + 1], kc, vc, [1], [sl - ql + i + 1],
                         [table], scale, window=window)  # fmt: skip
            assert torch.equal(row[0], batch[start + i])
        start += ql

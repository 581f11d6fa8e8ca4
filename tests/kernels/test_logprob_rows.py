"""ops.c's logprob_rows (the prompt-logprob path's per-row log-softmax value, rank and top-k in
two passes) against a float64 torch reference: values within 1e-5 (the sum of exp is kept in
double), ranks and top-k ids exact, ties broken toward the lower id, rows independent."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels import ops

needs_kernel = pytest.mark.skipif(
    ops.library() is None, reason="needs an x86 CPU with AVX2/FMA and a C compiler"
)


@needs_kernel
@pytest.mark.parametrize("V, k", [(49152, 1), (1003, 20), (37, 0), (8, 5)])
def test_logprob_rows_match_a_float64_reference(V, k):
    g = torch.Generator().manual_seed(V + k)
    logits = torch.randn(19, V, generator=g) * 6
    logits[3] = 0.0  # a flat row: every token ties
    targets = torch.randint(0, V, (19,), generator=g)
    lp, rank, top_ids, top_lp = ops.logprob_rows(logits, targets, k)
    ref = torch.log_softmax(logits.double(), -1)
    chosen = ref.gather(1, targets[:, None])[:, 0]
    assert (lp.double() - chosen).abs().max() <= 1e-5
    assert torch.equal(rank.long(), (ref > chosen[:, None]).sum(1) + 1)
    for r in range(19):
        order = sorted(range(V), key=lambda i: (-ref[r, i].item(), i))[:k]  # ties: lower id
        assert top_ids[r].tolist() == order, r
        if k:
            assert (top_lp[r].double() - ref[r, order]).abs().max() <= 1e-5
    # Rows are independent: a row alone gives the same bits.
    one = ops.logprob_rows(logits[7:8], targets[7:8], k)
    assert torch.equal(one[0], lp[7:8]) and torch.equal(one[2], top_ids[7:8])

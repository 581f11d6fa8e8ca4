"""Sampler vs a plain per-row reference (loops, obviously correct), plus statistical and
determinism checks. CPU, fast."""

from __future__ import annotations

import math

import pytest
import torch

from tinyserve.sampling_params import SamplingParams
from tinyserve.worker.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_logits_processors,
    compute_probs,
)

V = 64
CPU = torch.device("cpu")
NEG_INF = float("-inf")


# ---------------------------------------------------------------- reference (one row at a time)


def ref_processed_logits(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    x = logits.double().clone()
    for tok, val in (p.logit_bias or {}).items():
        x[tok] += val
    if len(row.output_token_ids) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
        for tok in banned:
            x[tok] = NEG_INF
    if p.repetition_penalty != 1.0:
        for tok in set(row.prompt_token_ids) | set(row.output_token_ids):
            if x[tok] > 0:
                x[tok] = x[tok] / p.repetition_penalty
            else:
                x[tok] = x[tok] * p.repetition_penalty
    for tok in set(row.output_token_ids):
        x[tok] -= p.frequency_penalty * row.output_token_ids.count(tok)
        x[tok] -= p.presence_penalty
    return x


def ref_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    x = processed.double() / params.temperature
    n = x.numel()
    if params.min_p > 0:
        probs = torch.softmax(x, -1)
        top = max(probs[i].item() for i in range(n))
        for i in range(n):
            if probs[i].item() < params.min_p * top:
                x[i] = NEG_INF
    if params.top_k > 0:
        order = sorted(range(n), key=lambda i: -x[i].item())
        for i in order[params.top_k :]:
            x[i] = NEG_INF
    if params.top_p < 1.0:
        probs = torch.softmax(x, -1)
        order = sorted(range(n), key=lambda i: -probs[i].item())
        kept, mass = set(), 0.0
        for i in order:
            kept.add(i)
            mass += probs[i].item()
            if mass >= params.top_p:
                break
        for i in range(n):
            if i not in kept:
                x[i] = NEG_INF
    return torch.softmax(x, -1)


# ------------------------------------------------------------------------------------ helpers


def make_row(params: SamplingParams, rng: torch.Generator | None = None, **kw) -> SamplingRow:
    if rng is None:
        rng = torch.Generator().manual_seed(0)
    prompt = kw.pop("prompt", torch.randint(0, V, (12,), generator=rng).tolist())
    output = kw.pop("output", torch.randint(0, V, (7,), generator=rng).tolist())
    return SamplingRow(params, prompt, output, **kw)


def sample(logits: torch.Tensor, rows: list[SamplingRow], device: str | torch.device = CPU):
    device = torch.device(device)
    meta = SamplingMetadata.build(rows, logits.shape[-1], device)
    return Sampler()(logits.to(device), meta), meta


def random_logits(b: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * scale


MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(
        temperature=0.9, repetition_penalty=0.8, presence_penalty=-0.7, frequency_penalty=1.1
    ),
    SamplingParams(temperature=0.7, logit_bias={3: 5.0, 17: -20.0}, top_k=100),
    SamplingParams(
        temperature=1.0, min_tokens=10, stop_token_ids=[5, 6], ignore_eos=True, top_p=0.95
    ),
    SamplingParams(temperature=1.0, min_tokens=10, stop_token_ids=[9]),
]


def mixed_rows() -> list[SamplingRow]:
    rng = torch.Generator().manual_seed(1)
    return [make_row(p, rng, eos_token_ids=(1, 2)) for p in MIXED_PARAMS]


# -------------------------------------------------------------------------------- the stages


@pytest.mark.device
def test_processors_match_reference(test_device):
    rows = mixed_rows()
    logits = random_logits(len(rows))
    meta = SamplingMetadata.build(rows, V, torch.device(test_device))
    got = apply_logits_processors(logits.clone().to(test_device), meta).cpu()
    for i, row in enumerate(rows):
        want = ref_processed_logits(logits[i], row).float()
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-5, atol=1e-5)


def test_min_tokens_masks_eos_and_stop_tokens():
    rows = mixed_rows()
    meta = SamplingMetadata.build(rows, V, CPU)
    got = apply_logits_processors(random_logits(len(rows)), meta)
    assert torch.isinf(got[8, [5, 6]]).all() and torch.isfinite(got[8, [1, 2]]).all()  # ignore_eos
    assert torch.isinf(got[9, [1, 2, 9]]).all()
    assert torch.isfinite(got[:8]).all()


def test_penalties_match_reference_with_repeats():
    rng = torch.Generator().manual_seed(7)
    rows = []
    for rep, freq, pres in [(1.5, 0.0, 0.0), (1.0, 0.9, 0.0), (1.0, 0.0, 1.5), (0.7, -0.4, 0.3)]:
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        # A small token range forces repeats; output lengths differ to exercise the padding.
        out = torch.randint(0, 8, (3 + 4 * len(rows),), generator=rng).tolist()
        rows.append(make_row(params, rng, prompt=[8, 9, 9, 10], output=out))
    rows.append(make_row(SamplingParams(temperature=0.0), rng))  # no penalty in the batch
    logits = random_logits(len(rows), seed=3)
    meta = SamplingMetadata.build(rows, V, CPU)
    got = apply_logits_processors(logits.clone(), meta)
    for i, row in enumerate(rows):
        want = ref_processed_logits(logits[i], row).float()
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[-1], logits[-1])


def test_compute_probs_matches_reference():
    rows = mixed_rows()
    logits = random_logits(len(rows), seed=5)
    meta = SamplingMetadata.build(rows, V, CPU)
    probs = compute_probs(apply_logits_processors(logits.clone(), meta), meta)
    for i, row in enumerate(rows):
        if row.params.greedy:
            continue
        want = ref_probs(ref_processed_logits(logits[i], row), row.params).float()
        assert torch.equal(probs[i] > 0, want > 0), i
        torch.testing.assert_close(probs[i], want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5, temperature=0.7),
        SamplingParams(min_p=0.3, temperature=1.5),
        SamplingParams(top_k=20, top_p=0.8, min_p=0.02),
    ],
)
def test_each_filter_matches_reference(params):
    logits = random_logits(16, seed=11)
    rows = [make_row(params) for _ in range(16)]
    meta = SamplingMetadata.build(rows, V, CPU)
    probs = compute_probs(apply_logits_processors(logits.clone(), meta), meta)
    for i in range(16):
        want = ref_probs(ref_processed_logits(logits[i], rows[i]), params).float()
        torch.testing.assert_close(probs[i], want, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------- greedy and near-greedy


def test_greedy_is_argmax_and_draws_no_randomness():
    logits = random_logits(6).to(torch.bfloat16)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    state = torch.get_rng_state()
    out, meta = sample(logits, rows)
    assert meta.all_greedy and meta.no_penalties
    assert torch.equal(torch.get_rng_state(), state)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_token_ids is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-9),  # 1 - p rounds to 1.0 in fp32
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=0.9, top_k=1, seed=3),
    ],
)
def test_degenerate_filters_equal_greedy(params):
    logits = random_logits(32, seed=2)
    out, _ = sample(logits, [make_row(params) for _ in range(32)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_and_random_rows_mixed():
    torch.manual_seed(0)
    rows = mixed_rows()
    logits = random_logits(len(rows), seed=9)
    out, meta = sample(logits, rows)
    processed = apply_logits_processors(logits.clone(), meta)
    for i, row in enumerate(rows):
        if row.params.greedy:
            assert out.sampled_token_ids[i] == processed[i].argmax()
        else:
            probs = ref_probs(ref_processed_logits(logits[i], row), row.params)
            assert probs[out.sampled_token_ids[i]] > 0


def test_logit_bias_forces_a_token():
    torch.manual_seed(0)
    logits = random_logits(16)
    rows = [make_row(SamplingParams(temperature=t, logit_bias={42: 100.0})) for t in (0, 1.5) * 8]
    out, _ = sample(logits, rows)
    assert (out.sampled_token_ids == 42).all()


def test_logit_bias_over_the_whole_vocabulary_matches_reference_and_is_built_once():
    """Every token biased (a client banning all but a few): the same logits as the
    reference, and the request's bias tensors made once, not per row and step (reading the
    dict per step made every other request ~5x slower)."""
    from tinyserve.worker.sampler import SamplingMetadata, apply_logits_processors

    logits = random_logits(3)
    V = logits.shape[1]
    bias = {t: float((t * 37) % 201 - 100) for t in range(V)}
    params = SamplingParams(temperature=0, logit_bias=bias)
    rows = [make_row(params), make_row(SamplingParams(temperature=0)), make_row(params)]
    meta = SamplingMetadata.build(rows, V, CPU)
    got = apply_logits_processors(logits.clone(), meta)
    for i, row in enumerate(rows):
        torch.testing.assert_close(got[i].double(), ref_processed_logits(logits[i], row))
    made = params.logit_bias_tensors
    again = SamplingMetadata.build(rows, V, CPU)
    assert made is not None and params.logit_bias_tensors is made  # the next step reuses them
    assert all(torch.equal(a, b) for a, b in zip(again.logit_bias, meta.logit_bias, strict=True))


def test_min_tokens_blocks_eos_until_reached():
    logits = random_logits(3)
    bias = {7: 100.0}  # EOS would win every time
    rows = [
        make_row(SamplingParams(temperature=0, logit_bias=bias, min_tokens=3), output=[4]),
        make_row(SamplingParams(temperature=0, logit_bias=bias, min_tokens=3), output=[4, 5, 6]),
        make_row(
            SamplingParams(temperature=1, logit_bias=bias, min_tokens=3, seed=1), output=[4, 5]
        ),
    ]
    for row in rows:
        row.eos_token_ids = (7,)
    out, _ = sample(logits, rows)
    assert out.sampled_token_ids[0] != 7
    assert out.sampled_token_ids[1] == 7
    assert out.sampled_token_ids[2] != 7


def test_input_logits_not_modified():
    rows = mixed_rows()
    logits = random_logits(len(rows))
    before = logits.clone()
    sample(logits, rows)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------- distributions


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    expected = probs.double() * n
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token with probability 0"
    stat = ((counts[support].double() - expected[support]) ** 2 / expected[support]).sum()
    return stat.item(), int(support.sum()) - 1


def _critical(df: int) -> float:
    # Wilson-Hilferty approximation of the chi-square 99.99% quantile (z = 3.72).
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2),
    ],
)
@pytest.mark.device
def test_sampling_frequencies_match_softmax(params, test_device):
    torch.manual_seed(1234)
    vocab, n = 12, 40_000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    row = SamplingRow(params, [0, 1, 1], [2, 3])
    out, _ = sample(base.expand(n, vocab).contiguous(), [row] * n, test_device)
    counts = torch.bincount(out.sampled_token_ids.cpu(), minlength=vocab)
    want = ref_probs(ref_processed_logits(base, row), params)
    stat, df = _chi_square(counts, want, n)
    assert stat < _critical(df), (stat, df, counts, want * n)


def test_seeded_draws_follow_softmax():
    vocab, n = 10, 4000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(temperature=1.0, seed=99)
    tokens = []
    for t in range(n):  # one request's positions 0 .. n-1: the noise is per position
        row = SamplingRow(params, [0], [0] * t)
        meta = SamplingMetadata.build([row], vocab, CPU)
        tokens.append(Sampler()(base.unsqueeze(0), meta).sampled_token_ids)
    counts = torch.bincount(torch.cat(tokens), minlength=vocab)
    stat, df = _chi_square(counts, torch.softmax(base.double(), -1), n)
    assert stat < _critical(df), (stat, counts)


# ------------------------------------------------------------------------------ determinism


def _step_logits(request: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * request + step)
    return torch.randn(V, generator=g) * 1.5


def _run(
    requests: list[tuple[int, SamplingParams]], steps: int, device: str = "cpu"
) -> dict[int, list[int]]:
    """Decode ``steps`` tokens for each (id, params) as the runner would: one build per
    step, each row's history its own outputs so far."""
    outputs: dict[int, list[int]] = {rid: [] for rid, _ in requests}
    sampler = Sampler()
    for step in range(steps):
        rows = [SamplingRow(p, [rid, rid + 1], list(outputs[rid]), (0,)) for rid, p in requests]
        logits = torch.stack([_step_logits(rid, step) for rid, _ in requests]).to(device)
        meta = SamplingMetadata.build(rows, V, torch.device(device))
        sampled = sampler(logits, meta).sampled_token_ids.tolist()
        for (rid, _), tok in zip(requests, sampled, strict=True):
            outputs[rid].append(tok)
    return outputs


@pytest.mark.device
def test_seed_is_independent_of_batch(test_device):
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95, frequency_penalty=0.3)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.2, top_k=10),
        SamplingParams(temperature=1.0, seed=1234),  # same seed, other params and logits
        SamplingParams(temperature=0.6, min_p=0.1, seed=5),
        SamplingParams(temperature=1.0, logprobs=3),
    ]
    steps = 12
    torch.manual_seed(0)
    alone = _run([(3, seeded)], steps, test_device)[3]
    torch.manual_seed(1)  # unseeded rows draw differently; the seeded one must not care
    batch = [(100 + i, p) for i, p in enumerate(others)]
    batch.insert(3, (3, seeded))
    together = _run(batch, steps, test_device)
    assert together[3] == alone
    torch.manual_seed(2)
    assert _run(list(reversed(batch)), steps, test_device)[3] == alone
    # Not vacuous: another seed takes another path.
    other_seed = SamplingParams(temperature=1.0, seed=4321, top_p=0.95, frequency_penalty=0.3)
    assert _run([(3, other_seed)], steps, test_device)[3] != alone


# ---------------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(0)
    rows = mixed_rows()
    rows[2].params = SamplingParams(temperature=1.3, top_p=0.7, logprobs=5)
    rows[5].params = SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=0)
    rows[7].params = SamplingParams(temperature=0.7, logit_bias={3: 50.0}, logprobs=2)
    logits = random_logits(len(rows)).to(torch.bfloat16)
    out, meta = sample(logits, rows)
    assert meta.max_num_logprobs == 5
    raw = torch.log_softmax(logits.float(), -1)
    want = raw.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, want)
    assert out.logprobs.dtype == torch.float32 and (out.logprobs <= 0).all()
    assert out.top_token_ids.shape == (len(rows), 5) and out.top_token_ids.dtype == torch.int64
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_token_ids))
    assert torch.equal(out.top_token_ids[:, 0], logits.float().argmax(-1))
    assert out.sampled_token_ids[7] == 3  # the bias steered sampling, not the logprobs
    assert out.logprobs[7] == raw[7, 3]


def test_logprobs_zero_gives_sampled_logprob_only():
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=0))]
    out, _ = sample(random_logits(1), rows)
    assert out.logprobs.shape == (1,)
    assert out.top_token_ids.shape == (1, 0)

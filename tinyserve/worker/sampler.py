"""Batched sampling: logits [B, V] -> one token per row, plus logprobs when asked.

Contract with the model runner:
- The runner builds one ``SamplingMetadata`` per step from the rows that sample (one row of the
  logits per request), then calls ``Sampler()(logits, meta)``. The sampler never calls
  ``.item()``/``.tolist()``: the runner does the single device->host copy of ``SamplerOutput``.
- A seeded row's noise is a function of (seed, position, token) only — counter-based, as
  JAX's and Philox-style generators are: an integer hash of the seed and the row's output
  position (``len(output_token_ids)``) gives a 32-bit key, and hashing the key with each token
  id gives V uniforms, computed on the logits' device (no host generator, no host->device
  copy of V values). Its tokens depend only on its seed and its own history, never on the
  batch, the step it lands in, preemption, or speculative decoding (a draft row at position
  t draws exactly what plain decoding draws at t).
- Logprobs are those of the RAW model logits (before bias, penalties, temperature), as vLLM
  returns by default.

Stage order (vLLM's): grammar bitmask (constrained rows; logprobs are then those of the masked
distribution, a masked token's LOGPROB_FLOOR) -> logit_bias -> min_tokens -> repetition /
frequency / presence penalties -> greedy argmax | temperature -> min_p -> top_k -> top_p ->
softmax -> exponential race.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.sampling_params import SamplingParams

# The least logprob reported: a token the grammar masked (log 0) reads this, as in vLLM.
LOGPROB_FLOOR = -9999.0
# q ~ Exp(1) may be exactly 0; a 0/0 would be NaN, which argmax treats as the maximum.
_MIN_EXP_NOISE = torch.finfo(torch.float32).tiny


@dataclass
class SamplingRow:
    """One row of the logits: one request that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # its length is the position sampled (the seeded noise's)
    eos_token_ids: tuple[int, ...] = ()
    # Constrained decoding: this row's allowed-token bitmask (int32 [ceil(V/32)]), or None.
    grammar_bitmask: torch.Tensor | None = None


@dataclass
class SamplingMetadata:
    """Per-step batched sampling state. Greedy rows carry neutral top_k/top_p/min_p values so
    the random-path stages can be skipped by flag; ``temperature == 0`` marks them."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    top_k: torch.Tensor  # [B] int64, V = off
    min_p: torch.Tensor  # [B] float32, 0.0 = off
    repetition_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    vocab_size: int
    # Sparse (rows, token ids, values): a dense [B, V] bias would cost B*V floats for a handful
    # of entries. Each (row, token) pair occurs at most once.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Sparse (rows, token ids) to set to -inf: EOS / stop tokens of rows below min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B, L] int64, padded with vocab_size; only rows that use them are filled.
    prompt_token_ids: torch.Tensor | None = None  # rows with repetition_penalty != 1
    output_token_ids: torch.Tensor | None = None  # rows with any penalty
    seeded_rows: torch.Tensor | None = None  # [S] int64: the random rows with a seed
    seed_keys: torch.Tensor | None = None  # [S] int64 32-bit keys of (seed, position)
    max_num_logprobs: int | None = None  # None: no row asked for logprobs
    # Constrained rows and their allowed-token bitmasks: ([k] int64, int32 [k, ceil(V/32)]).
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """``vocab_size`` is the width of the logits the sampler will get."""
        if not rows:
            raise ValueError("SamplingMetadata.build needs at least one row")
        V = vocab_size
        c = _Columns()
        for i, row in enumerate(rows):
            c.add(i, row, V)

        def f32(xs: list[float]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.float32, device=device)

        def i64(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        no_penalties = all(r == 1.0 for r in c.rep) and not any(c.freq) and not any(c.pres)
        return cls(
            temperature=f32(c.temperature),
            top_p=f32(c.top_p),
            top_k=i64(c.top_k),
            min_p=f32(c.min_p),
            repetition_penalty=f32(c.rep),
            frequency_penalty=f32(c.freq),
            presence_penalty=f32(c.pres),
            all_greedy=all(t == 0.0 for t in c.temperature),
            all_random=all(t != 0.0 for t in c.temperature),
            no_penalties=no_penalties,
            no_top_k=all(k == V for k in c.top_k),
            no_top_p=all(p == 1.0 for p in c.top_p),
            no_min_p=not any(c.min_p),
            vocab_size=V,
            logit_bias=c.logit_bias(device),
            min_tokens_mask=(i64(c.mask_rows), i64(c.mask_toks)) if c.mask_rows else None,
            prompt_token_ids=None if no_penalties else _pad(c.prompts, V, device),
            output_token_ids=None if no_penalties else _pad(c.outputs, V, device),
            seeded_rows=i64(c.seeded_rows) if c.seeded_rows else None,
            seed_keys=i64(c.seed_keys) if c.seeded_rows else None,
            max_num_logprobs=c.max_num_logprobs,
            grammar=(i64(c.grammar_rows), torch.stack(c.grammar_masks).to(device))
            if c.grammar_rows
            else None,
        )


class _Columns:
    """:meth:`SamplingMetadata.build`'s per-row values as Python lists, one row at a time."""

    def __init__(self) -> None:
        self.temperature, self.top_p, self.top_k, self.min_p = [], [], [], []
        self.rep, self.freq, self.pres = [], [], []
        self.bias: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (row, ids, values)
        self.mask_rows, self.mask_toks = [], []
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.seeded_rows: list[int] = []
        self.seed_keys: list[int] = []
        self.max_num_logprobs: int | None = None
        self.grammar_rows: list[int] = []
        self.grammar_masks: list[torch.Tensor] = []

    def add(self, i: int, row: SamplingRow, V: int) -> None:
        p = row.params
        is_greedy = p.temperature == 0.0
        self.temperature.append(float(p.temperature))
        self.top_p.append(1.0 if is_greedy else float(p.top_p))
        self.top_k.append(V if is_greedy or p.top_k <= 0 else min(int(p.top_k), V))
        self.min_p.append(0.0 if is_greedy else float(p.min_p))
        self.rep.append(float(p.repetition_penalty))
        self.freq.append(float(p.frequency_penalty))
        self.pres.append(float(p.presence_penalty))
        uses_rep = p.repetition_penalty != 1.0
        uses_output = uses_rep or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self.prompts.append(row.prompt_token_ids if uses_rep else [])
        self.outputs.append(row.output_token_ids if uses_output else [])
        if p.logit_bias:
            if p.logit_bias_tensors is None:  # once per request (SamplingParams says why)
                p.logit_bias_tensors = (torch.tensor(list(p.logit_bias), dtype=torch.int64),
                                        torch.tensor(list(p.logit_bias.values())))  # fmt: skip
            self.bias.append((i, *p.logit_bias_tensors))
        if len(row.output_token_ids) < p.min_tokens:
            stop = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop.update(row.eos_token_ids)
            for tok in sorted(stop):
                self.mask_rows.append(i)
                self.mask_toks.append(tok)
        if not is_greedy and p.seed is not None:
            self.seeded_rows.append(i)
            self.seed_keys.append(seed_key(p.seed, len(row.output_token_ids)))
        if p.logprobs is not None:
            self.max_num_logprobs = max(self.max_num_logprobs or 0, p.logprobs)
        if row.grammar_bitmask is not None:
            self.grammar_rows.append(i)
            self.grammar_masks.append(row.grammar_bitmask)

    def logit_bias(self, device: torch.device):
        """The rows' biases as SamplingMetadata.logit_bias (rows, token ids, values)."""
        if not self.bias:
            return None
        rows = torch.cat([torch.full((len(ids),), i, dtype=torch.int64) for i, ids, _ in self.bias])
        ids = torch.cat([ids for _, ids, _ in self.bias])
        vals = torch.cat([vals for _, _, vals in self.bias])
        return rows.to(device), ids.to(device), vals.to(device)


def _pad(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor(
        [s + [pad] * (width - len(s)) for s in seqs], dtype=torch.int64, device=device
    )  # [B, L]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of the sampled token
    top_token_ids: torch.Tensor | None = None  # [B, k] int64, best first
    top_logprobs: torch.Tensor | None = None  # [B, k] float32, descending


class Sampler:
    """Stateless; all per-request state arrives in ``SamplingMetadata``."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # A private fp32 copy: the stages below work in place.
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        if meta.grammar is not None:
            apply_grammar_bitmask(logits, *meta.grammar)
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            # A token the grammar masked is -inf here; JSON has no -inf (a 500, or a bare
            # -Infinity no JSON.parse reads, when one reached top_logprobs): vLLM's floor.
            raw_logprobs = torch.log_softmax(logits, dim=-1).clamp_(min=LOGPROB_FLOOR)  # [B, V]

        logits = apply_logits_processors(logits, meta)
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy = None if meta.all_random else logits.argmax(dim=-1)
            probs = compute_probs(logits, meta)
            sampled = exponential_race(probs, meta)
            if greedy is not None:
                sampled = torch.where(meta.temperature == 0.0, greedy, sampled)

        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(
                meta.max_num_logprobs, dim=-1, sorted=True
            )
        return out


_BITS = torch.arange(32, dtype=torch.int32)
_TINY, _MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [k, W] (bit j of word w allows token 32 w + j) -> bool [k, vocab_size]; tokens
    past the mask's width are not allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [k, W, 32]
    allowed = bits.bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf at every token a constrained row's grammar does not allow."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bias, min_tokens and penalties, in place on fp32 ``logits`` [B, V]: what greedy rows
    take the argmax of."""
    if meta.logit_bias is not None:
        rows, toks, vals = meta.logit_bias
        logits.index_put_((rows, toks), vals, accumulate=True)
    if meta.min_tokens_mask is not None:
        rows, toks = meta.min_tokens_mask
        logits[rows, toks] = float("-inf")
    if not meta.no_penalties:
        apply_penalties(logits, meta)
    return logits


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] token ids padded with vocab_size -> [B, V] occurrence counts."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.int32))
    return counts[:, :vocab_size]  # [B, V]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt or output, HF/vLLM form), then frequency and presence (output only)."""
    V = meta.vocab_size
    assert meta.prompt_token_ids is not None and meta.output_token_ids is not None
    output_counts = _token_counts(meta.output_token_ids, V)  # [B, V]
    output_seen = output_counts > 0  # [B, V]
    seen = (_token_counts(meta.prompt_token_ids, V) > 0) | output_seen  # [B, V]
    # A penalty below float32's smallest normal (5e-60 is a valid value) would be 0 here, and
    # -inf * 0 a NaN that argmax takes: a token the grammar masked (the schemathesis fuzz).
    rep = meta.repetition_penalty.clamp(min=_TINY).unsqueeze(1)  # [B, 1]
    penalty = torch.where(seen, rep, 1.0)  # [B, V]
    logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    logits.clamp_(max=_MAX)  # +inf (a big logit over a tiny penalty) -> the largest float
    logits -= meta.frequency_penalty.unsqueeze(1) * output_counts
    logits -= meta.presence_penalty.unsqueeze(1) * output_seen
    return logits


def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, softmax (in place on ``logits``). Greedy rows get
    temperature 1 here; their result is discarded by the caller."""
    temperature = torch.where(meta.temperature == 0.0, 1.0, meta.temperature)  # [B]
    logits.div_(temperature.unsqueeze(1))
    logits.clamp_(max=_MAX)  # no +inf into softmax (inf - inf = NaN); -inf stays
    if not meta.no_min_p:
        apply_min_p(logits, meta.min_p)
    if not (meta.no_top_k and meta.no_top_p):
        logits = apply_top_k_top_p(
            logits,
            None if meta.no_top_k else meta.top_k,
            None if meta.no_top_p else meta.top_p,
        )
    return logits.softmax(dim=-1)  # [B, V]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """One ascending sort serves both filters. top_k keeps ties with the k-th value; top_p
    keeps the smallest top set whose mass is >= p, and always the top token."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [B, V]
    V = logits.shape[-1]
    if top_k is not None:
        kth = logits_sort.gather(1, (V - top_k).unsqueeze(1))  # [B, 1]
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if top_p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)  # [B, V] mass at or below each token
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


def exponential_race(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): an exact draw from ``probs`` per row. Unseeded rows
    share one batched draw from the device's generator; seeded rows take counter-based noise
    (:func:`seeded_exponentials`)."""
    if meta.seeded_rows is None:
        q = torch.empty_like(probs).exponential_()  # [B, V]
    else:
        seeded_q = seeded_exponentials(meta.seed_keys, probs.shape[1])  # [S, V]
        if seeded_q.shape[0] == probs.shape[0]:
            q = seeded_q
        else:
            q = torch.empty_like(probs).exponential_()
            q[meta.seeded_rows] = seeded_q
    q.clamp_min_(_MIN_EXP_NOISE)
    return probs.div_(q).argmax(dim=-1)  # [B]


# -- counter-based noise of seeded rows ---------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32(x):
    """A bijective 32-bit integer hash (Wellons' lowbias32 shape, both multipliers below
    2^31 so that a 32-bit value times one fits an int64 tensor). Works on Python ints and on
    int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x4A6CA68B) & _M32
    return x ^ (x >> 16)


def seed_key(seed: int, position: int) -> int:
    """The 32-bit key of a seeded row sampling output position ``position`` (host side)."""
    s = seed % 2**64
    k = _mix32(_mix32(s & _M32) ^ ((s >> 32) & _M32))
    return _mix32(k ^ _mix32((position + 0x9E3779B9) & _M32))


_TOKEN_HASH: dict[tuple[int, str], torch.Tensor] = {}


def seeded_exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S] int64 keys -> [S, V] float32 Exp(1) noise on ``keys``' device: u = (h + 1/2) / 2^32
    with h = mix(key ^ mix(token)), then q = -log(u) (in float64, then rounded)."""
    cache_key = (vocab_size, str(keys.device))
    tokens = _TOKEN_HASH.get(cache_key)
    if tokens is None:
        ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
        tokens = _TOKEN_HASH[cache_key] = _mix32((ids * 0x9E3779B9) & _M32)
    h = _mix32(keys[:, None] ^ tokens[None, :])  # [S, V] in [0, 2^32)
    u = (h.to(torch.float64) + 0.5) * (1.0 / 2**32)
    return u.log_().neg_().to(torch.float32)

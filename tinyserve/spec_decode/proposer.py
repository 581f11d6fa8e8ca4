"""The scheduler's side of speculative decoding: which decoding requests get drafts this
step, how many, and the acceptance counters. Torch-free.

Adaptive policy (measured in benchmarks/README.md, "Speculative decoding"): a step's price
per token decides. Each draft row costs what the step's measured cost curve says
(spec_decode/cost.py: the engine times every step by its row count), and is worth the
tokens it is expected to add: with a request's per-token acceptance ``p`` (an exponentially
decayed count of accepted drafts against rejections), ``k`` drafts add
``p + p^2 + ... + p^k`` tokens on average. The scheduler opens a step with its rows and
tokens before drafts (``begin_step``); each decoding request, in order, then gets the
``k`` (up to its proposal's length) that maximises the step's expected tokens per second,
and none when no ``k`` beats the step without them (vLLM's goodput idea, SmartSpec). So:

* one stream on a machine where a row is cheap drafts the whole proposal; as the batch
  grows, each draft row is a smaller share of a dearer step and drafts need higher
  acceptance (on 2 Zen 1 cores ~0.3 alone, ~0.8 at 8 running), and on a compute-bound
  machine (each row as dear as the first) none pays at all;
* no drafts in a step with more than ``max_batch_size`` running requests, nor for a
  request whose acceptance is below ``min_acceptance_rate``;
* a request that made no drafts for ``_PROBE_EVERY`` steps (times the number running)
  probes with up to ``_PROBE_TOKENS`` drafts (its text may turn repetitive later);
* the draft never reaches past the request's ``max_tokens`` or the context window, and
  never past the step's token budget.

``adaptive: false`` drafts every proposal in full (tests, and measuring the policy).

Constrained (grammar) requests draft too: each verified position gets the grammar's mask
after the drafts before it (engine/structured_output.py).

A request with a ``prediction`` (Predicted Outputs) drafts from it instead (prediction.py),
under the same pricing; the engine keeps a proposer for those even without
``--speculative-config`` (``ngram=False``: other requests never draft).

Grammar fast-forward (SGLang's jump-forward, on by default): where a constrained request's
grammar allows one continuation only (a JSON key with its quotes, punctuation, the rest of
an enum value), those tokens (``Matcher.forced_tokens``, llguidance's fast-forward) are the
draft: each verified position's mask allows that token alone, so the draft is accepted in
full (acceptance 1 in the pricing, and nothing learnt from it of the request's n-gram
acceptance). They come before any other draft source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.request import Request
from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.cost import StepCostModel
from tinyserve.spec_decode.ngram import propose
from tinyserve.spec_decode.prediction import PredictionDrafter
from tinyserve.spec_decode.suffix import SuffixCache, SuffixParams, best_draft

_DECAY = 0.6  # per verification, the weight of a request's older acceptance evidence
# A new request's acceptance before its first verification: hopeful (1.8 of 2 pseudo-drafts
# accepted), so that it drafts and is measured; two full rejections bring it below 0.3.
_PRIOR_ACCEPTED, _PRIOR_REJECTED = 1.8, 0.2
_PROBE_EVERY = 8
_PROBE_TOKENS = 2
_FORCED_MAX = 16  # a JSON key with its quotes and colon, the tail of an enum value, ...
# A prediction is the client's draft of the whole answer (a file with small edits): drafts
# from it may run longer than config.num_speculative_tokens; the pricing picks the length.
_PREDICTION_MAX = 32


@dataclass
class SpecDecodeStats:
    """vLLM's counters (``vllm:spec_decode_*``), cumulative."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class _RequestState:
    accepted: float = _PRIOR_ACCEPTED
    rejected: float = _PRIOR_REJECTED
    steps_since_draft: int = 0
    forced: int = 0  # drafts of the last step that were the grammar's forced tokens

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return self.accepted / (self.accepted + self.rejected)


def expected_tokens(p: float, k: int) -> float:
    """Accepted drafts of ``k`` on average when each is accepted with probability ``p``
    given the ones before it were: ``p + p^2 + ... + p^k``."""
    return p * (1 - p**k) / (1 - p) if p < 1.0 else float(k)


def best_draft_length(
    cost: StepCostModel, rows: int, tokens: float, p: float, max_k: int
) -> tuple[int, float]:
    """The ``k`` in ``0..max_k`` that maximises expected tokens per second of a step that
    had ``rows`` rows and ``tokens`` expected tokens before this request's drafts, and the
    tokens they add. ``k = 0`` unless some ``k`` strictly beats the step without drafts."""
    base_cost = cost.estimate(rows)
    best_k, best_gain, best_rate = 0, 0.0, tokens / base_cost
    for k in range(1, max_k + 1):
        gain = expected_tokens(p, k)
        rate = (tokens + gain) / max(cost.estimate(rows + k), base_cost)
        if rate > best_rate:
            best_k, best_gain, best_rate = k, gain, rate
    return best_k, best_gain


def _step_before_drafts(running: list[Request], budget: int) -> list[float]:
    """[rows, tokens] of a step before drafts: each request's tokens to compute (within
    ``budget``), one expected token per decoding request."""
    rows = tokens = 0
    for request in running:
        left = request.num_tokens - request.num_computed_tokens
        rows += left
        tokens += left == 1
    return [min(rows, budget), tokens]


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, ngram: bool = True, fast_forward: bool = True):
        self.config = config
        self.ngram = ngram  # drafts of config.method for every request (else predictions only)
        self.fast_forward = fast_forward  # a grammar's forced tokens as drafts
        # Suffix decoding: earlier requests' outputs by cache_salt (spec_decode/suffix.py).
        self.suffix_cache = SuffixCache(
            config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_cached_tokens
        )
        self._suffix_params = SuffixParams(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
        self._drafters: dict[str, PredictionDrafter] = {}
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.cost = StepCostModel()
        self._state: dict[str, _RequestState] = {}
        self._step: list[float] | None = None  # [rows, expected tokens] of the step so far
        self._opened: tuple[list[Request], int] | None = None  # a step not counted yet

    def begin_step(self, running: list[Request], budget: int) -> None:
        """A step is being scheduled for ``running``: its rows before drafts are their
        tokens to compute (within ``budget``), its tokens one per decoding request; each
        request's drafts (``drafts``) are added to it in turn. Nothing to count in a step
        too big to draft in."""
        self._step = self._opened = None
        if len(running) > self.config.max_batch_size:
            return
        if not self.ngram:  # predictions only: counted at the first one's drafts, if any
            self._opened = (list(running), budget)
            return
        self._step = _step_before_drafts(running, budget)

    def observe_step(self, rows: int, seconds: float) -> None:
        """The engine ran a step of ``rows`` scheduled tokens in ``seconds``."""
        self.cost.observe(rows, seconds)

    def drafts(self, request: Request, budget: int, num_running: int) -> list[int]:
        """Draft tokens for a decoding request (one token to compute), or []."""
        cfg = self.config
        if num_running > cfg.max_batch_size:
            return []
        predicted = request.sampling_params.prediction is not None
        k = min(
            _PREDICTION_MAX if predicted else cfg.num_speculative_tokens,
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            request.max_model_len - request.num_tokens - 1,
        )
        if k < 1:
            return []
        forced = self._forced(request, budget) if self.fast_forward else []
        if not self.ngram and not predicted and not forced:
            return []
        if not cfg.adaptive:
            return forced or self._propose(request, k)
        state = self._state.setdefault(request.request_id, _RequestState())
        # Outside a scheduled step (no begin_step): a step of the running requests alone.
        if self._step is None and self._opened is not None:
            self._step, self._opened = _step_before_drafts(*self._opened), None
        step = self._step if self._step is not None else [num_running, num_running]
        rows, tokens = step
        if forced:  # accepted for certain (p = 1): priced, but no acceptance to learn
            n, gain = best_draft_length(self.cost, int(rows), tokens, 1.0, len(forced))
            step[0], step[1] = rows + n, tokens + gain
            state.forced = n
            return forced[:n]
        p = state.acceptance
        # Priced for the longest draft allowed first: if no length up to k pays, none of a
        # shorter proposal does either, and the n-gram search is skipped.
        best = 0
        if p >= cfg.min_acceptance_rate:
            best = best_draft_length(self.cost, int(rows), tokens, p, k)[0]
        if best == 0:
            # Probing costs the same rows in a bigger step but is a smaller share of it:
            # probe every _PROBE_EVERY steps alone, _PROBE_EVERY * B with B running.
            state.steps_since_draft += 1
            if state.steps_since_draft < _PROBE_EVERY * max(1, num_running):
                return []
        proposal = self._propose(request, k)
        if not proposal:
            return []
        if best == 0:
            n = min(len(proposal), _PROBE_TOKENS)  # probe now, then wait again
            gain = expected_tokens(p, n)
        elif len(proposal) < best:
            n, gain = best_draft_length(self.cost, int(rows), tokens, p, len(proposal))
        else:
            n, gain = best, expected_tokens(p, best)
        state.steps_since_draft = 0
        step[0], step[1] = rows + n, tokens + gain
        return proposal[:n]

    @staticmethod
    def _forced(request: Request, budget: int) -> list[int]:
        """The tokens a constrained request's grammar forces next (they cannot be rejected:
        each one's mask allows it alone), within the step's budget, its max_tokens and the
        context, or []."""
        if request.grammar is None:
            return []
        k = min(_FORCED_MAX, budget - 1, request.max_tokens - request.num_output_tokens - 1,
                request.max_model_len - request.num_tokens - 1)  # fmt: skip
        return request.grammar.forced_tokens()[:k] if k > 0 else []

    def _propose(self, request: Request, k: int) -> list[int]:
        """The client's prediction first; where it has nothing to say (past its end, after
        an unknown token) and speculation is on, the configured source, as without one."""
        prediction = request.sampling_params.prediction
        if prediction is not None:
            drafter = self._drafters.get(request.request_id)
            if drafter is None:
                drafter = self._drafters[request.request_id] = PredictionDrafter(prediction)
            draft = drafter.propose(request.output_token_ids, k)
            if draft or not self.ngram:
                return draft
            k = min(k, self.config.num_speculative_tokens)
        cfg = self.config
        if cfg.suffix:
            salt = request.sampling_params.cache_salt
            return best_draft(
                request.all_token_ids, self.suffix_cache, salt, k, self._suffix_params
            )
        return propose(request.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of ``num_drafted`` drafts were kept."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        for pos in range(min(num_accepted, len(s.accepted_per_pos))):  # forced runs are longer
            s.accepted_per_pos[pos] += 1
        state = self._state.setdefault(request_id, _RequestState())
        if state.forced:  # the grammar's own tokens: nothing learnt of the n-gram drafts
            state.forced = 0
            return
        rejected = 1.0 if num_accepted < num_drafted else 0.0
        state.accepted = _DECAY * state.accepted + num_accepted
        state.rejected = _DECAY * state.rejected + rejected
        state.steps_since_draft = 0

    def forget(self, request: Request) -> None:
        """``request`` finished (or was aborted): its output joins the suffix cache."""
        if self.ngram and self.config.suffix:
            self.suffix_cache.add(request.sampling_params.cache_salt, request.output_token_ids)
        self._state.pop(request.request_id, None)
        self._drafters.pop(request.request_id, None)

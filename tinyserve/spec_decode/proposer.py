"""The scheduler's side of speculative decoding: which decoding requests get drafts this
step, how many, and the acceptance counters. Torch-free.

Adaptive policy (measured in benchmarks/README.md, "Speculative decoding"): a verification
row of 1+k tokens costs the CPU kernels about (1+k) times the matmul work of one decode
row once the step is compute-bound, so drafts pay only while the step is bound by reading
the weights, i.e. at small batches, and only when they are accepted. So:

* no drafts in a step with more than ``max_batch_size`` running requests;
* a request whose acceptance rate (an exponential average over its drafted steps) falls
  below the step's threshold stops drafting, and probes again every ``_PROBE_EVERY``
  steps (its text may turn repetitive later). The threshold rises with the batch: a draft
  row costs about ``r`` of a one-row step (``r`` = ``min_acceptance_rate``, ~0.2 on 2 Zen 1
  cores: benchmarks/README.md, "Few-row kernels"), a step of B rows ~``1 + (B - 1) r``, so
  an accepted draft — one token at the step's price per token — pays for its row only
  while acceptance >= ``r B / (1 + (B - 1) r)``: 0.2 alone, 0.5 at 4, 0.67 at 8 running;
* the draft never reaches past the request's ``max_tokens`` or the context window, and
  never past the step's token budget.

Constrained (grammar) requests draft too: each verified position gets the grammar's mask
after the drafts before it (engine/structured_output.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.request import Request
from tinyserve.spec_decode.config import SpeculativeConfig
from tinyserve.spec_decode.ngram import propose

_EMA = 0.5  # weight of the newest step in a request's acceptance average
_PROBE_EVERY = 8


@dataclass
class SpecDecodeStats:
    """vLLM's counters (``vllm:spec_decode_*``), cumulative."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class _RequestState:
    acceptance: float = 1.0
    steps_since_draft: int = 0


def acceptance_threshold(rate: float, num_running: int) -> float:
    """The acceptance a request needs to draft in a step with ``num_running`` requests."""
    b = max(1, num_running)
    return rate * b / (1 + (b - 1) * rate)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._state: dict[str, _RequestState] = {}

    def drafts(self, request: Request, budget: int, num_running: int) -> list[int]:
        """Draft tokens for a decoding request (one token to compute), or []."""
        cfg = self.config
        if num_running > cfg.max_batch_size:
            return []
        state = self._state.setdefault(request.request_id, _RequestState())
        if state.acceptance < acceptance_threshold(cfg.min_acceptance_rate, num_running):
            state.steps_since_draft += 1
            if state.steps_since_draft < _PROBE_EVERY:
                return []
            state.steps_since_draft = 0  # probe now, then wait again
        k = min(
            cfg.num_speculative_tokens,
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            request.max_model_len - request.num_tokens - 1,
        )
        if k < 1:
            return []
        return propose(request.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of ``num_drafted`` drafts were kept."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1
        state = self._state.setdefault(request_id, _RequestState())
        state.acceptance = (1 - _EMA) * state.acceptance + _EMA * (num_accepted / num_drafted)
        state.steps_since_draft = 0

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

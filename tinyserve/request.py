"""Request: one sequence the engine is generating. Plain Python, no torch.

Ownership: the scheduler owns Request objects and mutates their token lists and counters;
the KV-cache manager owns the blocks, keyed by ``request_id``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tinyserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks given back, will recompute
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context window
    FINISHED_ABORTED = "finished_aborted"  # client went away / abort()
    FINISHED_ERROR = "finished_error"  # an internal failure of this request

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """A single sequence. ``n > 1`` requests are split by the engine into n of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Tokens the request may hold in total (prompt + output): min(max_model_len, ...).
    max_model_len: int = 2048
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (computed this or an earlier step, or prefix hits).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at (first) admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Set by the engine: parent id and index for the n>1 split.
    parent_id: str | None = None
    index: int = 0
    error: str | None = None
    # Set with ``error`` when the request itself is at fault (its grammar proved too complex
    # for the library mid-answer): the request field a 400 names.
    error_param: str | None = None
    # Constrained decoding: the request's grammar matcher (structured/backend.py Matcher),
    # advanced by the scheduler with every token it appends.
    grammar: object | None = None
    # ``prompt_logprobs``: a TokenLogprob (outputs.py) per prompt token after the first, as the
    # prefill chunks compute them (a recompute after preemption adds none twice).
    prompt_logprobs: list = field(default_factory=list)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions are still missing logprobs the request asked for."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the request's max_tokens, capped by the context window."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

"""Typed contracts between the rooms: scheduler -> runner -> engine -> API. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at
    ``request.num_computed_tokens``. ``block_ids`` is its whole block table after allocation."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    # Speculative decoding: draft tokens verified this step, after the request's last token;
    # counted in num_new_tokens (their K/V is computed, and kept only if they are accepted).
    spec_token_ids: list[int] = field(default_factory=list)
    # A hybrid model's other layer groups' block tables, group 1 first (``block_ids`` is
    # group 0's; engine/hybrid_kv_cache_manager.py); None: every layer reads ``block_ids``.
    group_block_ids: list[list[int]] | None = None

    @property
    def samples(self) -> bool:
        """A request samples when this step brings it level with all its tokens."""
        computed = self.request.num_computed_tokens + self.num_new_tokens
        return computed - len(self.spec_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What runs this step (a ScheduledBatch in the design doc)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the engine since the last step (finished or aborted): the runner
    # drops any per-request state it keeps.
    finished_request_ids: list[str] = field(default_factory=list)
    # Constrained decoding: allowed-token bitmask (int32 [rows, ceil(V/32)]) of the requests
    # that sample this step under a grammar, and each one's row in it. Filled by the engine
    # core after schedule(); applied by the sampler before any other logits stage.
    grammar_bitmask: object | None = None
    grammar_rows: dict[str, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (token_id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # prompt logprobs: 1 + how many tokens the model found likelier


@dataclass
class ModelRunnerOutput:
    """One forward + sample: the new tokens of each request that sampled this step — one,
    or with speculative decoding its accepted drafts and then one more (the correction or
    bonus token) — and their logprobs when asked for."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # ``prompt_logprobs``: this step's prompt tokens (each the token at position p + 1, from
    # the logits at p), in order, continuing the request's ``prompt_logprobs``.
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class SchedulerUpdate:
    """What ``Scheduler.update_from_output`` made of a step: the requests that got a token or
    finished, and the tokens each kept (a stop inside a speculative run drops the rest; the
    runner's own output is left as the runner made it)."""

    requests: list[Request] = field(default_factory=list)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)


def count_cached(per_prompt: dict[int, int], prompt_index: int, num_cached: int) -> int:
    """A request's cached prompt tokens as its usage reports them: each prompt once, as
    ``prompt_tokens`` counts it, at the fewest its choices found cached — the cache as the
    request found it (with n > 1 a choice may hit the blocks its sibling just computed;
    that was not a cache hit). Records one choice's count in ``per_prompt``; returns the
    total."""
    per_prompt[prompt_index] = min(per_prompt.get(prompt_index, num_cached), num_cached)
    return sum(per_prompt.values())


@dataclass
class Usage:
    """A request's token counts: each prompt once (whatever ``n``), every choice's output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Predicted Outputs (OpenAI's usage fields): prediction tokens the output kept, in order,
    # and the rest; summed over the choices.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def count_prediction(self, prediction, output) -> None:
        kept = kept_in_order(prediction, output)
        self.accepted_prediction_tokens += kept
        self.rejected_prediction_tokens += len(prediction) - kept

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def kept_in_order(prediction, output, anchor: int = 4, reach: int = 256) -> int:
    """How many prediction tokens the output kept, in order: walking the output, a token
    that is the prediction's next one is kept; at any other, the alignment moves ahead to
    where the output's next ``anchor`` tokens occur in the prediction (within ``reach``
    tokens: an edit skips a little, never the whole file), else that output token is new (a
    preamble, an edit's insertion). Anchoring on a run rather than one token keeps a common
    token (a newline, a bracket) in a preamble from moving the alignment past the file's
    start. Linear in the output (it runs on the engine thread when a request ends), a lower
    bound of the longest common subsequence, equal to it when the output is the prediction
    with local edits."""
    import bisect

    where: dict[tuple, list[int]] = {}
    for j in range(len(prediction) - anchor + 1):
        where.setdefault(tuple(prediction[j : j + anchor]), []).append(j)
    pos = kept = i = 0
    while i < len(output) and pos < len(prediction):
        if output[i] == prediction[pos]:
            kept, pos, i = kept + 1, pos + 1, i + 1
            continue
        run = output[i : i + anchor]
        if len(run) < anchor:  # the output's last tokens: the run where it occurs next
            ahead = next((j for j in range(pos, min(pos + reach, len(prediction)))
                          if list(prediction[j : j + len(run)]) == list(run)), None)  # fmt: skip
            spots, j = ([ahead], 0) if ahead is not None else ((), 0)
        else:
            spots = where.get(tuple(run), ())
            j = bisect.bisect_left(spots, pos)
        if j < len(spots) and spots[j] - pos < reach:
            pos = spots[j]  # the next round keeps output[i]
        else:
            i += 1
    return kept


@dataclass
class StepOutput:
    """What one step produced for one choice of a request, ready for the API layer."""

    request_id: str  # the id given to add_request
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    index: int = 0  # the choice: prompt_index * n + sample
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    # Where in text_delta stop strings begin to count: past the first min_tokens output
    # tokens, token by token (the detokenizer's rule; for the tool parser's stop strings,
    # tool_stream.StopAtText): 0 all of it, None none of it.
    armed_from: int | None = 0
    # A step of several tokens (a verified draft run): where in text_delta each token's text
    # ends, so that a stop string of the answer's text (StopAtText) ends the count there.
    token_ends: list[int] | None = None
    error: str | None = None
    error_param: str | None = None  # set when the request is at fault: a 400 naming this field
    prompt_index: int = 0  # which of the request's prompts this choice continues
    # A choice's first output, when asked for: the prompt tokens' logprobs, None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The request's last output (every choice has finished) carries its usage.
    request_finished: bool = False
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One choice of an offline ``LLM.generate`` result."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # ``prompt_logprobs``: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

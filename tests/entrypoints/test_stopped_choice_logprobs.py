"""A non-streamed answer with tools and stop strings (streaming.collect over
tool_stream.AllStopped): a choice whose text meets its stop while another choice runs on
takes no more text, logprobs or tokens — they ran on with every later step of the request
(n = 2: choice 0's logprobs held choice 0's tokens to the end of choice 1), and the usage
counted what it generated after its stop (a verified draft run past it, the steps until
the abort landed: 34-37 for one greedy answer, found by a bug hunt): its count ends at
the token that completed the stop, as the detokenizer's stop strings end it."""

from __future__ import annotations

import asyncio

from tinyserve.entrypoints.streaming import collect
from tinyserve.entrypoints.tool_stream import AllStopped, EnvelopeStream, StopAtText
from tinyserve.outputs import StepOutput, TokenLogprob, Usage


class _Stream:
    def __init__(self, outs: list[StepOutput]) -> None:
        self.outs, self.taken = outs, 0

    async def __aiter__(self):
        for out in self.outs:
            self.taken += 1
            yield out

    def abort(self) -> None:
        pass


def _outs(pieces: dict[int, list[str]], usage: Usage) -> list[StepOutput]:
    """One token a piece, token ids 100 * choice + k; choices interleaved; the last piece
    of each finishes it, the request's last output carries the usage."""
    outs = []
    for k in range(max(map(len, pieces.values()))):
        for i, texts in pieces.items():
            if k < len(texts):
                tok = 100 * i + k
                last = k == len(texts) - 1
                outs.append(StepOutput("r", [tok], texts[k], "stop" if last else None, index=i,
                                       logprobs=[TokenLogprob(tok, -0.5)]))  # fmt: skip
    outs[-1].usage = usage
    return outs


def _collect(pieces, stops, usage):
    stream = _Stream(_outs(pieces, usage))
    answered = AllStopped(lambda: StopAtText(EnvelopeStream(), stops), len(pieces))
    result = asyncio.run(collect(stream, answered))
    return result, stream.taken < len(stream.outs)  # ended early: aborted


def test_a_choice_stopped_by_its_text_takes_no_later_logprobs():
    pieces = {
        0: ['{"content": "', "a b", " c", " d", ' e"}'],
        1: ['{"content": "', "x", "y", "z", "w", '"}'],
    }
    (choices, usage), aborted = _collect(pieces, ["b"], Usage(5, 11))
    assert not aborted  # choice 1 never met a stop: the request ran to its end
    c0, c1 = choices
    assert [lp.token_id for lp in c0.logprobs] == [0, 1]  # to the output that met "b"
    assert c0.text == '{"content": "a b' and c0.finish_reason == "stop"
    assert c0.num_tokens == 2  # to its stop; 3 more generated, not counted
    assert [lp.token_id for lp in c1.logprobs] == [100 + k for k in range(6)]
    assert usage == Usage(5, 2 + 6)


def test_all_choices_stopped_aborts_with_the_tokens_so_far():
    pieces = {0: ['{"content": "', "a b", " c", ' d"}'], 1: ['{"content": "', "x", "y b", ' z"}']}
    (choices, usage), aborted = _collect(pieces, ["b"], Usage(5, 8))
    assert aborted
    assert [[lp.token_id for lp in c.logprobs] for c in choices] == [[0, 1], [100, 101, 102]]
    assert usage.completion_tokens == 2 + 3  # (choice 0 ran a step past its stop, uncounted)
    assert all(c.finish_reason == "stop" for c in choices)


def test_a_draft_run_past_the_stop_counts_to_the_token_that_met_it():
    """A step of several tokens (a verified draft run, StepOutput.token_ends) whose second
    token completes the stop: one choice's count and logprobs end there, aborted with the
    cached tokens kept."""
    text = " c X d e"
    outs = [StepOutput("r", [0], '{"content": "a', logprobs=[TokenLogprob(0, -0.5)],
                       num_cached_tokens=4),
            StepOutput("r", [1, 2, 3, 4], text, logprobs=[TokenLogprob(t, -0.5) for t in
                       (1, 2, 3, 4)], token_ends=[2, 4, 6, 8], num_cached_tokens=4)]  # fmt: skip
    for out in outs:
        out.num_prompt_tokens = 5
    stream = _Stream(outs)
    answered = AllStopped(lambda: StopAtText(EnvelopeStream(), ["X"]), 1)
    ((c,), usage) = asyncio.run(collect(stream, answered))
    assert [lp.token_id for lp in c.logprobs] == [0, 1, 2] and c.num_tokens == 3
    assert usage == Usage(5, 3, 4)


def test_aborted_usage_counts_each_prompts_cache_at_its_fewest():
    """Aborted by the text stops, the usage's cached tokens are the engine's rule
    (count_cached: each prompt once, at the fewest its choices found), not the last seen."""
    outs = [StepOutput("r", [0], '{"content": "a b', index=0, num_cached_tokens=0),
            StepOutput("r", [1], '{"content": "b', index=1, num_cached_tokens=16)]  # fmt: skip
    answered = AllStopped(lambda: StopAtText(EnvelopeStream(), ["b"]), 2)
    _, usage = asyncio.run(collect(_Stream(outs), answered))
    assert usage.cached_tokens == 0 and usage.completion_tokens == 2

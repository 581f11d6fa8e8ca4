"""A non-streamed answer with tools and stop strings (streaming.collect over
tool_stream.AllStopped): a choice whose text meets its stop while another choice runs on
takes no more text or logprobs — they ran on with every later step of the request (n = 2:
choice 0's logprobs held choice 0's tokens to the end of choice 1) — while its tokens still
count in the usage, as the streamed path counts them."""

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
    assert c0.num_tokens == 5  # generated, counted
    assert [lp.token_id for lp in c1.logprobs] == [100 + k for k in range(6)]
    assert usage == Usage(5, 11)


def test_all_choices_stopped_aborts_with_the_tokens_so_far():
    pieces = {0: ['{"content": "', "a b", " c", ' d"}'], 1: ['{"content": "', "x", "y b", ' z"}']}
    (choices, usage), aborted = _collect(pieces, ["b"], Usage(5, 8))
    assert aborted
    assert [[lp.token_id for lp in c.logprobs] for c in choices] == [[0, 1], [100, 101, 102]]
    assert usage.completion_tokens == 2 + 3 + 1  # choice 0 ran a step past its stop
    assert all(c.finish_reason == "stop" for c in choices)

"""A grammar that starts after the model's thinking block (issue 41: structured outputs and
tool grammars apply after ``</think>``, as vLLM's reasoning parsers make them).

``ThinkingGate`` wraps a request's ``Matcher`` with the same interface and three states:

  * undecided (the first token, where the model may open a block): the grammar's allowed set
    plus the ``<think>`` token; ``<think>`` -> thinking, any other token goes to the grammar;
  * thinking: every token allowed, none given to the grammar; ``</think>`` -> grammar;
  * grammar: the inner matcher, as without a gate.

A prompt that already opened the block (an R1-style template) starts in thinking. Each kept
token records the state it was taken in, so ``rollback`` (rejected speculative drafts) and
``reset`` (preemption) restore the state exactly. The gate needs ``<think>`` and ``</think>``
as single tokens (Qwen3's and SmolLM3's vocabularies have them); without one the server
applies the grammar from the first token (entrypoints/serving_chat.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

UNDECIDED, THINKING, GRAMMAR = "undecided", "thinking", "grammar"


class ThinkingGate:
    def __init__(self, inner, start_id: int | None, end_id: int, thinking: bool = False):
        self._inner = inner
        self._start_id, self._end_id = start_id, end_id
        self._initial = THINKING if thinking else (UNDECIDED if start_id is not None else GRAMMAR)
        self._state = self._initial
        self._taken: list[tuple[str, bool]] = []  # per kept token: (state before, inner took it)

    @property
    def state(self) -> str:
        return self._state

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """All of ``token_ids`` or none (False, state unchanged), as Matcher.accept_tokens."""
        for n, token_id in enumerate(token_ids):
            if not self._accept(token_id):
                self.rollback(n)
                return False
        return True

    def _accept(self, token_id: int) -> bool:
        before = self._state
        if before == THINKING or (before == UNDECIDED and token_id == self._start_id):
            if before == UNDECIDED or token_id == self._end_id:
                self._state = THINKING if before == UNDECIDED else GRAMMAR
            self._taken.append((before, False))
            return True
        if not self._inner.accept_tokens([token_id]):
            return False
        self._state = GRAMMAR
        self._taken.append((before, True))
        return True

    def rollback(self, num_tokens: int) -> None:
        inner = 0
        for _ in range(num_tokens):
            self._state, took = self._taken.pop()
            inner += took
        if inner:
            self._inner.rollback(inner)

    def fork(self) -> ThinkingGate:
        """An independent gate at this state, over a fork of the inner matcher (which does not
        roll back): the kept tokens' record is not copied."""
        other = ThinkingGate.__new__(ThinkingGate)
        other.__dict__.update(self.__dict__)
        other._inner, other._taken = self._inner.fork(), []
        return other

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == THINKING:
            bitmask[row].fill_(-1)
            return
        self._inner.fill_bitmask(bitmask, row)
        if self._state == UNDECIDED:
            word, bit = divmod(self._start_id, 32)
            value = int(bitmask[row, word].item()) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def forced_tokens(self) -> list[int]:
        """The grammar's forced tokens once it applies; none while the model may think."""
        return self._inner.forced_tokens() if self._state == GRAMMAR else []

    def error(self) -> str:
        return self._inner.error()

    def is_terminated(self) -> bool:
        return self._state == GRAMMAR and self._inner.is_terminated()

    def reset(self) -> None:
        self._inner.reset()
        self._state, self._taken = self._initial, []

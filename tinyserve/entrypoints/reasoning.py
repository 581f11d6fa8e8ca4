"""Thinking output: a model's ``<think>…</think>`` block goes to ``reasoning_content``, the rest
to ``content`` (vLLM's reasoning parsers for Qwen3, SmolLM3, DeepSeek-R1).

Where it applies (``--reasoning-parser``): "auto" (the default) where the chat template
mentions ``<think>``, "think" always, "none" never; and per request unless
``chat_template_kwargs: {"enable_thinking": false}`` turned thinking off.

One state machine splits both a finished answer and a stream, so the two give the same
split to the character (streamed deltas concatenate to the non-streamed fields):

  * undecided: the answer so far, less leading whitespace, could still become ``<think>``:
    held back. It is ``<think>`` -> thinking; anything else -> content (a model that chose
    not to think). A generation prompt that already ends with ``<think>`` (R1-style
    templates) starts in thinking instead.
  * thinking: text up to ``</think>`` is reasoning; a tail that could be the start of
    ``</think>`` is held back until the next delta decides it.
  * content: after ``</think>`` (the whitespace right after it dropped, as the templates
    write "</think>\\n\\n"), everything is content.

An answer cut inside its thinking (``max_tokens``) is all reasoning and no content.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("auto", "think", "none")


def thinks(parser: str, tokenizer, template_kwargs: dict | None) -> bool:
    """Whether a chat answer's <think> block is split off: ``parser`` (--reasoning-parser)
    allows it and the request did not turn thinking off."""
    if parser == "none" or (template_kwargs or {}).get("enable_thinking") is False:
        return False
    return parser == "think" or template_thinks(tokenizer)


def template_thinks(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes or expects a ``<think>`` block."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = " ".join(str(t) for t in template.values())
    return THINK_START in template or THINK_END in template


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` (the model's first token is
    already reasoning)."""
    return prompt_tail.rstrip().endswith(THINK_START)


@dataclass
class ReasoningSplitter:
    """Feed it the answer's text deltas; each ``feed`` returns (reasoning, content) deltas."""

    thinking: bool = False  # start inside a think block (the prompt opened it)
    _state: str = ""
    _held: str = ""
    _strip: bool = False  # drop the whitespace that opens the content

    def __post_init__(self) -> None:
        self._state = "thinking" if self.thinking else "undecided"

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        if self._state == "undecided":
            body = text.lstrip()
            if len(body) < len(THINK_START) and THINK_START.startswith(body):  # not decided yet
                self._held = text
                return "", ""
            if body.startswith(THINK_START):
                self._state, text = "thinking", body[len(THINK_START) :]
            else:
                self._state = "content"
        reasoning = ""
        if self._state == "thinking":
            end = text.find(THINK_END)
            if end < 0:
                keep = _partial_tail(text, THINK_END)
                self._held = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(THINK_END) :]
            self._state, self._strip = "content", True
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return reasoning, text

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        """``feed``, and at the answer's end what was still held back, in one pair."""
        reasoning, content = self.feed(delta)
        if finished:
            more = self.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the answer."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return held, ""
        return "", held.lstrip() if self._strip else held


def split_reasoning(text: str, thinking: bool = False) -> tuple[str | None, str | None]:
    """A finished answer -> (reasoning_content, content); None where there is none."""
    s = ReasoningSplitter(thinking)
    reasoning, content = s.step(text, finished=True)
    had_block = thinking or text.lstrip().startswith(THINK_START)
    return (reasoning if had_block else None), (content or None)


def split_or_gate(tokenizer, prompt_ids: list[int], params) -> bool | None:
    """For an answer whose thinking is split off: None when it should not be after all (a
    grammar that holds from the first token, the tags not being single tokens), else whether
    the prompt opened the block; a constrained request's grammar is gated to start after
    ``</think>`` (``params.structured_outputs`` replaced)."""
    opened = prompt_opens_thinking(tokenizer.decode(prompt_ids[-8:]))
    so = params.structured_outputs
    if so is None:
        return opened
    gate = grammar_gate(tokenizer, opened)
    if gate is None:
        return None
    params.structured_outputs = dataclasses.replace(so, **gate)
    return opened


def grammar_gate(tokenizer, opened: bool) -> dict | None:
    """The StructuredOutputsParams fields that start a request's grammar after its thinking
    block (structured/thinking.py): the single token ids of ``<think>`` and ``</think>``.
    None where ``</think>`` is not one token: the grammar then holds from the first token
    (and so leaves no room to think)."""
    end = tokenizer.encode(THINK_END, add_special_tokens=False)
    if len(end) != 1:
        return None
    start = tokenizer.encode(THINK_START, add_special_tokens=False)
    return {"think_end_id": end[0], "think_start_id": start[0] if len(start) == 1 else None,
            "thinking_open": opened}  # fmt: skip


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

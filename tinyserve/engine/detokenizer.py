"""Incremental detokenization and stop strings, one instance per request. No torch.

Decoding uses the prefix_offset / read_offset window (as vLLM's ``detokenize_incrementally``):
``ids[prefix_offset:read_offset]`` is text already emitted, kept only as context so that the
tokenizer merges spaces and multi-byte characters exactly as it would in a full decode;
``ids[read_offset:]`` is not emitted yet. Each step decodes just the window, and the new text is
``decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]``. Decoded text
ending in U+FFFD means the last token stopped inside a UTF-8 character: nothing is emitted and
the offsets stay put until a later token completes it (or the request finishes).

Stop strings are searched in the decoded text. While a request runs, the last
``len(longest stop string) - 1`` characters are held back so a stop string is never half
emitted; each step searches only that held-back tail plus the newly decoded text.
"""

from __future__ import annotations

from tinyserve.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM uses the same 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's sampled token ids into text deltas and finds its stop strings.

    Contract: the concatenation of all returned deltas is ``output_text``. When the request
    ends without a stop string (``finished=True``), ``output_text`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)`` for
    byte-level BPE tokenizers; for sentencepiece-style tokenizers it also keeps the first output
    token's leading space, which a decode of the output ids alone would strip. Once ``update``
    reports a stop string the request is over and ``update`` must not be called again.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Stop strings count only in the text of output tokens past the first min_tokens (as
        # EOS and stop ids, masked until then, and vLLM's stop checker: len(output) >
        # min_tokens); text before that is never held back.
        self.min_tokens = params.min_tokens
        self.num_output_tokens = 0
        # Characters held back while running: a stop string may start in them.
        self.stop_holdback = max((len(s) for s in self.stop), default=1) - 1

        # Only the prompt's tail is kept: it is all the window ever looks at.
        tail = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._window_ids: list[int] = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self._prefix_text: str | None = self._decode(tail)
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a UTF-8 character; its tail is no usable context, so
            # decode the output on its own (as a full decode of the output ids would).
            self._window_ids = []
            self.read_offset = 0
            self._prefix_text = ""

        self._pending_text = ""  # decoded, held back for stop-string matching
        self._chunks: list[str] = []  # emitted deltas
        self._output_text: str | None = ""
        self.stopped = False

    @property
    def output_text(self) -> str:
        """Text emitted so far: the concatenation of every delta returned by ``update``."""
        if self._output_text is None:
            self._output_text = "".join(self._chunks)
        return self._output_text

    def update(self, new_token_ids: list[int], finished: bool) -> tuple[str, str | None]:
        """Add the tokens sampled this step. Returns (text_delta, matched_stop_string or None).

        ``finished=True`` (EOS, length, abort) flushes everything held back, including an
        incomplete UTF-8 character. A returned stop string means the request must end now: the
        delta was cut right before it (or right after, with ``include_stop_str_in_output``).
        """
        if self.stopped:
            raise RuntimeError("update() called after a stop string ended the request")
        self._window_ids.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        text = self._pending_text + self._decode_new_text(flush=finished)
        if self.num_output_tokens <= self.min_tokens:
            self._pending_text = ""
            return self._emit(text), None

        match = find_stop(text, self.stop) if self.stop else None
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self.stopped = True
            self._pending_text = ""
            return self._emit(text[:end]), stop_str

        split = len(text) if finished else max(len(text) - self.stop_holdback, 0)
        self._pending_text = text[split:]
        return self._emit(text[:split]), None

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._output_text = None
        return delta

    def _decode_new_text(self, flush: bool) -> str:
        """Text of the tokens past ``read_offset``; advances the window when it is complete."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(
                self._window_ids[self.prefix_offset : self.read_offset]
            )
        prefix_text = self._prefix_text
        if self.read_offset == len(self._window_ids):
            return ""
        new_text = self._decode(self._window_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text):
            # e.g. a skipped special token: nothing new to show yet.
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""  # the last token ends inside a UTF-8 character
        delta = new_text[len(prefix_text) :]
        # Drop ids left of the new prefix so the list stays as small as the window.
        del self._window_ids[: self.read_offset]
        self.prefix_offset = 0
        self.read_offset = len(self._window_ids)
        self._prefix_text = None
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        # Space clean-up rewrites text across token boundaries, so it can't be incremental.
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def find_stop(text: str, stops) -> tuple[int, str] | None:
    """Earliest stop string of ``stops`` in ``text`` as (start, string); at equal starts the
    one listed first wins. (Also the tool parser's, entrypoints/tool_stream.StopAtText.)"""
    best: tuple[int, str] | None = None
    for stop_str in stops:
        # A later match can't win, so don't look past the best start found so far.
        limit = len(text) if best is None else best[0] + len(stop_str) - 1
        idx = text.find(stop_str, 0, limit)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop_str)
    return best

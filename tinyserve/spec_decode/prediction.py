"""Drafts from a request's prediction (OpenAI's Predicted Outputs: the client sends the text
it expects back, e.g. a file with small edits). Torch-free.

The prediction is aligned to the output as the output drifts from it: the drafts continue the
prediction after the place where the output's last tokens occur in it — the longest suffix
of the output (``max_match`` tokens down to one) found in the prediction, the first such
place at or after the previous alignment (an edit moves forward through a file), else the
first anywhere. A match shorter than ``far_match`` tokens counts only within ``near``
tokens after the previous alignment (just past an edit); elsewhere one or two tokens (a
bracket, a newline) say nothing of where the output stands: an answer that has left the
file would draft the file's text after its every bracket, each draft rejected, where the
configured source (suffix decoding) drafts what the answer repeats. Right after the prompt
(no output yet) the prediction's start is the draft.
Verification keeps exactly the tokens plain decoding would have produced, so the prediction
changes speed only, never the output.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("i").itemsize


class PredictionDrafter:
    """One request's prediction and where the output stands in it."""

    def __init__(
        self, prediction: Sequence[int], max_match: int = 8, far_match: int = 3, near: int = 16
    ) -> None:
        self.tokens = list(prediction)
        self._data = array("i", self.tokens).tobytes()
        self.max_match, self.far_match, self.near = max_match, far_match, near
        self.position = 0  # in the prediction, after the last alignment's draft start

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens of the prediction to follow ``output`` ([] when it has none)."""
        if k < 1:
            return []
        if not output:
            return self.tokens[:k]
        n = len(output)
        for size in range(min(self.max_match, n), 0, -1):
            suffix = array("i", output[n - size :]).tobytes()
            start = self._find(suffix, self.position - size)
            if size < self.far_match and start - (self.position - size) > self.near:
                start = -1  # a short match far ahead: no evidence of where the output is
            if start < 0 and size >= self.far_match:
                start = self._find(suffix, 0)
            if start >= 0:
                self.position = start + size
                return self.tokens[self.position : self.position + k]
        return []

    def _find(self, suffix: bytes, from_token: int) -> int:
        """The first token index >= ``from_token`` where ``suffix`` starts and at least one
        prediction token follows it; -1 if none."""
        pos = self._data.find(suffix, max(0, from_token) * _WIDTH)
        while pos >= 0 and pos % _WIDTH:  # a hit inside a token: look further
            pos = self._data.find(suffix, pos + 1)
        if pos < 0:
            return -1
        start = pos // _WIDTH
        return start if start + len(suffix) // _WIDTH < len(self.tokens) else -1

"""Suffix decoding (SuffixDecoding, NeurIPS 2025; vLLM's ``method: "suffix"``): drafts from
the request's own prompt and output and from earlier requests' outputs. Torch-free.

Each source answers the question a counted suffix tree of depth ``max_depth`` answers: the
longest suffix of the request's tokens (at most ``max_depth``) that occurred before, then,
token by token, the most frequent continuation among its occurrences — each draft token's
score is the share of the occurrences that continue that way (a path probability, the
product of the tree's count ratios); the draft stops where it falls below
``min_token_prob`` and after ``max_spec_factor`` x the match length. Of the two sources, the
draft with the larger expected accepted length (the sum of the scores) wins.

Not a pointer tree: here the occurrences are found by ``bytes.find`` over the packed token
ids (4 bytes a token, C speed), so the structure costs 4 bytes a token instead of a Python
node per (token, depth) — a depth-24 tree over 64 Ki tokens would be ~1.5 M nodes, hundreds
of MB in Python. The per-request source is the request's own tokens (nothing stored); the
global one (``SuffixCache``) holds finished requests' outputs, one namespace per
``cache_salt`` (requests without one share one namespace), evicted oldest first past
``max_cached_requests`` outputs or ``max_cached_tokens`` tokens over all namespaces.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

_WIDTH = array("i").itemsize
_SEP = -1  # between outputs in a namespace: never a token, so no match spans two outputs
_MAX_OCCURRENCES = 64  # the latest occurrences of the matched suffix that vote


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    score: float  # expected accepted tokens under the counts: the sum of path probabilities


NO_DRAFT = Draft([], 0.0)


def _longest_suffix(data: bytes, tokens: Sequence[int], end: int, max_depth: int) -> int:
    """The length of the longest suffix of ``tokens`` (at most ``max_depth``) occurring in
    ``data`` so that it ends before byte ``end``: 0 if not even its last token does. A
    suffix occurs only if its own suffixes do, so a binary search on the length."""
    lo, hi = 0, min(max_depth, len(tokens))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _latest(data, array("i", tokens[-mid:]).tobytes(), end) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _latest(data: bytes, needle: bytes, end: int) -> int:
    """Token index of the latest token-aligned occurrence of ``needle`` ending by byte
    ``end``, or -1."""
    pos = data.rfind(needle, 0, end)
    while pos > 0 and pos % _WIDTH:
        pos = data.rfind(needle, 0, pos + len(needle) - 1)
    return pos // _WIDTH if pos >= 0 and pos % _WIDTH == 0 else -1


def _occurrences(data: bytes, needle: bytes, end: int) -> list[int]:
    """Token indices just past the latest ``_MAX_OCCURRENCES`` occurrences, latest first."""
    found: list[int] = []
    size = len(needle) // _WIDTH
    while len(found) < _MAX_OCCURRENCES:
        start = _latest(data, needle, end)
        if start < 0:
            break
        found.append(start + size)
        end = start * _WIDTH + len(needle) - 1  # the next one starts before this one
    return found


def match(
    data: bytes,
    tokens: Sequence[int],
    corpus: Sequence[int],
    k: int,
    max_depth: int,
    max_spec_factor: float,
) -> tuple[int, list[int]]:
    """(the draft's length limit, the token indices just past the latest occurrences of the
    longest suffix of ``tokens`` in ``corpus``); (0, []) without a match. ``data`` is the
    corpus packed; when the corpus is the request's own tokens, matches end before its last
    token."""
    end = (len(corpus) - 1) * _WIDTH if corpus is tokens else len(data)
    size = _longest_suffix(data, tokens, end, max_depth)
    if size == 0:
        return 0, []
    limit = min(k, max(1, int(max_spec_factor * size)))
    return limit, _occurrences(data, array("i", tokens[-size:]).tobytes(), end)


def speculate(
    data: bytes,
    tokens: Sequence[int],
    corpus: Sequence[int],
    k: int,
    max_depth: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> Draft:
    """The draft continuing ``tokens`` from ``corpus`` (``data`` its packed bytes): the most
    voted continuation of the occurrences ``match`` finds, token by token."""
    own = corpus is tokens
    limit, alive = match(data, tokens, corpus, k, max_depth, max_spec_factor)
    if not alive:
        return NO_DRAFT
    draft: list[int] = []
    score, prob = 0.0, 1.0
    for i in range(limit):
        votes: dict[int, int] = {}
        for s in alive:  # latest first: on a tie the latest occurrence's token wins
            if (t := token_at(corpus, s + i, draft, own)) != _SEP:
                votes[t] = votes.get(t, 0) + 1
        if not votes:
            break
        token = max(votes, key=votes.__getitem__)
        prob *= votes[token] / len(alive)
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        alive = [s for s in alive if token_at(corpus, s + i, draft, own) == token]
    return Draft(draft, score)


def best_draft(
    tokens: Sequence[int], cache: SuffixCache, salt: str | None, k: int, cfg: SuffixParams
) -> list[int]:
    """Up to ``k`` drafts for a request whose tokens (prompt + output) are ``tokens``: from
    its own tokens or its namespace's earlier outputs, whichever scores higher."""
    args = (k, cfg.max_depth, cfg.max_spec_factor, cfg.min_token_prob)
    best = speculate(array("i", tokens).tobytes(), tokens, tokens, *args)
    if (shared := cache.corpus(salt)) is not None:
        other = speculate(shared[1], tokens, shared[0], *args)
        if other.score > best.score:
            best = other
    return best.tokens


@dataclass(frozen=True)
class SuffixParams:
    max_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1


def token_at(corpus: Sequence[int], j: int, draft: list[int], own: bool) -> int:
    """Token ``j`` of the corpus; past the end of the request's own tokens, the draft so far
    (a continuation that runs into the request's end goes on as the draft predicts it: a
    repeating text repeats on), else _SEP."""
    if j < len(corpus):
        return corpus[j]
    return draft[j - len(corpus)] if own else _SEP


class SuffixCache:
    """Earlier requests' outputs by namespace (``cache_salt``; None is the shared one),
    bounded: past ``max_requests`` outputs or ``max_tokens`` tokens in all, the oldest go."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._order: deque[tuple[str | None, int]] = deque()  # (namespace, length), oldest first
        self._joined: dict[str | None, array] = {}  # outputs, each followed by _SEP
        self._packed: dict[str | None, bytes] = {}  # the same, packed; dropped on a change

    def add(self, salt: str | None, output: Sequence[int]) -> None:
        """A finished request's output joins its namespace (of a very long one, the last
        ``max_tokens`` tokens)."""
        output = (
            output[len(output) - self.max_tokens :] if len(output) > self.max_tokens else output
        )
        if not output:
            return
        joined = self._joined.setdefault(salt, array("i"))
        joined.extend(output)
        joined.append(_SEP)
        self._packed.pop(salt, None)
        self._order.append((salt, len(output)))
        self.num_tokens += len(output)
        while len(self._order) > self.max_requests or self.num_tokens > self.max_tokens:
            old_salt, size = self._order.popleft()  # the oldest of all is its namespace's first
            self.num_tokens -= size
            old = self._joined[old_salt]
            del old[: size + 1]
            self._packed.pop(old_salt, None)
            if not old:
                del self._joined[old_salt]

    def corpus(self, salt: str | None) -> tuple[array, bytes] | None:
        """The namespace's outputs joined by separators (tokens, packed bytes), or None."""
        joined = self._joined.get(salt)
        if joined is None:
            return None
        packed = self._packed.get(salt)
        if packed is None:  # packed again once per change, at C speed
            packed = self._packed[salt] = joined.tobytes()
        return joined, packed

    def __len__(self) -> int:
        return len(self._order)

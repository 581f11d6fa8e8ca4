"""What a step of n rows costs on this machine, measured while the engine runs. Torch-free.

Speculation pays only while a verification row costs less than the tokens it may save, and
that price is a property of the hardware and the kernels, not a constant: on 2 Zen 1 cores
with the grouped Q4_1 kernels one decode row costs ~13 ms of matmuls and each further row
~4-5 ms (benchmarks/README.md, "Grouped kernel layout"); a machine that is bound by reading
the weights pays much less per row, a compute-bound one more. So the engine times every
step (``observe``) and the proposer asks ``estimate(n)`` for the row counts it considers.

Estimates: an exponential average per measured row count; between two measured counts,
linear interpolation; above the largest (or with one count only), the largest count's
cost plus ``prior_row_cost`` of a one-row step per extra row; below the smallest, the
smallest's cost scaled down by the prior. Before any step is measured the estimate is the
prior in units of a one-row step.
Decode steps measure 1..B rows and prefill chunks hundreds, so a verification step's
count is usually bracketed, and every step it then runs measures it.

Robust to a slow step, as far as one can be: a count's estimate only ever sees an
observation clamped to within ``_CLAMP`` of itself; a count's first observation is no
lower than its lower neighbour's estimate and no higher than ``_CLAMP`` x the
interpolation between its measured neighbours (above every measured count: that plus two
smallest-count steps per extra row; the smallest count is taken as it comes). Without it
one hiccup (a stolen core, a GC pause) priced a count out for good — a count the policy no
longer chooses is never measured again (served, 2026-12-03: after one slow repetition a
server drafted one token a step for the rest of its run). What remains: where each extra
row is nearly free, even a first observation at 1.25x the line can make one draft fewer
pay better, and that count is then not measured again.

And from a slow start (2026-12-06, served: a fresh server's first steps 2-4 s, 100x): a
faster step is believed sooner than a slower one (interference only ever slows a step);
a count not measured in ``_STALE_STEPS`` steps is forgotten, its estimate then coming from
counts still measured; and no estimate exceeds what splitting the step into measured
counts would cost (``ceil(n / m)`` steps of ``m`` rows).
"""

from __future__ import annotations

import bisect
import math

_EMA = 0.25  # weight of the newest step of a row count
# A step faster than its estimate: interference makes steps slow, never fast, so a faster
# one is believed sooner (half its weight, down to a quarter of the estimate a step): a
# cold start measured 100x slow is forgotten in ~10 steps, not ~90.
_EMA_DOWN, _CLAMP_DOWN = 0.5, 4.0
# A count not seen in this many steps is forgotten: the estimate then comes from the counts
# around it that are still measured (a count the policy stopped choosing because of one
# bad measurement would otherwise keep it for good).
_STALE_STEPS = 256
# An observation counts as at most this factor off the estimate: a real change (longer
# contexts, another load) still moves an estimate +6% / -5% a step, as far as a 10x outlier.
_CLAMP = 1.25
# A draft row's cost relative to a one-row step before anything is measured: 0.35 is about
# what the grouped kernels' 2-8 rows cost here (bench_kernels, 2026-12-02).
PRIOR_ROW_COST = 0.35


class StepCostModel:
    def __init__(self, prior_row_cost: float = PRIOR_ROW_COST) -> None:
        self.prior_row_cost = prior_row_cost
        self._seconds: dict[int, float] = {}
        self._rows: list[int] = []  # measured row counts, sorted
        self._seen: dict[int, int] = {}  # count -> the step that last measured it
        self._steps = 0

    @property
    def measured_rows(self) -> tuple[int, ...]:
        return tuple(self._rows)

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` scheduled tokens took ``seconds``."""
        if rows < 1 or not 0.0 < seconds < math.inf:
            return
        self._steps += 1
        self._seen[rows] = self._steps
        if self._steps % 32 == 0:
            self._forget_stale()
        old = self._seconds.get(rows)
        if old is not None:
            if seconds < old:
                seconds = max(seconds, old / _CLAMP_DOWN)
                self._seconds[rows] = (1 - _EMA_DOWN) * old + _EMA_DOWN * seconds
            else:
                seconds = min(seconds, old * _CLAMP)
                self._seconds[rows] = (1 - _EMA) * old + _EMA * seconds
            return
        i = bisect.bisect_left(self._rows, rows)
        if i > 0:  # a new count: no cheaper than fewer rows, and not far above the line
            lo = self.estimate(self._rows[i - 1])
            if i < len(self._rows):  # between two measured counts: _CLAMP x the interpolation
                top = _CLAMP * self.estimate(rows)
            else:  # above them all: at most two smallest-count steps a row more
                top = lo + 2 * (rows - self._rows[i - 1]) * self._seconds[self._rows[0]]
            seconds = max(min(seconds, top), lo)
        self._rows.insert(i, rows)
        self._seconds[rows] = seconds

    def _forget_stale(self) -> None:
        horizon = self._steps - _STALE_STEPS
        for rows in [r for r in self._rows if self._seen[r] < horizon]:
            self._rows.remove(rows)
            del self._seconds[rows], self._seen[rows]

    def max_rows_within(self, seconds: float, most: int) -> int | None:
        """The largest row count up to ``most`` whose estimate is within ``seconds`` (at
        least 1), or None while nothing is measured (the estimates are not seconds yet)."""
        if not self._rows:
            return None
        lo, hi = 1, most  # estimates grow with the rows: the last count that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.estimate(mid) <= seconds else (lo, mid - 1)
        return lo

    def _prior(self, n: int) -> float:
        return 1.0 + self.prior_row_cost * (n - 1)

    def estimate(self, n: int) -> float:
        """Seconds for a step of ``n`` rows (relative units while nothing is measured): at
        most what ``ceil(n / m)`` steps of a measured count ``m <= n`` cost (a step could
        always be split so). Without that bound, counts last measured during a cold start
        (2026-12-06, served: the first 2-, 9- and 10-row steps at 2-3 s, 100x) priced every
        longer draft out while the shorter counts the policy kept using had long recovered,
        and the proposer only probed for a whole run."""
        best = self._interpolated(n)
        for m in self._rows:
            if m > n:
                break
            best = min(best, -(-n // m) * self._seconds[m])
        return best

    def _interpolated(self, n: int) -> float:
        if (hit := self._seconds.get(n)) is not None:
            return hit
        rows = self._rows
        if not rows:
            return self._prior(n)
        i = bisect.bisect_left(rows, n)
        if i == 0:  # below every measured count
            lo = rows[0]
            return self._seconds[lo] * self._prior(n) / self._prior(lo)
        lo = rows[i - 1]
        if i == len(rows):  # above every measured count
            first = rows[0]
            per_row = self.prior_row_cost * self._seconds[first] / self._prior(first)
            return self._seconds[lo] + per_row * (n - lo)
        hi = rows[i]
        c_lo, c_hi = self._seconds[lo], self._seconds[hi]
        return c_lo + (c_hi - c_lo) * (n - lo) / (hi - lo)

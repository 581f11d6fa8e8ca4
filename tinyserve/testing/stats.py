"""Summary statistics of latencies and rates, as the benchmarks and the soak report them."""

from __future__ import annotations

import statistics


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``xs``: the nearest-rank sample, None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(xs: list[float]) -> dict:
    """``{"mean", "median", "p99"}`` of ``xs`` (all None when empty)."""
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    return {
        "mean": statistics.fmean(xs),
        "median": statistics.median(xs),
        "p99": percentile(xs, 0.99),
    }


def median(xs: list[float], ndigits: int | None = None) -> float | None:
    """The median of ``xs`` (rounded to ``ndigits`` if given), None when empty."""
    if not xs:
        return None
    m = statistics.median(xs)
    return m if ndigits is None else round(m, ndigits)

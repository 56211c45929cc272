"""Summaries of measured values: median / min / max / n, and percentiles (NaN when empty)."""

from __future__ import annotations

import statistics

NAN = float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else NAN


def summary(values: list[float]) -> dict[str, float]:
    """median / min / max / n of a list (NaN when empty)."""
    return {"median": median(values), "min": min(values, default=NAN), "max": max(values, default=NAN),
            "n": len(values)}


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, interpolated linearly between the two nearest ranks."""
    if not values:
        return NAN
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

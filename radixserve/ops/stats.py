"""The two statistics every report here uses, defined once: a percentile of samples and a
least-squares line.

:func:`percentile` is over raw samples (latencies a client measured). It is not the quantile of a
Prometheus histogram (buckets, not samples): that one is
:func:`radixserve.ops.signals.hist_delta_quantile` and the server's own metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Fit", "linear_fit", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, ``q`` in [0, 100], of ``values``, interpolated linearly between
    the two nearest ranks (numpy's default ``linear`` method: p0 is the minimum, p100 the
    maximum, p50 the median). NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q is {q}; expected 0..100")
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


class Fit(NamedTuple):
    """``y = slope * x + intercept``; ``r2`` is the coefficient of determination (0 when x or y
    does not vary)."""

    slope: float
    intercept: float
    r2: float


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """Ordinary least-squares line through the points ``(xs[i], ys[i])``. With fewer than two
    distinct x the slope is 0 and the intercept the mean of y (0 for no points)."""
    if len(xs) != len(ys):
        raise ValueError(f"linear_fit: {len(xs)} x values but {len(ys)} y values")
    n = len(xs)
    if n == 0:
        return Fit(0.0, 0.0, 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx if sxx else 0.0
    r2 = (sxy * sxy / (sxx * syy)) if sxx and syy else 0.0
    return Fit(slope, my - slope * mx, r2)

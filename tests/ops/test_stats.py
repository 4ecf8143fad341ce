"""radixserve.ops.stats: the one percentile and the one least-squares line the reports use."""

from __future__ import annotations

import math

import pytest

from radixserve.ops.stats import linear_fit, percentile


def test_percentile_interpolates_linearly_between_ranks():
    xs = [40.0, 10.0, 30.0, 20.0]  # unsorted on purpose
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 40.0
    assert percentile(xs, 50) == 25.0  # the median of an even count
    assert percentile(xs, 99) == pytest.approx(30.0 + 10.0 * 0.97)
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="0..100"):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def test_linear_fit_recovers_a_line_and_reports_r2():
    xs = [0.0, 1.0, 2.0, 3.0]
    fit = linear_fit(xs, [1.0 + 2.0 * x for x in xs])
    assert fit.slope == pytest.approx(2.0) and fit.intercept == pytest.approx(1.0) and fit.r2 == pytest.approx(1.0)
    noisy = linear_fit(xs, [1.0, -1.0, 1.0, -1.0])
    assert noisy.slope == pytest.approx(-0.4) and 0 < noisy.r2 < 0.5


def test_linear_fit_degenerate_inputs():
    assert linear_fit([], []) == (0.0, 0.0, 0.0)
    assert linear_fit([5.0], [3.0]) == (0.0, 3.0, 0.0)
    assert linear_fit([1.0, 1.0], [2.0, 4.0]) == (0.0, 3.0, 0.0)  # x does not vary
    with pytest.raises(ValueError):
        linear_fit([1.0], [1.0, 2.0])

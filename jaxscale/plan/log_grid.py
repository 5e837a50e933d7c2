"""Interpolation on a measured grid, linear in log value against log coordinate: the one rule the predictor's
measured tables share (jaxscale.plan.collective_rates by buffer size, jaxscale.plan.gemm_rates by GEMM shape,
jaxscale.plan.attention_rates by sequence)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable


def bracket(values: tuple[int, ...], x: float) -> list[tuple[int, float]]:
    """The indices of the grid values around x, with their weights, linear in log x; x is clamped into the grid
    (outside it the end value alone, weight 1). `values` increase."""
    if x <= values[0]:
        return [(0, 1.0)]
    if x >= values[-1]:
        return [(len(values) - 1, 1.0)]
    upper = bisect.bisect_left(values, x)
    if values[upper] == x:
        return [(upper, 1.0)]
    share = math.log(x / values[upper - 1]) / math.log(values[upper] / values[upper - 1])
    return [(upper - 1, 1.0 - share), (upper, share)]


def interpolate(values: tuple[int, ...], x: float, measured: Callable[[int], float]) -> float:
    """The measured quantity at x (`measured(i)` at values[i]), linear in log quantity against log x between the grid
    values around it (bracket), the end value's outside the grid."""
    return math.exp(sum(weight * math.log(measured(i)) for i, weight in bracket(values, x)))

"""Step timing: wall-clock per step with block_until_ready, summarised as median and p90."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def time_call(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    """Runs fn(*args) and waits for its arrays; returns (result, seconds)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    return result, time.perf_counter() - start


def summarize(seconds: list[float]) -> dict[str, float | None]:
    """Median and 90th percentile (linear interpolation) of per-step times, in seconds."""
    if not seconds:
        return {"step_s_median": None, "step_s_p90": None}
    values = np.asarray(seconds, dtype=np.float64)
    return {"step_s_median": float(np.median(values)), "step_s_p90": float(np.percentile(values, 90))}

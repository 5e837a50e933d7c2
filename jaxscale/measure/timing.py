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


def input_wait_columns(waits: list[float], steps: list[float]) -> dict[str, object]:
    """How long each step waited for its batch, beside the step itself (host seconds, per timed step).

    Returns:
      input_wait_s_{median,p90,total,all}; step_with_input_wait_s_median, the median of wait + step (what
      a step costs in wall time when input is on its path); input_wait_fraction, total wait over total wait +
      step time (the share of the time the device idled for input). None where there are no steps.
    """
    if not waits:
        return {"input_wait_s_median": None, "input_wait_s_p90": None, "input_wait_s_total": None,
                "input_wait_s_all": [], "step_with_input_wait_s_median": None, "input_wait_fraction": None}  # fmt: skip
    w = np.asarray(waits, dtype=np.float64)
    both = w + np.asarray(steps, dtype=np.float64)
    return {
        "input_wait_s_median": float(np.median(w)),
        "input_wait_s_p90": float(np.percentile(w, 90)),
        "input_wait_s_total": float(w.sum()),
        "input_wait_s_all": [float(x) for x in w],
        "step_with_input_wait_s_median": float(np.median(both)),
        "input_wait_fraction": float(w.sum() / both.sum()),
    }

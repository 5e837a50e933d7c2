"""Profiler capture: K steps traced with jax.profiler into TensorBoard's layout."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import jax


def capture(trace_dir: pathlib.Path, num_steps: int, step: Callable[[], object], first_step: int = 0) -> list[str]:
    """Traces `num_steps` calls of step() into trace_dir/plugins/profile/<timestamp>/.

    Each call runs inside a StepTraceAnnotation("train", step_num=...), so TensorBoard's trace viewer and
    overview page show step boundaries. The step is waited for inside its annotation: JAX dispatches
    asynchronously, and without the wait the annotation would end when the step is sent off, not when it
    has run. Returns the trace files written.
    """
    with jax.profiler.trace(str(trace_dir)):
        for i in range(num_steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=first_step + i):
                jax.block_until_ready(step())
    return sorted(str(p) for p in trace_dir.glob("plugins/profile/*/*.xplane.pb"))

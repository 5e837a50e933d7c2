"""Sweeps: many variants of a config, each run in its own process, one table (`python -m jaxscale.sweep`)."""

from jaxscale.sweep.runner import (
    Sweep,
    SweepOutcome,
    Variant,
    expand_grid,
    load_results,
    load_sweep,
    main,
    run_sweep,
    select_variants,
)

__all__ = [
    "Sweep", "SweepOutcome", "Variant", "expand_grid", "load_results", "load_sweep", "main", "run_sweep",
    "select_variants",
]  # fmt: skip

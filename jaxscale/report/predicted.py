"""What a sweep's rows predict rather than measure: predicted step and tokens/s, the GPU they are for, its budget.

A plan (`--plan --target`, `plan_only`) runs no step: its step time and tokens/s are jaxscale.plan.predict's
(`predicted_step_s`, `predicted_tokens_per_s`) for the target GPU, and its peak is XLA's plan for that GPU. A
measured row may carry a prediction for its own device beside what it measured. The figures label each kind.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes

from jaxscale.plan import budget as budget_lib
from jaxscale.plan.gpu_plan import PlanFlagError

PLAN = "plan, not measured"
BUDGET_STYLES = ("--", ":", "-.")
BUDGET_COLOR = "#7a2020"


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series([None] * len(frame), index=frame.index, dtype=object)


def _numbers(frame: pd.DataFrame, name: str) -> pd.Series:
    return pd.to_numeric(_column(frame, name), errors="coerce")


def plan_rows(frame: pd.DataFrame) -> pd.Series:
    """True for each plan-only row (no step ran: its times are predictions for `plan_target`)."""
    return _column(frame, "plan_only").map(lambda value: value is True or value == 1).astype(bool)


def is_plan(frame: pd.DataFrame) -> bool:
    """Whether every row of the frame is a plan (nothing in it was measured on a device)."""
    return bool(len(frame)) and bool(plan_rows(frame).all())


def predicted_step(frame: pd.DataFrame) -> pd.Series:
    """Each ok row's predicted seconds per step (`predicted_step_s`), NaN elsewhere."""
    return _numbers(frame, "predicted_step_s").where(frame["status"] == "ok")


def predicted_throughput(frame: pd.DataFrame) -> pd.Series:
    """Each ok row's predicted tokens per second (`predicted_tokens_per_s`, all devices), NaN elsewhere."""
    return _numbers(frame, "predicted_tokens_per_s").where(frame["status"] == "ok")


def predicted_vs_baseline(frame: pd.DataFrame) -> pd.Series:
    """Each ok row's predicted tokens/s over its sweep's baseline's (the baseline an ok row with a prediction)."""
    values = predicted_throughput(frame)
    by_variant = {(s, v): values[i] for i, s, v in zip(frame.index, frame["sweep"], frame["variant"], strict=True)}
    base = [by_variant.get((s, b), float("nan")) for s, b in zip(frame["sweep"], frame["baseline"], strict=True)]
    return values / pd.Series(base, index=frame.index, dtype=float)


def does_not_fit(frame: pd.DataFrame) -> pd.Series:
    """True where a plan says the variant does not fit its target (`plan_fits` False)."""
    return _column(frame, "plan_fits").map(lambda value: value is False or value == 0).astype(bool)


def _unique(values: list[str]) -> str:
    return ", ".join(dict.fromkeys(v for v in values if v))


def _target(row: pd.Series) -> str:
    kind = row.get("plan_target_device_kind") or row.get("plan_target") or "an unnamed target"
    devices = pd.to_numeric(row.get("plan_devices"), errors="coerce")
    return f"{int(devices)} x {kind}" if not pd.isna(devices) and devices > 1 else str(kind)


def targets(frame: pd.DataFrame) -> str:
    """The devices the rows are about, in order: a plan's target GPU ('8 x NVIDIA H100 80GB HBM3' on a mesh),
    a measured row's device_kind."""
    plans = plan_rows(frame)
    return _unique([_target(row) if plan else str(row.get("device_kind") or "its device")
                    for (_, row), plan in zip(frame.iterrows(), plans, strict=True)])  # fmt: skip


def prediction_label(frame: pd.DataFrame) -> str:
    """'predicted for <GPU> (plan, not measured)' for plans, 'predicted for <device> (jaxscale.plan.predict)'
    for measured rows carrying a prediction: the targets of the rows with a predicted step or tokens/s."""
    predicted = frame[predicted_step(frame).notna() | predicted_throughput(frame).notna()]
    what = PLAN if len(predicted) and plan_rows(predicted).all() else "jaxscale.plan.predict"
    return f"predicted for {targets(predicted) or 'no target'} ({what})"


def planned_label(frame: pd.DataFrame) -> str | None:
    """'planned for <GPU> (plan, not measured)' of the frame's plan rows; None where it has none."""
    plans = frame[plan_rows(frame)]
    return f"planned for {targets(plans)} ({PLAN})" if len(plans) else None


def measured_devices(frame: pd.DataFrame) -> str:
    """The device kinds the frame's measured (not plan-only) rows ran on, e.g. 'cpu'."""
    return _unique([str(d) for d in frame.loc[~plan_rows(frame), "device_kind"].dropna()] if "device_kind" in frame
                   else [])  # fmt: skip


def row_budget(row: pd.Series) -> tuple[float, str] | None:
    """(bytes, where it comes from) a row's peak must stay under, per device; None where none is known.

    The run's own budget (`device_memory_budget_bytes`), else the fit planner's (`fit_budget_bytes`), else for a
    plan its target's default budget: what JAX's allocator gives the program's buffers (jaxscale.plan.budget,
    75% of the device's memory, no fraction set in the environment).
    """
    own = pd.to_numeric(row.get("device_memory_budget_bytes"), errors="coerce")
    if not pd.isna(own):
        return float(own), "the run's device_memory_budget_bytes"
    fit = pd.to_numeric(row.get("fit_budget_bytes"), errors="coerce")
    if not pd.isna(fit):
        return float(fit), str(row.get("fit_budget_source") or "the fit planner's budget")
    memory = pd.to_numeric(row.get("plan_target_memory_bytes"), errors="coerce")
    if pd.isna(memory) or not row.get("plan_target"):
        return None
    try:
        budget = budget_lib.for_target(str(row["plan_target"]), int(memory), environ={})
    except PlanFlagError:
        return None
    return float(budget.bytes), budget.source


def budgets(frame: pd.DataFrame) -> list[tuple[float, str]]:
    """The distinct budgets of the frame's rows (row_budget), in row order."""
    found = (row_budget(row) for _, row in frame.iterrows())
    return list(dict.fromkeys(b for b in found if b is not None))


def draw_budgets(ax: Axes, frame: pd.DataFrame, divisor: float, unit: str,
                 spans: dict[object, tuple[float, float]] | None = None) -> list[float]:  # fmt: skip
    """The budgets of the frame's rows as vertical lines (memory on the x axis); returns their x values.

    One budget is a line across the axes. Several (rows planned for different GPUs) are each drawn across its own
    rows' `spans` (row index -> y from, to) where given, so a reader sees which budget a bar is held to.
    """
    found = budgets(frame)
    for k, (size, source) in enumerate(found):
        x, style = size / divisor, dict(color=BUDGET_COLOR, lw=1.5, ls=BUDGET_STYLES[k % len(BUDGET_STYLES)], zorder=4)
        label = f"budget {x:.3g} {unit}:\n{source}"
        if spans is None or len(found) == 1:
            ax.axvline(x, label=label, **style)
            continue
        for i, row in frame.iterrows():
            if row_budget(row) == (size, source) and i in spans:
                ax.plot([x, x], spans[i], label=label, **style)
    return [size / divisor for size, _ in found]

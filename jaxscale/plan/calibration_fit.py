"""The calibration fit: per-group (and per-cell) efficiencies of the pure roofline and a launch cost, from one run.

The formulas, and what a calibration holds for, are in jaxscale/plan/calibrate.py's docstring and docs/predict.md
("Calibration"); this module fits them (`fit`) and predicts with them (`step_columns`, `local_columns`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import ml_collections

from jaxscale.config import mesh_shape
from jaxscale.measure import kernels
from jaxscale.plan import predict

FLAG = "--calibrate"
GROUPS = tuple(group for group in predict.BREAKDOWN if group != "launch")  # efficiencies are fitted per group
MIN_CELL_SHARE = 0.01  # a cell is fitted on its own when its ops take at least this share of the measured op time



class CalibrationError(ValueError):
    """A run that cannot calibrate this device's predictor; the message is one line naming --calibrate."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What one measured run fits: per-group efficiencies of the pure roofline and a cost per kernel launch."""

    run: str  # the run's directory, as given
    efficiency: dict[str, float]  # by group (GROUPS); a group the run has no measured op of is absent
    launch_s: float
    scale: float  # s: measured step / the traced step's span (or its ops' sum, where larger)
    roofline_s: dict[str, float]  # R_c
    measured_s: dict[str, float]  # M_c
    trace_step_s: float  # T
    step_s: float  # S
    launches: int  # N
    unmatched_kernels: int = 0  # launches per step of kernels without a measured op (tiny loop scalars on a CPU)
    # By predict.calibration_cell (group, precision, size), cells holding at least MIN_CELL_SHARE of the measured
    # op time: the fitted efficiency, and (R, M) of the cell. Empty: fitted by group only (by="group").
    cells: dict[tuple[str, str, int], float] = dataclasses.field(default_factory=dict)
    cell_seconds: dict[tuple[str, str, int], tuple[float, float]] = dataclasses.field(default_factory=dict)
    backend: str | None = None
    device_kind: str | None = None
    hostname: str | None = None

    def roofline(self, roof: predict.Roofline) -> predict.Roofline:
        """`roof` with the fitted efficiencies and launch cost (predict.Roofline.fitted_efficiency)."""
        fitted = ", ".join(f"{group} {value:.3g}" for group, value in self.efficiency.items())
        cells = f" and {len(self.cells)} cells of group, precision and size" if self.cells else ""
        return dataclasses.replace(
            roof,
            fitted_efficiency=dict(self.efficiency),
            fitted_cells=dict(self.cells) or None,
            launch_s=self.launch_s,
            source=f"{roof.source}; calibrated on {self.run}: fitted efficiencies of the pure roofline {fitted}"
            f"{cells}, launch {self.launch_s * 1e6:.3g} us (jaxscale/plan/calibrate.py)",
        )

    def columns(self) -> dict[str, object]:
        """The row's calibration columns: which run, and every fitted constant (None: not fitted)."""
        return {
            "prediction_calibrated_on": self.run,
            **{f"calibrated_{group}_efficiency": self.efficiency.get(group) for group in GROUPS},
            "calibrated_launch_s": self.launch_s,
            "calibrated_step_scale": self.scale,
            "calibrated_cells": [
                [*cell, efficiency, *self.cell_seconds[cell]] for cell, efficiency in sorted(self.cells.items())
            ],
        }


def fit(
    op_rows: Iterable[dict],
    found: Sequence[kernels.Kernel],
    roof: predict.Roofline,
    trace_step_s: float,
    step_s: float,
    run: str = "",
    by: str = "cell",
) -> Calibration:
    """Fits a Calibration (the formulas of this module's docstring) from a trace's ops and a program's kernels.

    Args:
      op_rows: traces.op_table rows (`op`: the HLO instruction's name, `self_s_per_step`: its measured seconds).
      found: the program's kernels (kernels.kernels of the run's HLO).
      roof: this device's roofline, uncalibrated.
      trace_step_s: T, the traced step's span.
      step_s: S, the measured step (the timed steps' median).
      run: what to call the run in the row (its directory).
      by: "cell" (efficiencies per predict.calibration_cell where the cell holds MIN_CELL_SHARE of the measured
        time, per group for the rest) or "group" (per group only).
    Raises:
      CalibrationError: no kernel of the program has a measured op, or the step times are not positive.
    """
    measured: dict[str, float] = {}
    for row in op_rows:
        measured[str(row["op"])] = measured.get(str(row["op"]), 0.0) + float(row["self_s_per_step"])
    ideal = dict.fromkeys(GROUPS, 0.0)
    groups: dict[str, str] = {}
    cells: dict[str, tuple[str, str, int]] = {}
    cell_ideal: dict[tuple[str, str, int], float] = {}
    launches, unmatched = 0, 0
    for kernel in found:
        launches += kernel.times
        if kernel.name not in measured:
            unmatched += kernel.times
            continue
        group = predict.breakdown_group(kernel.category)
        groups[kernel.name] = group
        bound = kernel.times * predict.kernel_seconds(kernel, roof)[1]  # the pure roofline
        ideal[group] += bound
        cell = cells[kernel.name] = predict.calibration_cell(kernel)
        cell_ideal[cell] = cell_ideal.get(cell, 0.0) + bound
    spent = dict.fromkeys(GROUPS, 0.0)
    cell_spent = dict.fromkeys(cell_ideal, 0.0)
    for name, group in groups.items():
        spent[group] += measured[name]
        cell_spent[cells[name]] += measured[name]
    if not groups:
        raise CalibrationError(f"{FLAG}: {run}: none of the trace's ops is a kernel of the run's compiled step")
    if not (trace_step_s > 0 and step_s > 0):
        raise CalibrationError(f"{FLAG}: {run}: needs a positive measured step and traced step")
    total = sum(spent.values())
    scale = step_s / max(trace_step_s, total)
    efficiency = {g: ideal[g] / (scale * spent[g]) for g in GROUPS if ideal[g] > 0 and spent[g] > 0}
    kept = (
        [c for c in cell_ideal if cell_ideal[c] > 0 and cell_spent[c] >= MIN_CELL_SHARE * total] if by == "cell" else []
    )
    launch_s = scale * max(0.0, trace_step_s - total) / launches if launches else 0.0
    return Calibration(
        run=run,
        efficiency=efficiency,
        launch_s=launch_s,
        scale=scale,
        roofline_s={g: v for g, v in ideal.items() if v},
        measured_s={g: v for g, v in spent.items() if v},
        trace_step_s=trace_step_s,
        step_s=step_s,
        launches=launches,
        unmatched_kernels=unmatched,
        cells={c: cell_ideal[c] / (scale * cell_spent[c]) for c in kept},
        cell_seconds={c: (cell_ideal[c], cell_spent[c]) for c in kept},
    )


def step_columns(
    config: ml_collections.ConfigDict, found: list[kernels.Kernel], roof: predict.Roofline, peak: float | None,
    fitted: Calibration,
) -> dict[str, object]:  # fmt: skip
    """predict.step_columns on the calibrated roofline, with the calibration's columns,
    predicted_uncalibrated_step_s (the same program on `roof` as it is) and how much of the program lies in sizes
    the calibration did not fit (predict.calibration_reach)."""
    uncalibrated = predict.step_columns(config, found, roof, peak)["predicted_step_s"]
    calibrated = fitted.roofline(roof)
    return {
        **predict.step_columns(config, found, calibrated, peak),
        "predicted_uncalibrated_step_s": uncalibrated,
        **fitted.columns(),
        **predict.calibration_reach(kernels.resolve_causal(found, bool(config.model.causal)), calibrated),
    }


def local_columns(
    config: ml_collections.ConfigDict, hlo_text: str, device: jax.Device, fitted: Calibration
) -> dict[str, object]:
    """predict.local_columns, calibrated (step_columns)."""
    roof = predict.local_roofline(device, mesh_shape(config).devices)
    if roof is None:
        return {"predicted_step_s": None, "predicted_error": f"no roofline for device_kind {device.device_kind!r}"}
    return step_columns(config, kernels.kernels(hlo_text), roof, predict.local_peak(config, device), fitted)

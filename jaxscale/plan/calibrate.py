"""Calibration: the step-time predictor's efficiencies fitted to one measured run of this device, from its trace.

`--calibrate RUN_DIR` (jaxscale.run, jaxscale.sweep) names a run measured on this device with a trace (its
directory holds result.json, step.hlo.txt.gz and plugins/profile/*/*.xplane.pb; jaxscale.run writes them when
profile.steps > 0). The run's compiled program gives its kernels (jaxscale.measure.kernels) and each kernel's
pure-roofline seconds r (max(FLOPs / peak, bytes / bandwidth) on this device's roofline, no efficiency, no
launch cost: jaxscale.plan.predict.kernel_seconds); its trace gives each HLO op's measured self seconds m
(jaxscale.measure.traces.op_table), joined by instruction name. With, per predictor group c (matmul, attention,
fusion, copy_dus, collective: predict.BREAKDOWN),

    R_c = sum of r x launches over c's kernels that have a measured op,  M_c = sum of their m,
    T   = the traced step's span (trace_step_s),  S = the measured step (step_s_median, the timed steps'),
    N   = kernel launches per step,  s = S / max(T, sum_c M_c)   (the traced step brought to the median's level),

the fitted constants are

    efficiency_c = R_c / (s · M_c)                       (a group with no measured op keeps the published cost)
    launch_s     = s · max(0, T - sum_c M_c) / N         (time in the step that no op covers, per launch)

and a calibrated kernel takes r / efficiency_c + launch_s: fitted by group, the calibration run's own step is then
predicted as S (plus the calibrated time of its kernels without a measured op).
By default (by="cell") the same ratio is also fitted per cell k = predict.calibration_cell (group, precision: 16- or
32-bit, size: floor(log4(bytes per launch))) whose ops take at least MIN_CELL_SHARE of the measured op time,
efficiency_k = R_k / (s · M_k); a kernel then takes its own cell's efficiency, else the nearest size's of its group
and precision, else its group's: a fusion of bf16 working sets of 16 MiB runs at what such fusions ran at, not
at the average of the run's fusions (docs/predict.md, "Calibration"). Fitted by cell, the run's own step is not
predicted exactly: its kernels in cells under MIN_CELL_SHARE take a neighbouring cell's efficiency.
The profiled step is one step of a shared machine, so its split is taken from the trace and its level from the
median of the timed steps (s). The fit is a ratio of sums, so the large ops weigh most, as they do in a step.
A calibration is only meaningful for other programs on the same device: load() refuses a run from another
backend, device kind or (on a CPU, whose roofline is measured per machine) host.
CLI: `python -m jaxscale.plan.calibrate RUN_DIR RUN_DIR ...` fits each run and predicts every other one from it
(leave-one-in: never on the run it was fitted on), printing the table; docs/predict.md, "Calibration".
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import pathlib
import platform
import statistics
import sys
import zlib
from collections.abc import Iterable, Sequence

import jax
import ml_collections
from absl import flags

from jaxscale.cli import Usage, UsageError, fail, parse_flags, print_help, wants_help
from jaxscale.config import mesh_shape
from jaxscale.measure import kernels, memory, traces
from jaxscale.plan import predict

FLAG = "--calibrate"
GROUPS = tuple(group for group in predict.BREAKDOWN if group != "launch")  # efficiencies are fitted per group
RESULT_FILE = "result.json"
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


def read_run(run_dir: str | pathlib.Path) -> tuple[dict, str]:
    """(result row, compiled step's HLO text) of a measured run with a trace.

    Raises:
      CalibrationError: one line naming --calibrate and what a calibration run needs, for a missing directory,
        a run without a row, not ok, not timed, or without its trace or HLO.
    """
    path = pathlib.Path(run_dir)
    needs = "a run directory of python -m jaxscale.run (not --plan) with a trace (profile.steps >= 1)"
    if not path.is_dir():
        raise CalibrationError(f"{FLAG}: {run_dir} is not a directory; give {needs}")
    if not (path / RESULT_FILE).is_file():
        raise CalibrationError(f"{FLAG}: {run_dir} holds no {RESULT_FILE}; give {needs}")
    try:
        row = json.loads((path / RESULT_FILE).read_text())
    except ValueError as error:
        raise CalibrationError(f"{FLAG}: {run_dir}/{RESULT_FILE} is not JSON ({error}); give {needs}") from None
    if row.get("status") != "ok" or not row.get("step_s_median"):
        what = "a plan, no step ran" if row.get("plan_only") else f"its status is {row.get('status')!r}"
        raise CalibrationError(f"{FLAG}: {run_dir} has no measured step ({what}); give {needs}")
    if not list(path.glob("plugins/profile/*/*.xplane.pb")) or not (path / traces.HLO_FILE).is_file():
        raise CalibrationError(f"{FLAG}: {run_dir} has no trace (plugins/profile/*/*.xplane.pb and "
                               f"{traces.HLO_FILE}); give {needs}")  # fmt: skip
    try:
        return row, gzip.decompress((path / traces.HLO_FILE).read_bytes()).decode()
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as error:
        raise CalibrationError(f"{FLAG}: {run_dir}/{traces.HLO_FILE} is unreadable ({error}); give {needs}") from None


def check_device(row: dict, run_dir: str, device: jax.Device) -> None:
    """Raises CalibrationError unless the run was measured on this device: same backend and device kind, and on
    a CPU the same host (its roofline is this machine's) and the same malloc where the run recorded one (the seed
    table's CPU steps were 6-25% shorter with tcmalloc than with glibc's: docs/measurements.md, "The CPU's
    allocator")."""
    here = {"backend": device.platform, "device_kind": device.device_kind}
    if device.platform == "cpu":
        here["hostname"] = platform.node()
        if row.get("host_allocator"):
            here["host_allocator"] = memory.host_allocator()
    for field, value in here.items():
        if row.get(field) != value:
            raise CalibrationError(
                f"{FLAG}: {run_dir} was measured with {field} {row.get(field)!r}, this run's is {value!r}; "
                "a calibration holds only for the device it was measured on: give a run of this device"
            )


def calibration(run_dir: str | pathlib.Path, device: jax.Device | None = None, by: str = "cell") -> Calibration:
    """Fits the Calibration of a measured run on this device's roofline (predict.local_roofline); `by` as in fit.

    Raises:
      CalibrationError: the run cannot calibrate (read_run), was measured on another device (check_device), or
        this device has no roofline.
    """
    row, hlo_text = read_run(run_dir)
    device = device or jax.devices()[0]
    check_device(row, str(run_dir), device)
    roof = predict.local_roofline(device, row.get("mesh_devices") or 1)
    if roof is None:
        raise CalibrationError(f"{FLAG}: no roofline for device_kind {device.device_kind!r} to calibrate")
    try:
        summary, rows = traces.analyze(pathlib.Path(run_dir), hlo_text, write_csv=False)
    except (OSError, ValueError, RuntimeError) as error:  # what ProfileData raises for a file it cannot read
        raise CalibrationError(f"{FLAG}: {run_dir}: its trace is unreadable ({error})") from None
    if not summary.get("trace_step_s"):
        raise CalibrationError(f"{FLAG}: {run_dir}: its trace has no annotated step to time")
    fitted = fit(rows, _run_kernels(row, hlo_text), roof, summary["trace_step_s"], row["step_s_median"],
                 run=str(run_dir), by=by)  # fmt: skip
    return dataclasses.replace(fitted, backend=row.get("backend"), device_kind=row.get("device_kind"),
                               hostname=row.get("hostname"))  # fmt: skip


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


def roofline_cells(found: Iterable[kernels.Kernel], roof: predict.Roofline) -> list[list]:
    """Pure-roofline seconds per step of a program's kernels by predict.calibration_cell, as
    [group, precision, size, seconds] rows (sorted)."""
    totals: dict[tuple[str, str, int], float] = {}
    for kernel in found:
        cell = predict.calibration_cell(kernel)
        totals[cell] = totals.get(cell, 0.0) + kernel.times * predict.kernel_seconds(kernel, roof)[1]
    return [[*cell, seconds] for cell, seconds in sorted(totals.items())]


def roofline_seconds(cells: Iterable[list]) -> dict[str, float]:
    """Pure-roofline seconds per step by group (GROUPS), summed from roofline_cells' rows."""
    totals = dict.fromkeys(GROUPS, 0.0)
    for group, _, _, seconds in cells:
        totals[group] += seconds
    return totals


def _run_kernels(row: dict, hlo_text: str) -> list[kernels.Kernel]:
    return kernels.resolve_causal(kernels.kernels(hlo_text), bool(row.get("config.model.causal", True)))


def cross_check(
    run_dirs: Sequence[str | pathlib.Path], device: jax.Device | None = None, by: str = "cell"
) -> list[dict[str, object]]:
    """Each run calibrates the predictor (`by` as in fit), which then predicts every *other* run's step.

    Returns:
      One row per (calibration run, predicted run), calibration run != predicted run: `calibrated_on`,
      `variant` (the predicted run's directory name), `step_s_median` (measured), `predicted_uncalibrated_step_s`,
      `predicted_step_s` (calibrated), `predicted_over_measured`, the predicted program's pure-roofline seconds
      per group (roofline_<group>_s, all its kernels) and per cell (roofline_cells), its launches
      (predicted_kernel_launches), and the
      calibration's constants and sums (R_c as calibration_roofline_<group>_s, M_c as
      calibration_measured_<group>_s, T, S, N, and the launches without a measured op): enough to redo every
      prediction by hand.
    """
    device = device or jax.devices()[0]
    runs = {pathlib.Path(d).name: (str(d), *read_run(d)) for d in run_dirs}
    fits = {name: calibration(path, device, by) for name, (path, _, _) in runs.items()}
    out = []
    for on, fitted in fits.items():
        for name, (_, row, hlo_text) in runs.items():
            if name == on:
                continue
            roof = predict.local_roofline(device, row.get("mesh_devices") or 1)
            calibrated = fitted.roofline(roof)
            found = _run_kernels(row, hlo_text)
            predicted = predict.predict(found, calibrated)
            step = predicted["predicted_step_s"]
            cells = roofline_cells(found, roof)
            out.append({
                "calibrated_on": on, "variant": name, "step_s_median": row["step_s_median"],
                "predicted_uncalibrated_step_s": predict.predict(found, roof)["predicted_step_s"],
                "predicted_step_s": step, "predicted_over_measured": step / row["step_s_median"],
                "predicted_kernel_launches": predicted["predicted_kernel_launches"],
                **{f"roofline_{g}_s": v for g, v in roofline_seconds(cells).items()},
                "roofline_cells": cells,
                **fitted.columns(),
                **predict.calibration_reach(found, calibrated),
                **{f"calibration_roofline_{g}_s": fitted.roofline_s.get(g, 0.0) for g in GROUPS},
                **{f"calibration_measured_{g}_s": fitted.measured_s.get(g, 0.0) for g in GROUPS},
                "calibration_trace_step_s": fitted.trace_step_s, "calibration_step_s": fitted.step_s,
                "calibration_launches": fitted.launches, "calibration_unmatched_launches": fitted.unmatched_kernels,
            })  # fmt: skip
    return out


def summary(rows: Sequence[dict], settled: set[frozenset[str]] | None = None) -> list[dict[str, object]]:
    """Per calibration run: max and mean |predicted / measured - 1| over the runs it predicts, whether their
    predicted order (fastest first) is their measured order, and how many of their pairs the prediction orders
    the other way round (discordant_pairs, of pairs). With `settled` (pairs of variants, see settled_pairs),
    only those pairs are counted."""
    out = []
    for on in dict.fromkeys(r["calibrated_on"] for r in rows):
        mine = [r for r in rows if r["calibrated_on"] == on]
        errors = [abs(r["predicted_over_measured"] - 1) for r in mine]
        measured = [r["variant"] for r in sorted(mine, key=lambda r: r["step_s_median"])]
        predicted = [r["variant"] for r in sorted(mine, key=lambda r: r["predicted_step_s"])]
        pairs = [(a, b) for a, b in itertools.combinations(mine, 2)
                 if settled is None or frozenset((a["variant"], b["variant"])) in settled]  # fmt: skip
        flipped = sum((a["step_s_median"] - b["step_s_median"]) * (a["predicted_step_s"] - b["predicted_step_s"]) < 0
                      for a, b in pairs)  # fmt: skip
        out.append({"calibrated_on": on, "max_abs_error": max(errors), "mean_abs_error": statistics.mean(errors),
                    "order_kept": measured == predicted, "discordant_pairs": flipped, "pairs": len(pairs),
                    "predicted": len(mine)})  # fmt: skip
    return out


def settled_pairs(*measurements: dict[str, float]) -> set[frozenset[str]]:
    """Pairs of variants that every measurement (variant -> measured step) orders the same way: the order a
    predictor can be checked against where repeated measurements of the same programs disagree."""
    names = sorted(set.intersection(*(set(m) for m in measurements)))
    return {frozenset((a, b)) for a, b in itertools.combinations(names, 2)
            if len({m[a] < m[b] for m in measurements}) == 1}  # fmt: skip


def remeasured(rows: Sequence[dict], steps: dict[str, float]) -> list[dict]:
    """cross_check rows judged against another measurement of the same programs (variant -> step_s_median, e.g.
    a later sweep's): the predictions are the same, measured and predicted_over_measured are the new ones'."""
    return [{**r, "step_s_median": steps[r["variant"]], "predicted_over_measured": r["predicted_step_s"] /
             steps[r["variant"]]} for r in rows if r["variant"] in steps]  # fmt: skip


def read_steps(path: str | pathlib.Path) -> dict[str, float]:
    """variant -> step_s_median of a sweep's results.jsonl (the ok rows).

    Raises:
      UsageError: one line naming --against, for a missing or unreadable file or one without measured rows.
    """
    try:
        rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise UsageError(f"--against: {path} is not a readable results.jsonl ({error})") from None
    steps = {r["variant"]: r["step_s_median"] for r in rows if r.get("status") == "ok" and r.get("step_s_median")}
    if not steps:
        raise UsageError(f"--against: {path} has no measured rows; give a sweep's results.jsonl")
    return steps


def markdown(rows: Sequence[dict]) -> str:
    """The cross check as two markdown tables: per calibration run, then every prediction."""
    shown = [g for g in GROUPS if any(r.get(f"calibrated_{g}_efficiency") for r in rows)]
    head = ["calibrated on", "max abs error", "mean abs error", "order kept", "pairs ordered wrongly", "launch us"]
    lines = ["| " + " | ".join([*head, *(f"{g} efficiency" for g in shown)]) + " |", "|" + "---|" * (6 + len(shown))]
    first = {r["calibrated_on"]: r for r in rows}
    for s in summary(rows):
        r = first[s["calibrated_on"]]
        cells = [s["calibrated_on"], f"{s['max_abs_error']:.1%}", f"{s['mean_abs_error']:.1%}",
                 "yes" if s["order_kept"] else "no", f"{s['discordant_pairs']} of {s['pairs']}",
                 f"{r['calibrated_launch_s'] * 1e6:.2f}",
                 *(f"{r[f'calibrated_{g}_efficiency']:.3f}" for g in shown)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| calibrated on | variant | measured s | uncalibrated s | calibrated s | calibrated / measured | "
              "roofline time above the calibration's sizes |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        above = r.get("calibration_above_share")
        lines.append(f"| {r['calibrated_on']} | {r['variant']} | {r['step_s_median']:.3f} | "
                     f"{r['predicted_uncalibrated_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{r['predicted_over_measured']:.2f} | {'–' if above is None else f'{above:.0%}'} |")  # fmt: skip
    return "\n".join(lines)


def against_markdown(rows: Sequence[dict], again: dict[str, dict[str, float]]) -> str:
    """Each calibration run judged against every later measurement (path -> variant -> step), order counted on
    the settled pairs (ordered alike by the calibration sweep's measurement and every later one)."""
    first = {r["variant"]: r["step_s_median"] for r in rows}
    settled = settled_pairs(first, *again.values())
    lines = ["", f"Against the same variants measured again; order on the {len(settled)} pairs every measurement "
             "orders alike:", "", "| calibrated on | measured again in | max abs error | mean abs error | "
             "error range | settled pairs ordered wrongly |", "|---|---|---|---|---|---|"]  # fmt: skip
    for path, steps in again.items():
        judged = remeasured(rows, steps)
        for s in summary(judged, settled):
            ratios = [r["predicted_over_measured"] - 1 for r in judged if r["calibrated_on"] == s["calibrated_on"]]
            error_range = f"{min(ratios):+.0%} to {max(ratios):+.0%}"
            cells = [s["calibrated_on"], path, f"{s['max_abs_error']:.1%}", f"{s['mean_abs_error']:.1%}",
                     error_range, f"{s['discordant_pairs']} of {s['pairs']}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


USAGE = Usage(
    command="python -m jaxscale.plan.calibrate RUN_DIR RUN_DIR [...] [--by cell|group] [--against RESULTS.jsonl] "
    "[--output FILE.jsonl]",
    summary="Calibrates the step-time predictor on each measured run in turn and predicts every other run with "
    "it: the fitted efficiencies, and each prediction against the measured step.",
    examples=(
        "python -m jaxscale.plan.calibrate traces/seed_table_cpu/*",
        "python -m jaxscale.plan.calibrate traces/seed_table_cpu/* --against experiments/results/seed_table_cpu_2/"
        "results.jsonl",
    ),
    notes=(
        "Each RUN_DIR is a run of python -m jaxscale.run measured on this device with a trace (a sweep's "
        "traces/<sweep>/<variant>). The formula is in jaxscale/plan/calibrate.py and docs/predict.md, "
        "'Calibration'; to calibrate a run's or a sweep's own prediction use their --calibrate RUN_DIR.",
    ),
)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxscale.plan.calibrate RUN_DIR RUN_DIR ...`: the leave-one-in table; exit 0, or 2 (bad input)."""
    fv = flags.FlagValues()
    flags.DEFINE_string("output", None, "Also write the rows as JSON lines to this file.", flag_values=fv)
    flags.DEFINE_multi_string(
        "against",
        [],
        "A results.jsonl of the same variants measured again (a later "
        "sweep): also judge every prediction against its steps; repeatable.",
        flag_values=fv,
    )
    flags.DEFINE_enum("by", "cell", ["cell", "group"], "Fit an efficiency per cell of group, precision and size "
                      "(with the group's for the rest), or per group only.", flag_values=fv)  # fmt: skip
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        rest = parse_flags(fv, argv)[1:]
        if len(rest) < 2:
            raise UsageError("give two or more RUN_DIRs, e.g. python -m jaxscale.plan.calibrate traces/<sweep>/*")
        again = {path: read_steps(path) for path in fv.against}  # checked first: it is cheap
        rows = cross_check(rest, by=fv.by)
    except (UsageError, CalibrationError) as error:
        return fail(str(error).replace(f"{FLAG}: ", "RUN_DIR: "))
    print(markdown(rows))
    if again:
        print(against_markdown(rows, again))
    if fv.output:
        pathlib.Path(fv.output).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

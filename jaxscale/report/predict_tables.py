"""docs/predict.md's calibration tables, written from the committed rows of the calibration sweeps' cross checks."""

from __future__ import annotations

import itertools
import json
import pathlib
import statistics

from jaxscale.report.models_tables import markdown
from jaxscale.sweep.results import read_rows

_GROUPS = ("matmul", "fusion", "copy_dus")
MICRO = 1e-6


def cross_check(path: pathlib.Path) -> list[dict]:
    """Every row of a cross check (calibration*.jsonl: one per calibration run and variant), in file order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps(rows: pathlib.Path) -> dict[str, float]:
    """variant -> measured step (median seconds) of a sweep's results.jsonl, in the file's order."""
    return {row["variant"]: row["step_s_median"] for row in read_rows(rows)}


def _runs(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(row["calibrated_on"] for row in rows))


def _predictions(rows: list[dict], on: str) -> dict[str, float]:
    return {row["variant"]: row["predicted_step_s"] for row in rows if row["calibrated_on"] == on}


def _errors(predicted: dict[str, float], measured: dict[str, float]) -> list[float]:
    return [predicted[variant] / measured[variant] - 1 for variant in predicted]


def _wrong(predicted: dict[str, float], measured: dict[str, float], pairs: set[frozenset[str]] | None = None) -> int:
    """Pairs of the predicted variants (of `pairs` where given) predicted in the reverse of their measured order."""
    return sum((predicted[x] - predicted[y]) * (measured[x] - measured[y]) < 0
               for x, y in itertools.combinations(predicted, 2)
               if pairs is None or frozenset((x, y)) in pairs)  # fmt: skip


def _pairs(predicted: dict) -> int:
    return len(list(itertools.combinations(predicted, 2)))


def _settled(*measured: dict[str, float]) -> set[frozenset[str]]:
    """Pairs of variants that every measurement orders alike."""
    return {frozenset((x, y)) for x, y in itertools.combinations(measured[0], 2)
            if len({m[x] < m[y] for m in measured}) == 1}  # fmt: skip


def _max_mean(errors: list[float]) -> str:
    return f"{max(map(abs, errors)):.1%} / {statistics.mean(map(abs, errors)):.1%}"


def _span(errors: list[float]) -> str:
    return f"{min(errors):+.0%} to {max(errors):+.0%}"


def _settled_wrong(predicted: dict[str, float], later: list[dict[str, float]], settled: set) -> str:
    """`wrong of settled`: the settled pairs among the predicted variants ordered wrongly (alike for every later
    measurement, since they all order a settled pair the same way)."""
    kept = {pair for pair in settled if pair <= set(predicted)}
    return f"{_wrong(predicted, later[0], kept)} of {len(kept)}"


def _uncalibrated(results: dict[str, dict], checks: list[dict]) -> list[str]:
    """The uncalibrated row's efficiencies (roofline over predicted seconds per group) and launch cost (µs)."""
    roofline = {row["variant"]: row for row in checks}
    efficiencies = [sum(roofline[v][f"roofline_{g}_s"] for v in results) / sum(r[f"predicted_{g}_s"]
                    for r in results.values()) for g in _GROUPS]  # fmt: skip
    launch = sum(r["predicted_launch_s"] for r in results.values()) / sum(
        r["predicted_kernel_launches"] for r in results.values())
    return [*(f"{e:.2f}" for e in efficiencies), f"{launch / MICRO:.0f}"]


def calibration_table(results: pathlib.Path, calibration: pathlib.Path) -> str:
    """Each run as the calibration (by group) over the others: errors, order, the fitted efficiencies and launch
    cost; last, the uncalibrated prediction of every variant.

    Args:
      results: the calibration sweep's results.jsonl (measured steps, uncalibrated predictions).
      calibration: its cross check (calibration.jsonl).

    Returns:
      The markdown table.
    """
    checks, measured = cross_check(calibration), {row["variant"]: row for row in read_rows(results)}
    header = ("calibrated on", "max abs error", "mean abs error", "order kept", "pairs ordered wrongly",
              "matmul eff.", "fusion eff.", "copy/DUS eff.", "launch µs")  # fmt: skip
    lines = []
    for on in _runs(checks):
        fit = next(row for row in checks if row["calibrated_on"] == on)
        predicted = _predictions(checks, on)
        errors = [abs(e) for e in _errors(predicted, steps(results))]
        wrong = _wrong(predicted, steps(results))
        lines.append((on, f"{max(errors):.0%}", f"{statistics.mean(errors):.0%}", "yes" if wrong == 0 else "no",
                      f"{wrong} of {_pairs(predicted)}",
                      *(f"{fit[f'calibrated_{g}_efficiency']:.2f}" for g in _GROUPS),
                      f"{fit['calibrated_launch_s'] / MICRO:.0f}"))  # fmt: skip
    errors = [abs(row["predicted_step_s"] / row["step_s_median"] - 1) for row in measured.values()]
    lines.append(("uncalibrated", f"{max(errors):.0%}", f"{statistics.mean(errors):.0%}", "", "",
                  *_uncalibrated(measured, checks)))  # fmt: skip
    return markdown(header, lines)


def _calibrated_on(rows: list[dict]) -> str:
    """The variant a calibrated sweep was calibrated on (the last part of its prediction_calibrated_on)."""
    return rows[0]["prediction_calibrated_on"].rsplit("/", 1)[1]


def measured_again_table(results: pathlib.Path, calibration: pathlib.Path, again: pathlib.Path) -> str:
    """The calibration run the second sweep was calibrated on: each variant measured, predicted uncalibrated and
    calibrated (the cross check), and measured again by the second sweep with its calibrated prediction."""
    measured, checks, later = read_rows(results), cross_check(calibration), read_rows(again)
    on = _calibrated_on(later)
    predicted = {row["variant"]: row for row in checks if row["calibrated_on"] == on}
    header = ("variant", "measured s", "uncalibrated s", "calibrated s", "calibrated / measured", "measured again s",
              "calibrated / measured again")  # fmt: skip
    lines = []
    again_by_variant = {row["variant"]: row for row in later}
    for row in measured:
        mine, other = predicted.get(row["variant"]), again_by_variant[row["variant"]]
        calibrated = (f"{mine['predicted_step_s']:.2f}", f"{mine['predicted_over_measured']:.2f}") if mine else (
            "(calibration run)", "-")
        lines.append((row["variant"], f"{row['step_s_median']:.2f}", f"{row['predicted_step_s']:.2f}", *calibrated,
                      f"{other['step_s_median']:.2f}", f"{other['predicted_step_s'] / other['step_s_median']:.2f}"))
    return markdown(header, lines)


def leave_one_in_table(results: pathlib.Path, groups: pathlib.Path, cells: pathlib.Path) -> str:
    """Each run of a sweep calibrating the others, against that sweep's steps: fitted by group, by cell."""
    measured, by_group, by_cell = steps(results), cross_check(groups), cross_check(cells)
    header = ("calibrated on", "groups: max / mean abs error", "cells: max / mean abs error",
              "cells: pairs ordered wrongly")  # fmt: skip
    lines = []
    for on in measured:
        cell, group = _predictions(by_cell, on), _predictions(by_group, on)
        lines.append((on, _max_mean(_errors(group, measured)), _max_mean(_errors(cell, measured)),
                      f"{_wrong(cell, measured)} of {_pairs(cell)}"))  # fmt: skip
    return markdown(header, lines)


def out_of_sample_table(cells: pathlib.Path, results: pathlib.Path, *later: pathlib.Path) -> str:
    """Each run of sweep A calibrating the others (by cell), against their later measurements (sweeps B, C)."""
    checks, measured = cross_check(cells), steps(results)
    again = [steps(path) for path in later]
    settled = _settled(measured, *again)
    header = ("calibrated on (sweep A)", "vs sweep B: max / mean abs error", "vs sweep C: max / mean abs error",
              "error range (B; C)", "settled pairs ordered wrongly")  # fmt: skip
    lines = []
    for on in measured:
        predicted = _predictions(checks, on)
        spans = "; ".join(_span(_errors(predicted, m)) for m in again)
        lines.append((on, *(_max_mean(_errors(predicted, m)) for m in again), spans,
                      _settled_wrong(predicted, again, settled)))  # fmt: skip
    return markdown(header, lines)


def four_sweeps_table(cells: pathlib.Path, results: pathlib.Path, *later: pathlib.Path) -> str:
    """Each run of sweep D calibrating the others (by cell), in sample and against later sweeps E, F, G."""
    checks, measured = cross_check(cells), steps(results)
    again = [steps(path) for path in later]
    settled = _settled(measured, *again)
    header = ("calibrated on (sweep D)", "leave-one-in on D: max / mean abs error, pairs ordered wrongly",
              "vs E: max / mean", "vs F: max / mean", "vs G: max / mean", "error range (E; F; G)",
              "settled pairs ordered wrongly")  # fmt: skip
    lines = []
    for on in measured:
        predicted = _predictions(checks, on)
        in_sample = f"{_max_mean(_errors(predicted, measured))}, {_wrong(predicted, measured)} of {_pairs(predicted)}"
        spans = "; ".join(_span(_errors(predicted, m)) for m in again)
        lines.append((on, in_sample, *(_max_mean(_errors(predicted, m)) for m in again), spans,
                      _settled_wrong(predicted, again, settled)))  # fmt: skip
    return markdown(header, lines)


def _calibrated_sweep(rows: pathlib.Path, sweep: str, with_calibration_run: bool) -> str:
    found = read_rows(rows)
    on = _calibrated_on(found)
    header = ("variant", f"measured s ({sweep})", "uncalibrated s", "calibrated s", "calibrated / measured")
    lines = [(row["variant"], f"{row['step_s_median']:.3f}", f"{row['predicted_uncalibrated_step_s']:.3f}",
              f"{row['predicted_step_s']:.3f}", f"{row['predicted_over_measured']:.2f}")
             for row in found if with_calibration_run or row["variant"] != on]  # fmt: skip
    return markdown(header, lines)


def sweep_c_table(rows: pathlib.Path) -> str:
    """Sweep C (calibrated on a run of sweep A): the six other variants' measured step and predictions."""
    return _calibrated_sweep(rows, "C", with_calibration_run=False)


def sweep_g_table(rows: pathlib.Path) -> str:
    """Sweep G (calibrated on a run of sweep D): every variant's measured step and predictions, its own included."""
    return _calibrated_sweep(rows, "G", with_calibration_run=True)


def _seconds(row: dict, *groups: str) -> list[str]:
    return [f"{row[f'predicted_{group}_s']:.3f}" for group in groups]


def notebook_check_table(rows: pathlib.Path) -> str:
    """Each variant's predicted step (the faster GEMM mode) against the step the notebook measured on its A5000
    (`notebook_step_s`, which the sweep joins into its a5000 rows), both modes' predictions and the faster one's
    breakdown.

    Args:
      rows: the `--plan --target a5000` sweep's results.jsonl.

    Returns:
      The markdown table.
    """
    header = ("variant", "notebook s", "predicted s", "predicted / notebook", "Triton GEMMs s", "cuBLAS GEMMs s",
              "roofline bound s", "matmul s", "fusions s", "copies + DUS s", "launch s", "kernels",
              "predicted MFU")  # fmt: skip
    lines = []
    for row in read_rows(rows):
        notebook = row.get("notebook_step_s")
        lines.append((row["variant"], f"{notebook:g}" if notebook else "not timed", *_seconds(row, "step"),
                      f"**{row['predicted_step_s'] / notebook:.2f}**" if notebook else "-",
                      *_seconds(row, "triton_step", "cublas_step", "step_lower_bound", "matmul", "fusion",
                                "copy_dus", "launch"),
                      f"{row['predicted_kernel_launches']:,}", f"{row['predicted_mfu']:.1%}"))  # fmt: skip
    return markdown(header, lines)


def h100_plan_table(rows: pathlib.Path, a5000: pathlib.Path) -> str:
    """Each variant's predicted H100 step with its breakdown, and how many times longer its A5000 prediction is.

    Args:
      rows: the `--plan --target h100` sweep's results.jsonl.
      a5000: the same sweep's `--plan --target a5000` results.jsonl.

    Returns:
      The markdown table.
    """
    on_a5000 = steps_predicted(a5000)
    header = ("variant", "predicted s", "roofline bound s", "matmul s", "fusions s", "copies + DUS s", "launch s",
              "predicted MFU", "A5000 / H100")  # fmt: skip
    lines = [(row["variant"], *_seconds(row, "step", "step_lower_bound", "matmul", "fusion", "copy_dus", "launch"),
              f"{row['predicted_mfu']:.1%}", f"{on_a5000[row['variant']] / row['predicted_step_s']:.1f}x")
             for row in read_rows(rows)]  # fmt: skip
    return markdown(header, lines)


def steps_predicted(rows: pathlib.Path) -> dict[str, float]:
    """variant -> predicted step (seconds) of a plan sweep's results.jsonl, in the file's order."""
    return {row["variant"]: row["predicted_step_s"] for row in read_rows(rows)}

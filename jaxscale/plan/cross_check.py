"""The leave-one-in cross check: each run calibrates the predictor, which then predicts every other run's step."""

from __future__ import annotations

import itertools
import pathlib
import statistics
from collections.abc import Iterable, Sequence

import jax

from jaxscale.measure import kernels
from jaxscale.plan import predict
from jaxscale.plan.calibration_fit import GROUPS
from jaxscale.plan.calibration_io import calibration, read_run, run_kernels


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
            found = run_kernels(row, hlo_text)
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

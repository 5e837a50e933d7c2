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

import json
import pathlib
import sys

from absl import flags

from jaxscale.cli import Usage, UsageError, fail, parse_flags, print_help, wants_help
from jaxscale.plan.calibration_fit import (
    FLAG,
    GROUPS,
    MIN_CELL_SHARE,
    Calibration,
    CalibrationError,
    fit,
    local_columns,
    step_columns,
)
from jaxscale.plan.calibration_io import RESULT_FILE, calibration, check_device, read_run, read_steps
from jaxscale.plan.cross_check import cross_check, remeasured, roofline_cells, roofline_seconds, settled_pairs, summary
from jaxscale.plan.cross_check_tables import against_markdown, markdown

# The calibration's names, importable from here as before the split (jaxscale.run, jaxscale.sweep, the tests).
__all__ = ["FLAG", "GROUPS", "MIN_CELL_SHARE", "RESULT_FILE", "Calibration", "CalibrationError", "against_markdown",
           "calibration", "check_device", "cross_check", "fit", "local_columns", "main", "markdown", "read_run",
           "read_steps", "remeasured", "roofline_cells", "roofline_seconds", "settled_pairs", "step_columns",
           "summary"]  # fmt: skip


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

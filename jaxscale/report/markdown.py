"""A sweep read without a notebook: `python -m jaxscale.report experiments/results/<sweep>` writes PNGs + report.md.

The figures come from jaxscale.plots (the notebook experiments/compare_sweeps.ipynb calls the same functions);
this module adds the table, the markdown report and the command line.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import matplotlib
import pandas as pd
from absl import flags

from jaxscale.cli import Usage, UsageError, fail, one_argument, print_help, wants_help
from jaxscale.report.plots import (
    ANALYTIC_PARTS,
    ANALYTIC_PEAK,
    figures,
    memory_unit,
    plot_input_wait,
    plot_memory_breakdown,
    plot_op_shares,
    plot_time_vs_memory,
    plot_tokens_per_s,
    plot_vs_baseline,
    reads_input,
    share_columns,
    speed_vs_baseline,
    throughput,
    variant_labels,
    with_peak,
)
from jaxscale.report.predicted import (
    budgets,
    is_plan,
    predicted_step,
    predicted_throughput,
    prediction_label,
    targets,
)
from jaxscale.sweep.results import RESULTS_FILE, load_results, mesh_of

__all__ = [
    "figures",
    "notes",
    "plot_input_wait",
    "plot_memory_breakdown",
    "plot_op_shares",
    "plot_time_vs_memory",
    "plot_tokens_per_s",
    "plot_vs_baseline",
    "reads_input",
    "summary_table",
    "to_markdown",
    "variant_labels",
    "write_report",
]

REPORT_FILE = "report.md"
# PNG text chunks: matplotlib writes its version as "Software"; none, so a regenerated figure has the same bytes.
PNG_METADATA = {"Software": None}
WALL_TOKENS = "tokens/s (wall, input wait included)"

# What each figure shows, written under it in report.md (the notebook says the same in its markdown cells).
CAPTIONS = {
    "time_vs_memory": "Median step time against peak memory (its source on the axis). Down and left is better; "
    "the ringed points joined by the line are the Pareto front: no other variant is both faster and smaller.",
    "tokens_per_s": "Tokens per second from the median step time; longer is faster. Failed variants show their "
    "status instead of a bar.",
    "memory_breakdown": "Per variant, the analytic estimate (params, grads, optimizer state, activations) beside "
    "XLA's compiled plan (arguments + outputs not aliased to a donated input + temporaries); x marks the device "
    "allocator's peak where the backend has one.",
    "op_shares": "Share of the profiled steps' op time by category, from the trace analysis (trace_*_share).",
    "vs_baseline": "Throughput and peak memory relative to the sweep's baseline variant (1.0 = the same); "
    "a memory ratio is shown only where both peaks come from the same source.",
}
# Where the sweep has input waits (its batches come from the host), time and throughput are wall time.
INPUT_CAPTIONS = {
    "time_vs_memory": "Median wall time per step, the wait for its batch included, against peak memory (its "
    "source on the axis). Down and left is better; the ringed points joined by the line are the Pareto front.",
    "tokens_per_s": "Tokens per second in wall time: tokens per step over the median of input wait + step "
    "(tokens_per_s_with_input_wait), so a run that waits for its input shows it; longer is faster.",
    "vs_baseline": "Wall-time throughput (input wait included) and peak memory relative to the sweep's baseline "
    "(1.0 = the same): below 1, the variant trains fewer tokens per second of wall time than the baseline.",
    "input_wait": "Per variant, the compiled step (median, blue) and the wait for its batch before it (median, "
    "red), with the share of wall time spent waiting (input_wait_fraction): the input-bound runs are the red ones.",
}


# Where nothing ran (a plan for a target GPU), times are jaxscale.plan.predict's and peaks XLA's plan for the target.
PLAN_CAPTIONS = {
    "time_vs_memory": "Predicted step time (jaxscale.plan.predict) against XLA's planned peak memory on the target "
    "GPU: a plan, nothing ran there. Down and left is better; the ringed points joined by the line are the Pareto "
    "front of the predictions.",
    "tokens_per_s": "Predicted tokens per second on the target GPU (tokens per step / predicted step time), a plan, "
    "not a measurement; longer is faster. Failed variants show their status instead of a bar.",
    "vs_baseline": "Predicted throughput and planned peak memory relative to the sweep's baseline variant (1.0 = the "
    "same).",
}
# Where measured rows carry a prediction too, both are drawn.
PREDICTED_CAPTIONS = {
    "time_vs_memory": CAPTIONS["time_vs_memory"] + " A hollow diamond joined by a dotted line is the same variant's "
    "predicted step time (jaxscale.plan.predict).",
    "tokens_per_s": CAPTIONS["tokens_per_s"] + " The dotted bar under each is the predicted tokens/s "
    "(jaxscale.plan.predict).",
}
BUDGET_CAPTION = (
    " The dashed vertical line is the memory budget per device (the run's, the fit planner's, or for a plan what "
    "JAX's allocator gives the program on the target GPU: jaxscale/plan/budget.py)."
)


def captions(frame: pd.DataFrame) -> dict[str, str]:
    """What each figure shows, as written under it in report.md: wall-time wording where input was waited for,
    predictions named where the rows are a plan (or carry one beside what they measured), the budget where known."""
    found = {**CAPTIONS, **INPUT_CAPTIONS} if reads_input(frame) else dict(CAPTIONS)
    if is_plan(frame):
        found.update(PLAN_CAPTIONS)
    elif predicted_step(frame).notna().any():
        found.update(PREDICTED_CAPTIONS)
    if budgets(frame):
        found["time_vs_memory"] += BUDGET_CAPTION
        found["memory_breakdown"] += BUDGET_CAPTION
    return found


# Predicted step time (jaxscale.plan.predict) beside what it predicts, where rows have them.
PREDICTED_COLUMNS = {
    "predicted_step_s": "predicted step s",
    "predicted_tokens_per_s": "predicted tokens/s",
    "predicted_over_measured": "predicted / measured",
    "notebook_step_s": "notebook step s",
    "predicted_over_notebook": "predicted / notebook",
}


def _ratio_text(value: float | None, faster: bool, predicted: bool = False) -> str:
    if value is None or pd.isna(value):
        return "-"
    if faster:
        text = f"{value:.2f}x faster" if value >= 1 else f"{1 / value:.2f}x slower"
        return f"{text} (predicted)" if predicted else text
    return f"{value:.2f}x memory"


def summary_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The sweep table for people: one row per variant, units in the column names, sources named.

    Args:
      frame: rows from jaxscale.sweep.load_results (one sweep, or several concatenated).

    Returns:
      DataFrame with variant, status, the mesh (where a variant has one), step time, tokens/s, compile time,
      peak memory (GiB, per device on a mesh) and its source, the analytic peak where known, the predicted
      step time beside the measured (or the notebook's) where rows have it, the collectives' MiB per device
      and step by kind (where any), and the change against the baseline variant; the error of failures.
      Where the sweep has input waits (plots.reads_input), the input wait, step + wait, the wait share and
      tokens/s in wall time take the place of tokens/s, and the change against the baseline is in wall time.
      A plan (nothing ran: predicted.is_plan) leaves out the measured step and tokens/s, says whether each
      variant fits its target, and compares predicted throughput with the baseline's, saying so.
    """
    frame = with_peak(frame)
    divisor, unit = memory_unit(frame["best_peak_bytes"])
    table = pd.DataFrame(
        {
            "variant": variant_labels(frame),
            "status": frame["status"],
            "step s (median)": pd.to_numeric(frame["step_s_median"], errors="coerce"),
            "tokens/s": pd.to_numeric(frame["tokens_per_s"], errors="coerce"),
            "compile s": pd.to_numeric(frame["compile_s"], errors="coerce"),
            f"peak {unit}": pd.to_numeric(frame["best_peak_bytes"], errors="coerce") / divisor,
            "peak source": frame["best_peak_source"],
        }
    )
    if reads_input(frame):  # wall time: the step and the wait for its batch; tokens/s of the step alone left out
        table = table.drop(columns="tokens/s")
        wait = {
            "input wait s (median)": "input_wait_s_median",
            "step + wait s (median)": "step_with_input_wait_s_median",
            "wait share": "input_wait_fraction",
        }
        for position, (header, column) in enumerate(wait.items(), start=3):
            table.insert(position, header, pd.to_numeric(frame.get(column), errors="coerce"))
        table.insert(6, WALL_TOKENS, throughput(frame)[0])
    if is_plan(frame):  # nothing was measured: the predicted columns below take their place
        table = table.drop(columns=["step s (median)", "tokens/s"])
        fits = frame.get("plan_fits", pd.Series([None] * len(frame), index=frame.index))
        table.insert(2, "fits", [{True: "yes", False: "no"}.get(value, "-") for value in fits])
    if ANALYTIC_PEAK in frame:
        table[f"analytic peak {unit}"] = pd.to_numeric(frame[ANALYTIC_PEAK], errors="coerce") / divisor
    for column, header in PREDICTED_COLUMNS.items():
        if column in frame and frame[column].notna().any():
            table[header] = pd.to_numeric(frame[column], errors="coerce")
    meshes = [mesh_of(row) for row in frame.to_dict("records")]
    if any(mesh != "1x1x1" for mesh in meshes):
        table.insert(2, "mesh", meshes)
    if pd.to_numeric(frame["compiled_collective_bytes"], errors="coerce").fillna(0).gt(0).any():
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            column = frame.get(f"compiled_collective_{kind}_bytes", pd.Series([None] * len(frame)))
            table[f"{kind.replace('_', '-')} MiB"] = pd.to_numeric(column, errors="coerce") / 2**20
        table["collective MiB"] = pd.to_numeric(frame["compiled_collective_bytes"], errors="coerce") / 2**20
    is_baseline = frame["variant"] == frame["baseline"]
    ratios, predicted = speed_vs_baseline(frame)
    speed = [_ratio_text(v, True, p) for v, p in zip(ratios, predicted, strict=True)]
    memory = [_ratio_text(v, False) for v in frame["peak_vs_baseline"]]
    table["vs baseline"] = [
        "baseline" if base else ", ".join(t for t in (s, m) if t != "-") or "-"
        for base, s, m in zip(is_baseline, speed, memory, strict=True)
    ]
    table["error"] = frame["error"].where(frame["status"] != "ok", None)
    return table


def _markdown_cell(value: object, column: str) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "-"
    if isinstance(value, float):
        spec = {"step s (median)": ".4f", "tokens/s": ",.0f", "compile s": ".1f", "predicted step s": ".4f",
                "predicted tokens/s": ",.0f",
                WALL_TOKENS: ",.0f", "input wait s (median)": ".4f", "step + wait s (median)": ".4f",
                "wait share": ".0%"}.get(column, ".3f")  # fmt: skip
        return format(value, spec)
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(table: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table (numbers formatted, missing values as '-')."""
    columns = list(table.columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for _, row in table.iterrows():
        lines.append("| " + " | ".join(_markdown_cell(row[c], c) for c in columns) + " |")
    return "\n".join(lines)


def notes(frame: pd.DataFrame) -> list[str]:
    """Caveats a reader needs: where peak memory came from, and which measured columns are absent."""
    found, frame = [], with_peak(frame)
    if reads_input(frame):
        found.append(
            "Input: this sweep reads batches from the host (data.source), so time and throughput are wall time, the "
            "wait for each batch included (step + wait s, tokens_per_s_with_input_wait), and so are the ratios "
            "against the baseline; tokens_per_s, the compiled step alone, is in the results file."
        )
    if is_plan(frame):
        found.append(
            f"Plan, not measured: no step ran. Step times and tokens/s are predicted by jaxscale.plan.predict "
            f"(predicted_step_s, predicted_tokens_per_s) and peaks are XLA's plan (compiled_peak_bytes), "
            f"for {targets(frame)}; fits is the plan's own verdict (plan_fits, jaxscale.plan.gpu_plan)."
        )
    elif predicted_throughput(frame).notna().any():
        found.append(f"Predicted beside measured: predicted_step_s and predicted_tokens_per_s are "
                     f"{prediction_label(frame)}, drawn beside the measured values.")  # fmt: skip
    found += [f"Memory budget per device: {size / 2**30:.2f} GiB, {source}." for size, source in budgets(frame)]
    sources = sorted({s for s in frame["best_peak_source"].dropna()})
    if sources:
        found.append(f"Peak memory source: {', '.join(sources)} (the device allocator's peak where the backend "
                     "has one, else XLA's compiled plan; a CPU plan is only a proxy for a GPU's).")  # fmt: skip
    if any(mesh_of(row) != "1x1x1" for row in frame.to_dict("records")):
        found.append("Mesh variants: memory and collective MiB are per device; collectives are counted per optimizer "
                     "step from the compiled HLO (bytes each device's collectives work on; docs/mesh.md).")  # fmt: skip
    device_notes = frame.get("device_peak_note", pd.Series(dtype=object)).dropna().unique()
    if len(device_notes):
        found.append(f"Device peak: {device_notes[0]}.")
    missing = [c for c, _ in ANALYTIC_PARTS if c not in frame]
    if missing:
        found.append(f"Not in these results: {', '.join(missing)} (the analytic memory model's columns).")
    if not share_columns(frame):
        found.append("Not in these results: trace_*_share columns (the trace analysis' op-category shares).")
    return found


def write_report(results: str | os.PathLike, output_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Writes each figure as <name>.png and report.md (table, figures, notes) for one sweep.

    Args:
      results: the sweep's results directory (or its results.jsonl).
      output_dir: where to write (default: beside the results).

    Returns:
      The path of report.md.

    Raises:
      UsageError: no results there, or no rows in them.
    """
    results = pathlib.Path(results)
    jsonl = results / RESULTS_FILE if results.is_dir() else results
    if not jsonl.is_file():
        raise UsageError(f"{results}: no sweep results ({RESULTS_FILE}) there; run python -m jaxscale.sweep first")
    frame = load_results(jsonl)
    if frame.empty:
        raise UsageError(f"{jsonl}: holds no result rows yet; run python -m jaxscale.sweep first")
    output_dir = pathlib.Path(output_dir) if output_dir else jsonl.parent
    output_dir.mkdir(parents=True, exist_ok=True)
    sweeps = ", ".join(str(s) for s in frame["sweep"].dropna().unique()) or jsonl.parent.name
    baselines = ", ".join(str(b) for b in frame["baseline"].dropna().unique()) or "-"
    lines = [f"# Sweep {sweeps}", "", f"Results: `{jsonl}` ({len(frame)} variants; baseline: {baselines}).", ""]
    lines += [to_markdown(summary_table(frame)), ""]
    lines += [f"- {note}" for note in notes(frame)] + [""]
    for name, figure in figures(frame).items():
        figure.savefig(output_dir / f"{name}.png", dpi=110, metadata=PNG_METADATA)
        lines += [f"## {name.replace('_', ' ')}", "", f"![{name}]({name}.png)", "", captions(frame)[name], ""]
    path = output_dir / REPORT_FILE
    path.write_text("\n".join(lines))
    return path


USAGE = Usage(
    command="python -m jaxscale.report RESULTS_DIR [--output_dir DIR]",
    summary="Writes a sweep's figures (PNG) and report.md (the table, the figures and what each shows) from its "
    "results directory; the notebook experiments/compare_sweeps.ipynb draws the same figures.",
    examples=(
        "python -m jaxscale.report experiments/results/seed_table_cpu",
        "python -m jaxscale.report experiments/results/seed_table_seed_plan_a5000 --output_dir /tmp/report",
    ),
    notes=("RESULTS_DIR is a sweep's experiments/results/<sweep>/ (holding results.jsonl). See docs/report.md.",),
)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("output_dir", None, "Where to write the PNGs and report.md (default: beside the results).",
                        flag_values=fv)  # fmt: skip
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `python -m jaxscale.report RESULTS_DIR [--output_dir DIR]`; exit 0, or 2 on bad input."""
    matplotlib.use("Agg")  # files only, never a window
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        hint = "give one results directory, e.g. python -m jaxscale.report experiments/results/<sweep>"
        path = write_report(one_argument(fv, argv, hint), fv.output_dir)
    except UsageError as error:
        return fail(str(error))
    print(f"report: {path} (figures beside it)")
    return 0

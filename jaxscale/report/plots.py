"""Figures of a sweep's results DataFrame (jaxscale.sweep.load_results): each function returns a matplotlib Figure.

The figures are built without pyplot (matplotlib.figure.Figure), so they hold no global state, work under any
backend and can be saved (`fig.savefig`) or shown in a notebook (`display(fig)`). A column a figure needs that
the results lack (older rows, or a measurement this backend cannot make) is named in the figure, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.figure import Figure

from jaxscale.report.predicted import (
    does_not_fit,
    draw_budgets,
    is_plan,
    measured_devices,
    planned_label,
    predicted_step,
    predicted_throughput,
    predicted_vs_baseline,
    prediction_label,
)
from jaxscale.sweep.results import best_peak, mesh_of

GIB = 2**30
# The analytic memory model's parts (bytes), in stacking order, and its peak.
ANALYTIC_PARTS = (
    ("analytic_params_bytes", "params"),
    ("analytic_grads_bytes", "grads"),
    ("analytic_optimizer_bytes", "optimizer state"),
    ("analytic_activation_bytes", "activations"),
)
ANALYTIC_PEAK = "analytic_peak_bytes"
# XLA's compiled plan: peak = argument + (output - alias) + temp.
COMPILED_COLORS = {
    "arguments": "#4c72b0",
    "outputs not aliased": "#8172b2",
    "temp": "#c44e52",
    "compiled peak": "#4c72b0",
}
ANALYTIC_COLORS = ("#55a868", "#a1c9a4", "#dd8452", "#f0c27b")
# Wall time, input wait included (jaxscale.train.loop): what a sweep whose batches come from the host is timed by.
WALL_THROUGHPUT = "tokens_per_s_with_input_wait"  # tokens per step / median of (input wait + step)
WALL_STEP = "step_with_input_wait_s_median"


def reads_input(frame: pd.DataFrame) -> bool:
    """Whether the sweep has input waits: a row fed from the host (data.source not synthetic) that measured its
    wall-time throughput. Its figures and table then use the wall time, which `tokens_per_s` (the compiled
    step alone) leaves out: a run that waits 3 s for each batch of a 1.8 s step is not 0.97x its baseline."""
    if WALL_THROUGHPUT not in frame or "config.data.source" not in frame:
        return False
    source = frame["config.data.source"]
    fed = source.notna() & (source.astype(str) != "synthetic")
    return bool((fed & pd.to_numeric(frame[WALL_THROUGHPUT], errors="coerce").notna()).any())


def throughput(frame: pd.DataFrame) -> tuple[pd.Series, str]:
    """(tokens/s per row, NaN where the row failed; what they are): wall time where the sweep has input waits."""
    ok, step_only = frame["status"] == "ok", pd.to_numeric(frame["tokens_per_s"], errors="coerce")
    if not reads_input(frame):
        return step_only.where(ok), "tokens/s (tokens per step / median step time)"
    wall = pd.to_numeric(frame[WALL_THROUGHPUT], errors="coerce")
    synthetic = frame["config.data.source"].astype(str) == "synthetic"  # made on the device: nothing to wait for
    wall = wall.where(wall.notna() | ~synthetic, step_only)  # older synthetic rows without the wall-time column
    return wall.where(ok), "tokens/s in wall time, input wait included (tokens per step / median of input wait + step)"


def step_time(frame: pd.DataFrame) -> tuple[pd.Series, str]:
    """(median seconds per step, its label): input wait + step where the sweep has input waits."""
    step_only = pd.to_numeric(frame["step_s_median"], errors="coerce")
    if not reads_input(frame):
        return step_only, "step time, median (s)"
    wall = pd.to_numeric(frame.get(WALL_STEP), errors="coerce")
    synthetic = frame["config.data.source"].astype(str) == "synthetic"  # as in `throughput`
    return wall.where(wall.notna() | ~synthetic, step_only), "input wait + step, median (s)"


def throughput_vs_baseline(frame: pd.DataFrame) -> pd.Series:
    """Each ok row's throughput over its sweep's baseline's: the sweep's throughput_vs_baseline (the compiled
    step's), or the wall-time ratio (input wait included) where the sweep has input waits."""
    if not reads_input(frame):
        return pd.to_numeric(frame["throughput_vs_baseline"], errors="coerce")
    values, _ = throughput(frame)
    by_variant = {(sweep, variant): values[i] for i, sweep, variant in zip(frame.index, frame["sweep"],
                                                                           frame["variant"], strict=True)}  # fmt: skip
    base = [by_variant.get((sweep, b), np.nan) for sweep, b in zip(frame["sweep"], frame["baseline"], strict=True)]
    return values / pd.Series(base, index=frame.index, dtype=float)


def speed_vs_baseline(frame: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(each row's throughput over its baseline's, whether that ratio is predicted): the measured ratio
    (throughput_vs_baseline), else, for a row with nothing measured, the predicted one (predicted_vs_baseline)."""
    measured = throughput_vs_baseline(frame)
    predicted = predicted_vs_baseline(frame).where(measured.isna())
    return measured.fillna(predicted), predicted.notna()


def variant_labels(frame: pd.DataFrame) -> pd.Series:
    """Variant names, prefixed by the sweep ("sweep/variant") when the frame holds more than one sweep."""
    names = frame["variant"].fillna(frame.get("name", pd.Series(index=frame.index, dtype=object)))
    if frame["sweep"].nunique(dropna=True) > 1:
        return frame["sweep"].astype(str) + "/" + names.astype(str)
    return names.astype(str)


def with_peak(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with best_peak_bytes / best_peak_source: the device allocator's peak where measured, else XLA's
    compiled plan (named by backend), as jaxscale.results.best_peak; columns load_results filled are kept."""
    frame = frame.copy()
    if "best_peak_bytes" not in frame or "best_peak_source" not in frame:
        rows = [{k: (None if _missing(v) else v) for k, v in row.items()} for row in frame.to_dict("records")]
        peaks = [best_peak(row) for row in rows]
        frame["best_peak_bytes"] = [p for p, _ in peaks]
        frame["best_peak_source"] = [s for _, s in peaks]
    frame["best_peak_bytes"] = pd.to_numeric(frame["best_peak_bytes"], errors="coerce")
    return frame


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def per_device(frame: pd.DataFrame) -> str:
    """The words ' per device' where a row ran or was planned on a mesh (its memory columns are per device), else ''."""
    return " per device" if any(mesh_of(row) != "1x1x1" for row in frame.to_dict("records")) else ""


def memory_unit(values: pd.Series) -> tuple[int, str]:
    """(divisor, name): GiB when the largest value is at least 1 GiB, else MiB (tiny test configs)."""
    largest = pd.to_numeric(values, errors="coerce").max()
    return (GIB, "GiB") if not pd.isna(largest) and largest >= GIB else (2**20, "MiB")


def pareto_front(step_s: pd.Series, peak_bytes: pd.Series) -> pd.Series:
    """True where no other point is at least as fast and as small and strictly better in one of them."""
    points = np.column_stack([step_s.to_numpy(float), peak_bytes.to_numpy(float)])
    on_front = []
    for point in points:
        dominated = np.any(np.all(points <= point, axis=1) & np.any(points < point, axis=1))
        on_front.append(not dominated)
    return pd.Series(on_front, index=step_s.index)


def share_columns(frame: pd.DataFrame) -> list[str]:
    """The trace analysis' op-category share columns (trace_<category>_share) present in the frame."""
    return [c for c in frame.columns if c.startswith("trace_") and c.endswith("_share")]


def _note(ax: Axes, text: str) -> None:
    """A caveat in small red type just above the axes (the figure's title is its suptitle)."""
    ax.set_title(text, loc="left", fontsize=8, color="#7a2020", wrap=True)


def _failed_note(frame: pd.DataFrame, labels: pd.Series, shown: pd.Index) -> str | None:
    left_out = [f"{labels[i]} ({_missing_text(frame, i, 'no step time')})" for i in frame.index if i not in shown]
    return f"not plotted: {', '.join(left_out)}" if left_out else None


def _missing_text(frame: pd.DataFrame, i: object, what: str) -> str:
    """Why row i has no value to draw: its status where it failed, else `what` ("no step time")."""
    status = frame.at[i, "status"]
    return what if status == "ok" else str(status)


def _fit_suffix(frame: pd.DataFrame, i: object) -> str:
    return " (does not fit)" if does_not_fit(frame)[i] else ""


def _sweep_colors(frame: pd.DataFrame) -> dict[str, str]:
    palette = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c")
    return {sweep: palette[i % len(palette)] for i, sweep in enumerate(frame["sweep"].astype(str).unique())}


def message_figure(title: str, message: str) -> Figure:
    """A figure that only says, under `title`, why there is nothing to draw."""
    figure = Figure(figsize=(7, 2.5), layout="constrained")
    ax = figure.add_subplot()
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=9, color="#7a2020")
    return figure


def step_times(frame: pd.DataFrame) -> tuple[pd.Series, str, pd.Series | None, str]:
    """(the step times plotted, their label, predicted ones shown beside them or None, what those are).

    Measured (step_time) where any ok row measured one, the predicted beside them where rows have both; for a
    sweep where nothing ran (a plan), the predicted step times themselves, labelled as predictions."""
    measured, label = step_time(frame)
    measured, predicted = measured.where(frame["status"] == "ok"), predicted_step(frame)
    if measured.notna().any() or predicted.isna().all():
        return measured, label, (predicted if predicted.notna().any() else None), prediction_label(frame)
    return predicted, "predicted step time (s)", None, prediction_label(frame)


def plot_time_vs_memory(frame: pd.DataFrame) -> Figure:
    """Median step time against peak memory, one point per successful variant, Pareto front marked.

    Where rows carry a predicted step (jaxscale.plan.predict) beside the measured one, it is drawn as a hollow
    diamond above or below the measured point; a plan (nothing measured) plots its predicted step time. The
    memory budget (predicted.row_budget) is a vertical line where the rows have one.

    Args:
      frame: rows from load_results (one or more sweeps; the front is drawn per sweep).

    Returns:
      The figure; the x axis names the peak-memory source(s), failed variants are listed in a note.
    """
    frame, labels = with_peak(frame), variant_labels(frame)
    step_s, step_label, beside, predicted_what = step_times(frame)
    data = frame[step_s.notna() & frame["best_peak_bytes"].notna()]
    title = "Wall time per step (input wait included) against peak memory" if reads_input(frame) else \
        "Step time against peak memory"  # fmt: skip
    if beside is None and step_label.startswith("predicted"):
        title = f"Step time against peak memory, {predicted_what}"
    if data.empty:
        return message_figure(title, "no successful variant with both a step time (measured or predicted) and a peak "
                             "memory to plot")  # fmt: skip
    figure = Figure(figsize=(8, 5.5), layout="constrained")
    ax = figure.add_subplot()
    colors, markers = _sweep_colors(frame), dict(zip(sorted(data["best_peak_source"].unique()), "osD^v", strict=False))
    divisor, unit = memory_unit(data["best_peak_bytes"])
    shown = [step_s[data.index]]
    for sweep, group in data.groupby(data["sweep"].astype(str), sort=False):
        memory, seconds = group["best_peak_bytes"] / divisor, step_s[group.index]
        for source, marker in markers.items():
            mine = group["best_peak_source"] == source
            ax.scatter(memory[mine], seconds[mine], color=colors[sweep], marker=marker, zorder=3,
                       label=f"{sweep} ({source})")  # fmt: skip
        if beside is not None:
            shown.append(_draw_beside(ax, memory, seconds, beside[group.index], colors[sweep],
                                      f"{sweep}: {predicted_what}"))  # fmt: skip
        front = pareto_front(seconds, memory)
        order = memory[front].sort_values().index
        ax.plot(memory[order], seconds[order], color=colors[sweep], lw=1, ls="--", drawstyle="steps-post")
        ax.scatter(memory[front], seconds[front], s=160, facecolors="none", edgecolors=colors[sweep], zorder=2)
        names = pd.Series({i: labels[i] + _fit_suffix(frame, i) for i in group.index})
        _annotate_without_overlap(ax, memory, seconds, names)
    budgets = draw_budgets(ax, data, divisor, unit)
    seconds = pd.concat(shown).dropna()
    span = memory_span(pd.concat([data["best_peak_bytes"] / divisor, pd.Series(budgets, dtype=float)]))
    if span > 4 or seconds.max() > 4 * seconds.min():
        ax.set_xscale("log")  # clustered variants beside an outlier (e.g. a 4x batch) stay readable
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not 6x10^0; minor ticks as _minor_label
            axis.set_major_formatter(ticker.StrMethodFormatter("{x:g}"))
            axis.set_minor_formatter(ticker.FuncFormatter(_minor_label(axis)))
    ax.scatter([], [], s=160, facecolors="none", edgecolors="k", label="Pareto front (ringed, dashed)")
    ax.set_xlabel(f"peak memory ({unit}{per_device(data)}; source: {', '.join(markers)})")
    ax.set_ylabel(step_label)
    figure.suptitle(title)
    ax.margins(0.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    note = _failed_note(frame, labels, data.index)
    if note:
        _note(ax, note)
    return figure


def _draw_beside(ax: Axes, memory: pd.Series, seconds: pd.Series, predicted: pd.Series, color: str, what: str
                 ) -> pd.Series:  # fmt: skip
    """The predicted step of each measured point: a hollow diamond at the same memory, joined by a dotted line."""
    mine = predicted.notna()
    ax.scatter(memory[mine], predicted[mine], marker="D", facecolors="none", edgecolors=color, zorder=3, label=what)
    for i in predicted[mine].index:
        ax.plot([memory[i]] * 2, [seconds[i], predicted[i]], color=color, lw=0.8, ls=":", zorder=1)
    return predicted[mine]


def _minor_label(axis: Axis) -> Callable[[float, int], str]:
    """A log axis' minor tick labels: every one where the axis spans at most 4x, else 2 and 5 times a power of ten
    only ("20", "0.5"), so a wide axis is not crowded and a narrow one still has numbers."""

    def label(x: float, _: int) -> str:
        low, high = sorted(axis.get_view_interval())
        return f"{x:g}" if high <= 4 * low or f"{x:.1e}"[:3] in ("2.0", "5.0") else ""

    return label


def memory_span(values: pd.Series) -> float:
    """Largest over smallest of positive values (1.0 when there are none)."""
    positive = values[values > 0]
    return float(positive.max() / positive.min()) if not positive.empty else 1.0


def _annotate_without_overlap(ax: Axes, xs: pd.Series, ys: pd.Series, labels: pd.Series) -> None:
    """Labels each point; a label whose point is close to an already-labelled one moves down a line."""
    placed: list[tuple[float, float]] = []
    for i in ys.sort_values(ascending=False).index:
        near = sum(abs(xs[i] - x) <= 0.08 * max(abs(x), 1e-12) and abs(ys[i] - y) <= 0.08 * max(abs(y), 1e-12)
                   for x, y in placed)  # fmt: skip
        placed.append((xs[i], ys[i]))
        ax.annotate(labels[i], (xs[i], ys[i]), xytext=(6, 4 - 10 * near), textcoords="offset points", fontsize=8)


# How a predicted value's bar differs from a measured one's.
PREDICTED_BAR = {"alpha": 0.55, "hatch": ".."}


def _barh_by_variant(ax: Axes, frame: pd.DataFrame, series: list[tuple[pd.Series, dict]], labels: pd.Series,
                     fmt: str) -> None:  # fmt: skip
    """Horizontal bars, first variant on top, one per (values, bar style) of `series` that the row has, side by
    side; a row with none shows its status instead (where it is ok: "nothing measured or predicted"). The
    baseline is hatched //."""
    colors = _sweep_colors(frame)
    positions = np.arange(len(frame))[::-1]
    present = pd.concat([values.notna() for values, _ in series], axis=1).sum(axis=1)
    height = 0.8 / max(1, int(present.max()))
    for y, i in zip(positions, frame.index, strict=True):
        drawn = [(values[i], style) for values, style in series if not pd.isna(values[i])]
        if not drawn:
            missing = _missing_text(frame, i, "nothing measured or predicted")
            ax.text(0, y, f" {missing}", va="center", fontsize=8, color="#7a2020")
        baseline = frame.at[i, "variant"] == frame.at[i, "baseline"]
        for k, (value, style) in enumerate(drawn):
            center, style = y + 0.4 - height * (k + 0.5), dict(style)
            style["hatch"] = (style.get("hatch") or "") + ("//" if baseline else "") or None
            ax.barh(center, value, height=height, color=colors[str(frame.at[i, "sweep"])], **style)
            ax.text(value, center, " " + format(value, fmt), va="center", fontsize=8)
    ax.set_yticks(positions, [f"{labels[i]}{' (baseline)' if frame.at[i, 'variant'] == frame.at[i, 'baseline'] else ''}"
                              f"{_fit_suffix(frame, i)}" for i in frame.index])  # fmt: skip
    ax.margins(x=0.2)
    ax.update_datalim([(0.0, float(y)) for y in positions])  # a status drawn at 0 stays inside, bars or none
    ax.grid(axis="x", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if handles:
        ax.legend(dict(zip(names, handles, strict=True)).values(), dict.fromkeys(names), fontsize=8, loc="best")


def plot_tokens_per_s(frame: pd.DataFrame) -> Figure:
    """Tokens per second per variant (from the median step, or in wall time with the input wait where the sweep
    has input waits, as `throughput`); failures show their status instead of a bar.

    Rows with a predicted tokens/s (jaxscale.plan.predict) beside the measured get a dotted bar under it; a plan
    (nothing measured) draws its predicted tokens/s, and the axis names the target GPU, not the planning machine.
    """
    measured, what = throughput(frame)
    predicted, predicted_what = predicted_throughput(frame), prediction_label(frame)
    devices = measured_devices(frame)
    title = "Throughput per variant" + (", input wait included" if reads_input(frame) else "")
    if measured.isna().all() and predicted.isna().all():
        rows = ", ".join(f"{n} {s}" for s, n in frame["status"].value_counts().items())
        return message_figure(title, f"no tokens/s to plot: no row measured one (tokens_per_s) or has a predicted one "
                             f"(predicted_tokens_per_s); rows: {rows}")  # fmt: skip
    figure = Figure(figsize=(8, 1.2 + 0.45 * len(frame)), layout="constrained")
    ax = figure.add_subplot()
    if measured.notna().any() or predicted.isna().all():  # measured, with any predictions beside
        on = f"measured on {devices}" if devices else "measured"
        series = [(measured, {"label": on} if predicted.notna().any() else {})]
        if predicted.notna().any():
            series.append((predicted, {**PREDICTED_BAR, "label": predicted_what}))
            what = f"{what}; solid: {on}, dotted: {predicted_what}"
        elif devices:
            what = f"{what}; device: {devices}"
    else:  # a plan: what the model predicts for the target
        series = [(predicted, PREDICTED_BAR)]
        what = f"predicted tokens/s (tokens per step / predicted step time); {predicted_what}"
        title = "Predicted throughput per variant"
    _barh_by_variant(ax, frame, series, variant_labels(frame), ",.0f")
    ax.xaxis.set_major_formatter(ticker.StrMethodFormatter("{x:,.0f}"))  # 2,000,000, not 2.0 and 1e6 aside
    ax.set_xlabel(what, wrap=True)
    ax.set_title(title)
    return figure


def plot_input_wait(frame: pd.DataFrame) -> Figure:
    """Per variant, the median step (compute) and the median wait for its batch before it, stacked, with the
    share of wall time spent waiting (input_wait_fraction): where an input-bound run's time goes."""
    figure = Figure(figsize=(9, 1.4 + 0.45 * len(frame)), layout="constrained")
    ax = figure.add_subplot()
    step = pd.to_numeric(frame["step_s_median"], errors="coerce").where(frame["status"] == "ok")
    wait = pd.to_numeric(frame.get("input_wait_s_median"), errors="coerce").fillna(0.0)
    share = pd.to_numeric(frame.get("input_wait_fraction"), errors="coerce")
    labels, positions = variant_labels(frame), np.arange(len(frame))[::-1]
    for y, i in zip(positions, frame.index, strict=True):
        if pd.isna(step[i]):
            ax.text(0, y, f" {frame.at[i, 'status']}", va="center", fontsize=8, color="#7a2020")
            continue
        ax.barh(y, step[i], color="#4c72b0", label="compiled step (median)")
        ax.barh(y, wait[i], left=step[i], color="#c44e52", label="input wait before it (median)")
        waiting = "" if pd.isna(share[i]) else f", {share[i]:.0%} of wall time waiting"
        ax.text(step[i] + wait[i], y, f" {step[i]:.2f} s + {wait[i]:.2f} s{waiting}", va="center", fontsize=8)
    baseline = frame["variant"] == frame["baseline"]
    ax.set_yticks(positions, [f"{labels[i]}{' (baseline)' if baseline[i] else ''}" for i in frame.index])
    handles, names = ax.get_legend_handles_labels()
    ax.legend(dict(zip(names, handles, strict=True)).values(), dict.fromkeys(names), fontsize=8, loc="lower right")
    ax.margins(x=0.35)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel("seconds per step in wall time: the compiled step, then the wait for its batch")
    ax.set_title("Where a step's wall time goes: compute and input wait")
    return figure


def _compiled_parts(row: pd.Series) -> list[tuple[str, float]]:
    """XLA's plan as (part, bytes): arguments, outputs not aliased to a donated input, temp; or the peak alone."""
    names = ("compiled_argument_bytes", "compiled_output_bytes", "compiled_alias_bytes", "compiled_temp_bytes")
    values = [pd.to_numeric(row.get(n), errors="coerce") for n in names]
    if any(pd.isna(v) for v in values):
        return [("compiled peak", float(row["compiled_peak_bytes"]))]
    argument, output, alias, temp = (float(v) for v in values)
    return [("arguments", argument), ("outputs not aliased", output - alias), ("temp", temp)]


def _stack(ax: Axes, y: float, parts: list[tuple[str, float]], colors: dict[str, str], prefix: str, **bar) -> None:
    left = 0.0
    for part, value in parts:
        if not pd.isna(value):
            ax.barh(y, value, left=left, color=colors[part], label=f"{prefix}: {part}", **bar)
            left += value


def _memory_bars(ax: Axes, y: float, row: pd.Series, divisor: float, analytic: list[tuple[str, str]]) -> None:
    """One variant: the compiled plan's stacked bar (below), the analytic parts' (above), and the peak marks."""
    compiled_y, height = (y - 0.5, 0.9) if analytic else (y, 1.6)
    compiled = [(part, value / divisor) for part, value in _compiled_parts(row)]
    _stack(ax, compiled_y, compiled, COMPILED_COLORS, "compiled plan", height=height)
    parts = [(part, pd.to_numeric(row.get(column), errors="coerce") / divisor) for column, part in analytic]
    _stack(ax, y + 0.5, parts, dict(zip([p for _, p in ANALYTIC_PARTS], ANALYTIC_COLORS, strict=True)), "analytic",
           height=0.9)  # fmt: skip
    analytic_peak = pd.to_numeric(row.get(ANALYTIC_PEAK), errors="coerce")
    if not pd.isna(analytic_peak):
        ax.plot([analytic_peak / divisor] * 2, [y + 0.05, y + 0.95], color="k", lw=1.5, label="analytic peak")
    device_peak = pd.to_numeric(row.get("device_peak_bytes"), errors="coerce")
    if not pd.isna(device_peak):
        ax.plot(device_peak / divisor, compiled_y, "kx", ms=9, mew=2, label="device peak (allocator)")


def plot_memory_breakdown(frame: pd.DataFrame) -> Figure:
    """Per variant: the analytic parts (params, grads, optimizer, activations) beside XLA's compiled plan.

    Analytic columns the results lack are named in the figure; the compiled plan is drawn alone then.
    The device allocator's peak is marked (x) where the backend measured one, and the memory budget
    (predicted.row_budget: the run's, the fit planner's, or a plan's target's) is a vertical line.
    """
    compiled_peak = pd.to_numeric(frame["compiled_peak_bytes"], errors="coerce")
    data, labels = frame[compiled_peak.notna()], variant_labels(frame)
    title = "Memory per variant: analytic estimate beside the compiled plan"
    if data.empty:
        return message_figure(title, "no variant has a compiled memory plan (compiled_peak_bytes) to plot")
    analytic = [(c, part) for c, part in ANALYTIC_PARTS if c in frame]
    divisor, unit = memory_unit(compiled_peak)
    figure = Figure(figsize=(10, 1.6 + 0.8 * len(data)), layout="constrained")
    ax = figure.add_subplot()
    positions = np.arange(len(data))[::-1] * 2.5
    for y, i in zip(positions, data.index, strict=True):
        _memory_bars(ax, y, data.loc[i], divisor, analytic)
    unfit = does_not_fit(data)
    ax.set_yticks(positions, [f"{labels[i]}\n({data.at[i, 'status']}{', does not fit' if unfit[i] else ''})"
                              for i in data.index], fontsize=8)  # fmt: skip
    draw_budgets(ax, data, divisor, unit, {i: (y - 1.1, y + 1.1) for y, i in zip(positions, data.index, strict=True)})
    ax.set_xlim(left=0)
    backends = ", ".join(str(b) for b in data.get("compiled_backend", pd.Series(dtype=object)).dropna().unique())
    bars = "upper bar: analytic; lower bar: " if analytic else ""
    planned = planned_label(data)
    planned = f"; {planned}" if planned else ""
    what = f"{bars}XLA's compiled plan, backend {backends or 'unknown'}{planned}"
    ax.set_xlabel(f"{unit}{per_device(data)} ({what})", wrap=True)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(title)
    ax.grid(axis="x", alpha=0.3)
    missing = [c for c, _ in ANALYTIC_PARTS if c not in frame] + ([ANALYTIC_PEAK] if ANALYTIC_PEAK not in frame else [])
    if missing:
        _note(ax, f"not in these results: {', '.join(missing)}")
    return figure


def plot_op_shares(frame: pd.DataFrame) -> Figure:
    """The trace analysis' op-category shares (trace_<category>_share) as a variant x category grid (percent)."""
    columns, labels = share_columns(frame), variant_labels(frame)
    title = "Share of op time by category (trace analysis)"
    if not columns and is_plan(frame):
        return message_figure(title, "a plan runs no step, so there is no trace to analyse (trace_*_share): the op "
                              "time by category comes from profiling a run on the device")  # fmt: skip
    if not columns:
        return message_figure(title, "no trace_*_share columns in these results: they come from the trace analysis "
                             "of each variant's profiled steps")  # fmt: skip
    shares = frame[columns].apply(pd.to_numeric, errors="coerce")
    figure = Figure(figsize=(1.6 + 1.1 * len(columns), 1.4 + 0.45 * len(frame)), layout="constrained")
    ax = figure.add_subplot()
    image = ax.imshow(shares.to_numpy(float) * 100, cmap="Blues", vmin=0, vmax=100, aspect="auto")
    for r, i in enumerate(frame.index):
        for c, column in enumerate(columns):
            value = shares.at[i, column]
            text, color = ("-", "k") if pd.isna(value) else (f"{100 * value:.0f}%", "w" if value > 0.6 else "k")
            ax.text(c, r, text, ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(len(columns)), [c[len("trace_") : -len("_share")] for c in columns], rotation=30, ha="right")
    ax.set_yticks(range(len(frame)), labels)
    figure.colorbar(image, ax=ax, label="% of profiled op time")
    ax.set_title(title)
    return figure


def plot_vs_baseline(frame: pd.DataFrame) -> Figure:
    """Speed-up (throughput ratio) and peak-memory ratio of each variant against its sweep's baseline."""
    labels = variant_labels(frame)
    baselines = ", ".join(str(b) for b in frame["baseline"].dropna().unique()) or "none named"
    speed, predicted = speed_vs_baseline(frame)
    memory = pd.to_numeric(frame["peak_vs_baseline"], errors="coerce")
    if speed.isna().all() and memory.isna().all():
        base = frame[frame["variant"] == frame["baseline"]]
        status = ", ".join(f"{v}: {s}" for v, s in zip(base["variant"], base["status"], strict=True)) or "no such row"
        return message_figure(f"Against the baseline ({baselines})", f"no ratios to draw: the baseline has neither a "
                      f"throughput nor a peak to compare with ({status})")  # fmt: skip
    figure = Figure(figsize=(11, 1.4 + 0.45 * len(frame)), layout="constrained")
    speed_ax, memory_ax = figure.subplots(1, 2, sharey=True)
    _barh_by_variant(speed_ax, frame, [(speed.where(~predicted), {}), (speed.where(predicted), PREDICTED_BAR)], labels,
                     ".2f")  # fmt: skip
    _barh_by_variant(memory_ax, frame, [(memory, {})], labels, ".2f")
    speed_text = "wall-time throughput (input wait included)" if reads_input(frame) else "throughput"
    speed_text = f"{speed_text} / baseline's (>1: faster)"
    if predicted.any() and not (speed.notna() & ~predicted).any():  # nothing measured: all predicted
        speed_text = f"predicted throughput / baseline's (>1: faster)\n{prediction_label(frame)}"
    elif predicted.any():
        speed_text += f"\ndotted: {prediction_label(frame[predicted])}"
    axes = {speed_ax: speed_text, memory_ax: "peak memory / baseline's (<1: smaller)"}
    for ax, what in axes.items():
        ax.axvline(1.0, color="k", lw=1)
        ax.set_xlabel(what, wrap=True)
    sources = ", ".join(str(s) for s in frame.get("best_peak_source", pd.Series(dtype=object)).dropna().unique())
    memory_ax.set_title(f"peak source: {sources or 'none'}", fontsize=9)
    figure.suptitle(f"Against the baseline ({baselines})")
    return figure


def figures(frame: pd.DataFrame) -> dict[str, Figure]:
    """Every figure of the report, by file stem: time_vs_memory, tokens_per_s, memory_breakdown, op_shares,
    vs_baseline, and input_wait where the sweep has input waits."""
    found = {
        "time_vs_memory": plot_time_vs_memory(frame),
        "tokens_per_s": plot_tokens_per_s(frame),
        "memory_breakdown": plot_memory_breakdown(frame),
        "op_shares": plot_op_shares(frame),
        "vs_baseline": plot_vs_baseline(frame),
    }
    return {**found, "input_wait": plot_input_wait(frame)} if reads_input(frame) else found

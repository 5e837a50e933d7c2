"""The remat frontier's figure and docs table, from the rows `python -m jaxscale.fit --remat frontier` records.

Each row is one per-activation policy of the walk (jaxscale.plan.frontier) at its largest minibatch, with its
predicted tokens/s there (a prediction for the target GPU, not a measurement) and whether it is on the Pareto
frontier of minibatch against predicted tokens/s (`frontier_on`) or the fastest that fits (`frontier_fastest`).
The figure follows jaxscale.report.plots' conventions: a matplotlib Figure without pyplot, and what it cannot draw
named in it.
"""

from __future__ import annotations

import pathlib

import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure

from jaxscale.report import plots
from jaxscale.report.markdown import PNG_METADATA
from jaxscale.report.predicted import PLAN
from jaxscale.sweep.results import read_rows

GIB = 2**30
_NEEDED = ("fit_largest_minibatch", "predicted_tokens_per_s", "frontier_on", "frontier_step")


def _groups(frame: pd.DataFrame) -> pd.Series:
    """Each row's fine-tuning method and precision where fit's --finetune / --precision set them ("" otherwise)."""
    columns = [c for c in ("fit_finetune", "fit_precision") if c in frame]
    return pd.Series(
        ["; ".join(v for v in (frame.at[i, c] for c in columns) if isinstance(v, str)) for i in frame.index],
        index=frame.index,
    )


def plot_frontier(frame: pd.DataFrame) -> Figure:
    """Largest minibatch (x) against predicted tokens/s (y) of each searched policy, labelled by its walk step; the
    Pareto frontier joined and highlighted, the fastest starred. One colour per fine-tuning method / precision."""
    title = "Remat frontier: largest minibatch against predicted tokens/s"
    missing = [c for c in _NEEDED if c not in frame]
    if missing:
        lacking = f"not drawn: the rows lack {', '.join(missing)} (not a --remat frontier fit)"
        return plots.message_figure(title, lacking)
    batch = pd.to_numeric(frame["fit_largest_minibatch"], errors="coerce")
    speed = pd.to_numeric(frame["predicted_tokens_per_s"], errors="coerce")
    placed = batch.notna() & speed.notna()
    if not placed.any():
        unplaced = "not drawn: no policy fits with a predicted speed (none fits, or no --target)"
        return plots.message_figure(title, unplaced)
    figure = Figure(figsize=(8, 5), layout="constrained")
    ax = figure.add_subplot()
    groups = _groups(frame)
    palette = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2")
    for n, group in enumerate(groups.unique()):
        color, inside = palette[n % len(palette)], (groups == group) & placed
        ax.scatter(batch[inside], speed[inside], color=color, alpha=0.35, s=30, label=group or None)
        front = inside & frame["frontier_on"].map(lambda v: v is True)
        order = batch[front].sort_values().index
        ax.plot(batch[order], speed[order], color=color, marker="o", linewidth=1.5, markersize=7)
        fastest = inside & frame.get("frontier_fastest", pd.Series(False, index=frame.index)).map(lambda v: v is True)
        ax.scatter(batch[fastest], speed[fastest], color=color, marker="*", s=250, zorder=3)
        for i in frame.index[inside]:
            ax.annotate(str(frame.at[i, "frontier_step"]), (batch[i], speed[i]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)  # fmt: skip
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_xlabel("largest minibatch that fits (sequences per device)")
    ax.set_ylabel("predicted tokens/s at that minibatch")
    ax.grid(alpha=0.3)
    if groups.nunique() > 1:
        ax.legend(fontsize=8)
    ax.set_title("points: policies by walk step; line: the Pareto frontier; star: the fastest that fits", fontsize=8)
    figure.suptitle(f"{title} ({PLAN})")
    return figure


def write_figure(rows: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Writes plot_frontier of the rows as a PNG at `path` (no software stamp, as the reports' figures)."""
    plot_frontier(pd.DataFrame(rows)).savefig(path, dpi=110, metadata=PNG_METADATA)
    return path


def _policy(row: dict) -> str:
    return f"`{row['frontier_policy']}`" if row.get("frontier_policy") != "all remat" else "all remat"


def frontier_table(results: pathlib.Path) -> str:
    """The docs' table of one frontier fit (walk order): policy, largest minibatch (plan GiB), predicted step and
    tokens/s there, on the frontier; then the walk's order and where it stopped, as the rows say."""
    rows = sorted((r for r in read_rows(results) if "frontier_step" in r), key=lambda r: r["frontier_step"])
    lines = ["| step | policy (activations not rematerialized) | largest minibatch (plan GiB) | predicted step (s) "
             "| predicted tokens/s | on the frontier |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        largest = r.get("fit_largest_minibatch")
        why = "XLA's limit" if r.get("plan_fits") is False else "over the budget"
        peak = r.get("compiled_peak_bytes")
        fits = (
            f"{largest} ({peak / GIB:.2f})"
            if largest
            else "none" + (f" (minibatch 1 plans {peak / GIB:.2f}: {why})" if peak else "")
        )
        fits += "" if r.get("fit_search_complete", True) else "+ (search cut)"
        step = "–" if not largest else f"{r['predicted_step_s']:.3f}"
        speed = "–" if not largest else f"{r['predicted_tokens_per_s']:,.0f}"
        on = {True: "yes", False: "no", None: "–"}[r.get("frontier_on")]
        on = "**yes, the fastest**" if r.get("frontier_fastest") else on
        lines.append(f"| {r['frontier_step']} | {_policy(r)} | {fits} | {step} | {speed} | {on} |")
    if rows:
        first = rows[0]
        walked = f"{len(rows)} of {first['frontier_policies']} policies searched"
        stopped = f"; stopped: {first['frontier_stopped']}" if first.get("frontier_stopped") else ""
        probes = sum(r.get("fit_compiles") or 0 for r in rows)
        lines += ["", f"Walk: {walked} ({probes} probes){stopped}; activations moved in the order "
                  f"{', '.join(first['frontier_order'])}."]  # fmt: skip
    return "\n".join(lines)

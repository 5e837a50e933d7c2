"""The time errors of predictions against published runs: the mean absolute error of predicted / published, its summary
line, and the table that splits it by GPU target, framework and the predictor that made the first sights
(jaxscale.published's table and docs/published.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def mean_abs_error(ratios: Sequence[float]) -> float | None:
    """Mean of |ratio - 1| (0.15 = 15%), or None without ratios."""
    return statistics.fmean(abs(r - 1) for r in ratios) if ratios else None


def number_text(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def within_25(ratios: Sequence[float]) -> int:
    """How many predicted / published ratios are within ±25% (0.75 to 1.25)."""
    return sum(0.75 <= r <= 1.25 for r in ratios)


def summary_line(ratios: Sequence[float], label: str = "") -> str:
    """'<label>: mean absolute error X% over N runs, M within ±25%' of predicted / published ratios."""
    error = mean_abs_error(ratios)
    within = within_25(ratios)
    text = f"mean absolute error {number_text(None if error is None else 100 * error, 1)}% over {len(ratios)} runs, "
    return f"{label}: {text}{within} within ±25%" if label else f"{text}{within} within ±25%"


def held_sets(rows: list[dict]) -> dict[str, list[dict]]:
    """The compared rows (format_table's) sorted into the sets the errors are taken over: `held` (planned and not
    excluded), the `development` set (held, no first sight), `registered` (a first sight with its figures, not
    excluded at first sight: the first-sight error's runs) and `fit_since` (excluded at first sight, not now)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    held = [r for r in ok if not r.get("published_excluded")]
    measured = [r for r in ok if r.get("first_sight_step_s") and not r.get("published_pending")]
    return {
        "held": held,
        "development": [r for r in held if not r.get("first_sight_step_s")],
        "registered": [r for r in measured if not r.get("first_sight_excluded")],
        "fit_since": [r for r in measured if r.get("first_sight_excluded") and not r.get("published_excluded")],
    }


def error_ratios(rows: list[dict], key: str) -> list[float]:
    """The rows' predicted / published ratios under `key` (first_sight_over_published_step or
    predicted_over_published_step), where the row has one."""
    return [r[key] for r in rows if r.get(key)]


def held_now(rows: list[dict]) -> list[dict]:
    """The rows the current predictor is held to: those not excluded now (a registered run whose current plan no
    longer fits its card keeps its first sight but leaves the current predictor's error)."""
    return [r for r in rows if not r.get("published_excluded")]


def _cell(ratios: Sequence[float]) -> str:
    """One split-table cell: 'X% over N (M within ±25%)', or '–' without runs."""
    if not ratios:
        return "–"
    return f"{100 * mean_abs_error(ratios):.1f}% over {len(ratios)} ({within_25(ratios)} within ±25%)"


SPLITS = (  # how split_table groups the runs: (label, the row's key)
    ("GPU", "plan_target"),
    ("framework", "published_framework"),
    ("first sight made by", "first_sight_commit"),
)


def split_table(rows: list[dict]) -> str:
    """The time errors of format_table's summary lines split by GPU target, by framework and by the commit whose
    predictor made the first sight: for each group the first-sight error, the current predictor on the same runs,
    and the current predictor on the group's development-set runs (rows as format_table compares them)."""
    sets = held_sets(rows)
    lines = [
        "| runs | first sight (pre-registered) | the current predictor on them | development set, current predictor |",
        "|---|---|---|---|",
    ]

    def line(label: str, keep) -> str:
        registered = [r for r in sets["registered"] if keep(r)]
        development = [r for r in sets["development"] if keep(r)]
        return (f"| {label} | {_cell(error_ratios(registered, 'first_sight_over_published_step'))} "
                f"| {_cell(error_ratios(held_now(registered), 'predicted_over_published_step'))} "
                f"| {_cell(error_ratios(development, 'predicted_over_published_step'))} |")  # fmt: skip

    lines.append(line("all", lambda r: True))
    held = sets["registered"] + sets["development"]
    for label, key in SPLITS:
        for value in sorted({r.get(key) for r in held if r.get(key)}):
            shown = value[:7] if key == "first_sight_commit" else value
            lines.append(line(f"{label}: {shown}", lambda r, key=key, value=value: r.get(key) == value))
    return "\n".join(lines)

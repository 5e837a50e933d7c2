"""The cross check's markdown tables: per calibration run, every prediction, and against later measurements."""

from __future__ import annotations

from collections.abc import Sequence

from jaxscale.plan.calibration_fit import GROUPS
from jaxscale.plan.cross_check import remeasured, settled_pairs, summary


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

"""The fit planner's recommendation: which remat choice to run, among those whose plan fits, and why.

By predicted tokens/s with a target (choices within the predictor's error of the fastest are a tie, broken by
memory headroom), by tokens per step without one, or by measured tokens/s after `--measure`.
"""

from __future__ import annotations

GIB = 2**30
# The predictor's stated error: its step time was 0.82 to 1.04 of the measured one across the notebook's A5000
# table (docs/predict.md, "Check 1": -18% to +4%). Two choices whose predicted tokens/s are within this ratio of
# each other could be in either order on the GPU, so the recommendation calls them a tie.
PREDICTED_OVER_MEASURED = (0.82, 1.04)
TIE_RATIO = PREDICTED_OVER_MEASURED[1] / PREDICTED_OVER_MEASURED[0]  # 1.27


def recommend(rows: list[dict], measured: bool = False, rank: str = "tokens") -> tuple[dict | None, str]:
    """The recommended row and why, among the choices that fit.

    rank "tokens": the most tokens per step (ties: the least recomputation, then the smaller plan);
    rank "predicted": the most predicted tokens/s of the target's compiled program (jaxscale.plan.predict; a
    prediction, said so; choices within the predictor's error of it are a tie, broken by memory headroom),
    falling back to tokens per step where no row has a prediction; with `measured`,
    the fastest measured tokens/s instead of either.
    """
    ok = [r for r in rows if r.get("status") == "ok" and r.get("fit_largest_minibatch")]
    if measured:
        timed = [r for r in ok if r.get("tokens_per_s")]
        if timed:
            best = max(timed, key=lambda r: r["tokens_per_s"])
            return best, f"fastest measured: {best['tokens_per_s']:,.0f} tokens/s at its largest minibatch"
    if not ok:
        return None, "no remat choice fits the budget at minibatch 1"
    if rank == "predicted":
        predicted = [r for r in ok if r.get("predicted_tokens_per_s")]
        if predicted:
            return _fastest_predicted(predicted)
    best = max(
        ok,
        key=lambda r: (
            r["tokens_per_step"],
            -(r.get("analytic_recompute_flops_per_step") or 0),
            -(r.get("compiled_peak_bytes") or 0),
        ),
    )
    return best, f"most tokens per step ({best['tokens_per_step']:,}) among the choices that fit (by plan only)"


def _headroom(row: dict) -> int:
    """Bytes of the usable budget the row's plan leaves free."""
    return row["fit_usable_bytes"] - (row.get("compiled_peak_bytes") or 0)


def _fastest_predicted(rows: list[dict]) -> tuple[dict, str]:
    """The fastest predicted row, unless others are within the predictor's error of it (`TIE_RATIO`): that is a
    tie, and the tied row with the most memory headroom (usable budget less its plan's peak) is chosen."""
    fastest = max(rows, key=lambda r: r["predicted_tokens_per_s"])
    tied = [r for r in rows if r["predicted_tokens_per_s"] * TIE_RATIO >= fastest["predicted_tokens_per_s"]]
    source = "a prediction from the target's compiled program, docs/predict.md; --rank tokens for most tokens per step"
    if len(tied) == 1:
        alone = "more than the predictor's error ahead of the others" if len(rows) > 1 else "the only prediction"
        return fastest, (
            f"fastest predicted: {fastest['predicted_tokens_per_s']:,.0f} tokens/s at its largest minibatch, "
            f"{alone} ({source})"
        )
    best = max(tied, key=_headroom)
    low, high = PREDICTED_OVER_MEASURED
    names = ", ".join(f"{r['fit_remat']} {r['predicted_tokens_per_s']:,.0f}" for r in tied)
    return best, (
        f"a tie on predicted tokens/s ({names}: within the predictor's error, predicted step {low:g}-{high:g}x "
        f"measured), broken by memory headroom: {_headroom(best) / GIB:.2f} GiB of the usable budget left free, "
        f"the most of the tied ({source})"
    )

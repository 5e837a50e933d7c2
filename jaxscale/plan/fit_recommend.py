"""The fit planner's recommendation: which remat choice to run, among those whose plan fits, and why.

By predicted tokens/s with a target (choices within the predictor's error of the fastest are a tie: the fastest
prediction is still the recommendation, and the tied choice with the most memory headroom is named beside it),
by tokens per step without one, or by measured tokens/s after `--measure`.
"""

from __future__ import annotations

GIB = 2**30
# The predictor's error on a GPU, from every GPU step the lab holds a prediction for: predicted / measured step over
# the published runs (experiments/results/published, predicted_over_published_step, the rows it excludes left out)
# and the notebook's A5000 table (experiments/results/seed_table_seed_plan_a5000, predicted_over_notebook), the
# lowest rounded down and the highest rounded up to two decimals. tests/plan/test_fit_search.py recomputes it from
# those committed rows. It is how far one predicted tokens/s may be from the GPU's, not how far the order of two
# predictions of one model on one GPU may be wrong: that is TIE_RATIO.
PREDICTED_OVER_MEASURED = (0.63, 2.17)
# The error of the ratio of two predictions of one model on one GPU: within a sweep (variants of one model on one
# GPU, each predicted and measured) two variants' predicted/measured differ by at most the sweep's highest over its
# lowest, and so does the ratio of their predictions against the ratio of their measurements. The widest such spread
# over every sweep the lab holds, rounded up to two decimals: the lab's measured H200 sweeps beside their deviceless
# plans (experiments/results/<sweep>_h200 and <sweep>_plan_h200: the seed table 1.378, its bf16/FP8 pair and
# Llama 3.2 1B's, the MoE dispatches), the notebook's A5000 table (1.267) and the published runs of one setup (one
# project, model, GPU and GPU count; torchtitan's Llama 3.1 8B on 8 H100s, 1.352). tests/plan/test_fit_search.py
# recomputes it from the committed rows. Two choices whose predicted tokens/s are within TIE_RATIO of each other
# could be in either order on the GPU, so the recommendation calls them a tie.
TIE_RATIO = 1.38
BAND_SOURCE = ("the widest spread of predicted/measured step across the variants of one model on one GPU: the lab's "
               "measured H200 sweeps, the notebook's A5000 table and published sweeps of one setup (docs/fit.md)")


def recommend(rows: list[dict], measured: bool = False, rank: str = "tokens") -> tuple[dict | None, str]:
    """The recommended row and why, among the choices that fit.

    rank "tokens": the most tokens per step (ties: the least recomputation, then the smaller plan);
    rank "predicted": the most predicted tokens/s of the target's compiled program (jaxscale.plan.predict; a
    prediction, said so; choices within the predictor's error of it are a tie, said so, with the tied choice
    that leaves the most memory free named as the alternative),
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
    """The fastest predicted row. Others within the predictor's error of it (`TIE_RATIO`) make a tie: the order
    could differ on the GPU, so the reason says so and names the tied row with the most memory headroom (usable
    budget less its plan's peak) as the alternative; the fastest prediction stays the best estimate."""
    fastest = max(rows, key=lambda r: r["predicted_tokens_per_s"])
    tied = [r for r in rows if r["predicted_tokens_per_s"] * TIE_RATIO >= fastest["predicted_tokens_per_s"]]
    source = "a prediction from the target's compiled program, docs/predict.md; --rank tokens for most tokens per step"
    if len(tied) == 1:
        alone = (f"more than {TIE_RATIO:.2f}x ahead of the others, the predictor's error on the order of two choices "
                 f"({BAND_SOURCE})" if len(rows) > 1 else "the only prediction")
        return fastest, (
            f"fastest predicted: {fastest['predicted_tokens_per_s']:,.0f} tokens/s at its largest minibatch, "
            f"{alone} ({source})"
        )
    roomiest = max(tied, key=_headroom)
    names = ", ".join(f"{r['fit_remat']} {r['predicted_tokens_per_s']:,.0f}" for r in tied)
    if roomiest is fastest:
        alternative = f"it also leaves the most memory free of the tied ({_headroom(fastest) / GIB:.2f} GiB)"
    else:
        alternative = (
            f"{fastest['fit_remat']} leaves {_headroom(fastest) / GIB:.2f} GiB of the usable budget free; the tied "
            f"choice leaving the most is {roomiest['fit_remat']} ({_headroom(roomiest) / GIB:.2f} GiB, "
            f"{roomiest['predicted_tokens_per_s']:,.0f} tokens/s predicted)"
        )
    return fastest, (
        f"fastest predicted: {fastest['predicted_tokens_per_s']:,.0f} tokens/s at its largest minibatch, but a tie "
        f"({names}: within {TIE_RATIO:.2f}x of it, the predictor's error on the order of two choices, "
        f"{BAND_SOURCE}, so the order may differ on the GPU); {alternative} ({source})"
    )

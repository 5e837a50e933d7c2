"""docs/models.md's tables, written from the committed rows of `python -m jaxscale.fit` (one row per remat choice)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from jaxscale.plan.fit_search import REMAT_CHOICES
from jaxscale.sweep.results import read_rows

GIB, GB = 2**30, 1e9
NONE = "–"  # a cell with no answer: the choice is not in that fit, or nothing fits


def fit_rows(rows: pathlib.Path) -> list[dict]:
    """A fit's committed rows in the fit's order of remat choices (fit_search.REMAT_CHOICES).

    Args:
      rows: the fit's results.jsonl.

    Returns:
      One row per remat choice (the last of each), the planner's order.
    """
    order = {choice: n for n, choice in enumerate(REMAT_CHOICES)}
    return sorted(read_rows(rows), key=lambda row: order.get(row["fit_choice"], len(order)))


def _by_choice(rows: pathlib.Path) -> dict[str, dict]:
    return {row["fit_choice"]: row for row in read_rows(rows)}


def markdown(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Ready-formatted cells as a GitHub markdown table (a header may repeat, unlike a DataFrame's columns)."""
    rule = "|" + "|".join("---" for _ in header) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(line) + " |" for line in lines)])


def _gib(row: dict) -> str:
    return f"{row['compiled_peak_bytes'] / GIB:.2f}"


def _per_device(row: dict) -> float:
    return row["predicted_tokens_per_s"] / (row.get("fit_devices") or 1)


def _rate(row: dict | None) -> str:
    """Predicted tokens/s per device at the largest minibatch, or – where nothing fits."""
    return f"{_per_device(row):,.0f}" if row and row["fit_largest_minibatch"] else NONE


def _largest(row: dict) -> str:
    """The largest minibatch, `at least` where the search stopped before the edge."""
    largest = row["fit_largest_minibatch"]
    if largest and not row.get("fit_search_complete", True):
        return (f"at least {largest} (search stopped at {row['fit_compiles']} compiles; "
                f"{row['fit_first_too_large_minibatch']} does not fit)")  # fmt: skip
    return str(largest) if largest else "none"


def _answer(row: dict | None) -> str:
    """`largest (plan GiB)`, or `none (smallest plan GiB at 1)`, or – where the fit lacks the choice."""
    if row is None:
        return NONE
    if not row["fit_largest_minibatch"]:
        return f"none ({_gib(row)} at 1)"
    return f"{_largest(row)} ({_gib(row)})"


def _one_more(row: dict) -> str:
    """The plan of the minibatch after the largest (the probe that was refused), GiB `at` its minibatch."""
    largest = row["fit_largest_minibatch"]
    refused = [probe for probe in row["fit_probes"] if largest and probe[0] == largest + 1]
    return f"{refused[0][1] / GIB:.2f} at {largest + 1}" if refused else NONE


def _xla_limit(rows: list[dict]) -> float:
    """XLA's rematerialization limit in GiB, from the rows whose plan it refused (the same for every choice)."""
    limits = {row["compiled_remat_limit_bytes"] for row in rows if row.get("compiled_remat_limit_bytes")}
    if len(limits) != 1:
        raise ValueError(f"expected one XLA limit among the fit's rows, found {sorted(limits)}")
    return limits.pop() / GIB


def _budget(rows: list[dict]) -> str:
    """The fit's budget in GiB (`fit_budget_bytes`, the same in every row of a fit)."""
    budgets = {row["fit_budget_bytes"] for row in rows}
    if len(budgets) != 1:
        raise ValueError(f"expected one budget among the fit's rows, found {sorted(budgets)}")
    return f"{budgets.pop() / GIB:.2f}"


def _xla_limit_or_none(rows: list[dict]) -> str:
    """XLA's rematerialization limit in GiB where a row of the fit met it, else –."""
    return f"{_xla_limit(rows):.2f}" if any(row.get("compiled_remat_limit_bytes") for row in rows) else NONE


def sharded_fit_table(rows: pathlib.Path) -> str:
    """A fit on several GPUs: per remat choice, the largest sequences per GPU, the plan there and at one more, and
    the predicted tokens/s per GPU (the fastest in bold)."""
    found = fit_rows(rows)
    fastest = max((_per_device(r) for r in found if r["fit_largest_minibatch"]), default=None)
    header = ("remat", f"largest sequences per GPU (budget {_budget(found)} GiB)", "plan GiB there",
              f"plan GiB at one more (refused: XLA's rematerialization stays above its {_xla_limit(found):.2f} GiB "
              "limit)", "predicted tokens/s per GPU there")  # fmt: skip
    lines = []
    for row in found:
        rate = _rate(row)
        plan = _gib(row) if row["fit_largest_minibatch"] else f"{_gib(row)} at 1"
        shown = f"**{rate}**" if row["fit_largest_minibatch"] and _per_device(row) == fastest else rate
        lines.append((row["fit_remat"], _largest(row), plan, _one_more(row), shown))
    return markdown(header, lines)


def attention_pair_table(rows: pathlib.Path, beside: pathlib.Path) -> str:
    """Two fits of the same question with different attention kernels, side by side (cuDNN beside flash)."""
    found, other = fit_rows(rows), _by_choice(beside)
    kernel, kernel_beside = found[0]["config.model.attention"], next(iter(other.values()))["config.model.attention"]
    names = {"cudnn": "cuDNN", "flash": "flash (above)"}
    first, second = names.get(kernel, kernel), names.get(kernel_beside, kernel_beside)
    header = (f"{first}: largest sequences per GPU (plan GiB)", "predicted tokens/s per GPU",
              f"{second}: largest (plan GiB)", "predicted tokens/s per GPU")  # fmt: skip
    lines = []
    for row in found:
        there = other.get(row["fit_choice"])
        lines.append((row["fit_remat"], _answer(row), _rate(row), _answer(there), _rate(there)))
    return markdown(("remat", *header), lines)


def _largest_only(row: dict | None) -> str:
    if row is None:
        return NONE
    return str(row["fit_largest_minibatch"] or "none")


def two_gpu_table(first: pathlib.Path, second: pathlib.Path, *reference: pathlib.Path) -> str:
    """One question on two GPUs: per remat choice each GPU's largest minibatch (plan GiB) and predicted tokens/s,
    and the largest minibatch of the same fits with the reference attention (`reference`: one fit per GPU)."""
    found, other = fit_rows(first), _by_choice(second)
    before = [_by_choice(path) for path in reference]
    gpus = [read_rows(path)[0]["fit_target"].upper() for path in (first, second)]
    budgets = [_budget(read_rows(path)) for path in (first, second)]
    header = ("remat", f"{gpus[0]} (budget {budgets[0]} GiB): largest minibatch (plan GiB)", "predicted tokens/s",
              f"{gpus[1]} (budget {budgets[1]} GiB): largest minibatch (plan GiB)", "predicted tokens/s",
              f"reference attention: {' / '.join(gpus)}")  # fmt: skip
    lines = []
    for row in found:
        there = other[row["fit_choice"]]
        ref = " / ".join(_largest_only(fit.get(row["fit_choice"])) for fit in before)
        lines.append((row["fit_remat"], _answer(row), _rate(row), _answer(there), _rate(there), ref))
    return markdown(header, lines)


def flash_beside_reference_table(rows: pathlib.Path, reference: pathlib.Path) -> str:
    """A fit with flash attention beside the same fit with the reference attention (largest minibatch, plan GiB)."""
    before, found = _by_choice(reference), fit_rows(rows)
    header = ("remat", f"flash (budget {_budget(found)} GiB): largest minibatch (plan GiB)", "predicted tokens/s",
              "reference attention: largest minibatch (plan GiB)")  # fmt: skip
    lines = [(row["fit_remat"], _answer(row), _rate(row), _answer(before.get(row["fit_choice"])))
             for row in found]  # fmt: skip
    return markdown(header, lines)


def chunked_loss_table(rows: pathlib.Path, whole: pathlib.Path) -> str:
    """A fit with the loss in chunks beside the same fit with the whole logits (largest minibatch, tokens/s)."""
    before = _by_choice(whole)
    header = ("remat", "chunked loss: largest minibatch (plan GiB)", "predicted tokens/s",
              "whole logits (above): largest minibatch, predicted tokens/s")  # fmt: skip
    lines = []
    for row in fit_rows(rows):
        there = before[row["fit_choice"]]
        lines.append((row["fit_remat"], _answer(row), _rate(row), f"{_largest_only(there)}, {_rate(there)}"))
    return markdown(header, lines)


def _card_budget(row: dict) -> str:
    """` *(card budget)*` for a fit whose budget was the card's whole memory, not JAX's default share."""
    return " *(card budget)*" if row["fit_budget_source"].startswith("memory of target") else ""


def _short(row: dict | None) -> str:
    """`largest (plan GiB to 0.1)`, `none` where nothing fits, – where the fit lacks the choice."""
    if row is None:
        return NONE
    if not row["fit_largest_minibatch"]:
        return "none"
    return f"{row['fit_largest_minibatch']} ({row['compiled_peak_bytes'] / GIB:.1f})"


def reference_fit_table(rows: pathlib.Path, ignore: pathlib.Path) -> str:
    """One GPU, one optimizer: per remat choice the largest minibatch (plan GiB) respecting XLA's limit, with
    `--xla_limit ignore`, and the analytic estimate's largest minibatch for the ignore fit's budget."""
    found, ignored = fit_rows(rows), _by_choice(ignore)
    first = next(iter(ignored.values()))
    header = ("remat", f"largest minibatch (plan GiB){_card_budget(found[0])}",
              f"with `--xla_limit ignore`{_card_budget(first)}",
              f"analytic says (for {first['fit_budget_bytes'] / GIB:.0f} GiB)")  # fmt: skip
    lines = [(row["fit_remat"], _answer(row), _answer(ignored.get(row["fit_choice"])),
              str(ignored.get(row["fit_choice"], row)["analytic_largest_minibatch"])) for row in found]  # fmt: skip
    return markdown(header, lines)


def optimizers_by_gpu_table(*fits: pathlib.Path) -> str:
    """Fits of one model on several GPUs and with several optimizers, each respecting XLA's limit or not: per
    optimizer and remat choice each GPU's largest minibatch (plan GiB), then the `--xla_limit ignore` answers."""
    grouped: dict[tuple[str, str, str], dict[str, dict]] = {}
    for path in fits:
        found = read_rows(path)
        key = (found[0]["config.optimizer.name"], found[0]["fit_xla_limit"], found[0]["fit_target"])
        grouped[key] = {row["fit_choice"]: row for row in found}
    optimizers = list(dict.fromkeys(key[0] for key in grouped))
    gpus = list(dict.fromkeys(key[2] for key in grouped))
    ignore_budget = next((_card_budget(next(iter(g.values()))) for k, g in grouped.items() if k[1] == "ignore"), "")
    budgets = {gpu: _budget([row for k, g in grouped.items() if k[1:] == ("respect", gpu) for row in g.values()])
               for gpu in gpus}  # fmt: skip
    header = ("optimizer", "remat",
              *(f"{gpu.upper()} (budget {budgets[gpu]} GiB): largest minibatch (plan GiB)" for gpu in gpus),
              f"XLA's limit GiB: {' / '.join(gpu.upper() for gpu in gpus)}",
              f"with `--xla_limit ignore`{ignore_budget}: {' / '.join(gpu.upper() for gpu in gpus)}")  # fmt: skip
    names = {"adam": "Adam", "adafactor": "Adafactor"}
    limits = {optimizer: " / ".join(_xla_limit_or_none(list(grouped.get((optimizer, "respect", gpu), {}).values()))
                                    for gpu in gpus) for optimizer in optimizers}  # fmt: skip
    lines = []
    for optimizer in optimizers:
        choices = [c for c in REMAT_CHOICES if any(c in g for k, g in grouped.items() if k[0] == optimizer)]
        for choice in choices:
            respect = [_answer(grouped.get((optimizer, "respect", gpu), {}).get(choice)) for gpu in gpus]
            ignored = [_short(grouped.get((optimizer, "ignore", gpu), {}).get(choice)) for gpu in gpus]
            label = REMAT_CHOICES[choice][0]
            lines.append((names.get(optimizer, optimizer), label, *respect, limits[optimizer],
                          " / ".join(ignored)))  # fmt: skip
    return markdown(header, lines)


_STEP_PARTS = ("matmul", "attention", "fusion", "copy_dus", "launch")


def sharded_fit_step_table(rows: pathlib.Path) -> str:
    """A fit on several GPUs, at each choice's largest minibatch: the predicted step and its parts, MFU, the
    collectives per GPU, and the analytic estimate beside the plan."""
    header = ("remat", "largest sequences per GPU",
              "predicted step s (matmuls / attention / fusions / copies / launches)",
              "collectives s exposed (hidden)", "predicted MFU", "all-gathers / reduce-scatters GB per GPU",
              "analytic GiB (/ plan)", "analytic says")  # fmt: skip
    lines = []
    for row in fit_rows(rows):
        if not row["fit_largest_minibatch"]:
            lines.append((row["fit_remat"], "none", *(NONE for _ in header[2:])))
            continue
        parts = " / ".join(f"{row[f'predicted_{part}_s']:.3f}" for part in _STEP_PARTS)
        gathers = row["compiled_collective_all_gather_bytes"] / GB
        scatters = row["compiled_collective_reduce_scatter_bytes"] / GB
        analytic = row["analytic_peak_bytes"]
        lines.append((
            row["fit_remat"], _largest(row), f"{row['predicted_step_s']:.2f} ({parts})",
            f"{row['predicted_collective_s']:.3f} ({row['predicted_collective_hidden_s']:.3f})",
            f"{row['predicted_mfu']:.1%}", f"{gathers:.1f} / {scatters:.1f}",
            f"{analytic / GIB:.2f} ({analytic / row['compiled_peak_bytes']:.2f})",
            str(row["analytic_largest_minibatch"]),
        ))  # fmt: skip
    return markdown(header, lines)

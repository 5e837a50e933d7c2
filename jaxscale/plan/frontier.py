"""The remat frontier: per-activation policies walked as MaxText's estimator walks them, each one's largest minibatch
and predicted speed, and the Pareto frontier of minibatch against predicted tokens/s.

MaxText's estimator (src/maxtext/utils/estimator.py: `RematPolicy.next_policy`, `search`) starts from every
activation of the block rematerialized, finds the largest batch that compiles without running out of memory, then
moves one activation one step towards the device (remat -> offload for each activation in turn, then offload ->
device for each), and searches again below the previous policy's batch (keeping more never fits more), until a
policy fits nothing. It compiles on the hardware and predicts no time. Here the same walk runs on the fit planner's
search (jaxscale.plan.fit_search.search_largest, each probe a deviceless compile for a GPU target), and each
policy's row carries the predictor's step and tokens/s at its largest minibatch (jaxscale.plan.predict): a
prediction, not a measurement.

Which activation moves first. MaxText sorts its tensors by `tensor_score` (the producing matmul's contraction
dimension, then its output width, both negated) and moves the last of that list first: the smallest tensors go to
the device first. Here the order is by bytes kept per FLOP of recomputation saved, ascending (`promotion_order`):
the greedy rule for filling a memory budget with what buys the most recompute per byte, the time a policy saves
being the recompute it avoids. Both quantities come from the lab's analytic models, which read the same policy
table as the model (jaxscale.measure.memory: the analytic peak; jaxscale.measure.flops: the recomputed matmuls):
for each activation, "it alone on the device" against "everything rematerialized", at minibatch 1. For a weight
matmul's output of width n from a contraction over k, that is p·n / (2·k·n) = p / (2k): ordering by it is
ordering by MaxText's first key, the contraction dimension, but with the largest contraction (the most FLOPs per
byte) kept first. Ties (llama3.2-1b's projections all contract over 2048) fall back to MaxText's rule, the
smaller tensor first, then the order of remat_policies.ACTIVATIONS. Activations whose keeping saves no matmul
(the MLP's hidden product and the down projection's output: no recomputed matmul is avoided by them in the
analytic count) move last.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import ml_collections

from jaxscale.cli import UsageError
from jaxscale.config import remat_policies
from jaxscale.config.spec import RunSpec
from jaxscale.measure import flops, memory
from jaxscale.plan import fit_recommend, fit_search

NAME = "frontier"  # fit's --remat choice that walks the frontier
DEFAULT_PLACES = ("offload", "device")  # the steps of the walk, in MaxText's order
DEFAULT_MAX_COMPILES = 40  # probes of the whole walk (each a compile unless kept from an earlier fit)
_RANK = {place: n for n, place in enumerate(("remat", "offload", "device"))}  # towards the device


def check_flags(remat: Sequence[str], places: Sequence[str], compiles: int) -> None:
    """fit's --remat frontier, --frontier_places and --frontier_compiles, each checked.

    Raises:
      UsageError: frontier beside other --remat choices, places not a non-empty run of offload, device (towards the
        device, each once), or a bound below 1 (one line naming the flag and what is allowed).
    """
    if list(remat) != [NAME]:
        raise UsageError(f"--remat {NAME}: walks the per-activation policies by itself; give it alone (got "
                         f"{','.join(remat)})")  # fmt: skip
    allowed = [p for p in DEFAULT_PLACES if p in places]
    if not places or list(places) != allowed:
        raise UsageError(f"--frontier_places: {','.join(places) or 'empty'}; allowed: offload,device (MaxText's "
                         "order) or either alone")  # fmt: skip
    if compiles < 1:
        raise UsageError(f"--frontier_compiles: must be >= 1, got {compiles}")


def activations(family: str) -> tuple[str, ...]:
    """The activations of remat_policies.ACTIVATIONS that `family`'s block tags (gpt has no MLP gate)."""
    every = frozenset().union(*remat_policies.FAMILY_TENSORS.values())
    absent = every - remat_policies.FAMILY_TENSORS[family]
    return tuple(
        name
        for name, tags in remat_policies.ACTIVATIONS.items()
        if not {t for tag in tags for t in remat_policies.TAG_TENSORS[tag]} <= absent
    )


def policy_name(places: dict[str, str]) -> str:
    """The per-activation policy (model.remat_policy, fit's --remat) of `places`, every activation spelled."""
    return remat_policies.PER_ACTIVATION + "+".join(f"{name}={place}" for name, place in places.items())


def places_of(name: str) -> dict[str, str]:
    """activation -> place of a per-activation policy name (the inverse of policy_name)."""
    pairs = name.removeprefix(remat_policies.PER_ACTIVATION).replace("+", ",").split(",")
    return dict(pair.split("=") for pair in pairs if pair)


def describe(places: dict[str, str]) -> str:
    """Short text of a policy: the activations not rematerialized, by place ("all remat" when none)."""
    kept = [f"{name}={place}" for name, place in places.items() if place != "remat"]
    return ", ".join(kept) or "all remat"


def activation_costs(config: ml_collections.ConfigDict) -> dict[str, tuple[int, float]]:
    """activation -> (bytes it keeps, recompute FLOPs it saves) per step at the smallest minibatch (1, or a
    pipeline's microbatches), from the analytic models: the policy keeping it alone on the device against the policy
    keeping nothing (both under Block remat)."""
    names = activations(config.model.family)
    smallest = fit_search.minibatch_step(config)

    def analytic(places: dict[str, str]) -> tuple[int, float]:
        run = RunSpec.from_config(fit_search.with_minibatch(config, policy_name(places), smallest))
        return memory.analytic_memory(run)["analytic_peak_bytes"], flops.recompute_flops_per_step(run)

    nothing_bytes, nothing_flops = analytic(dict.fromkeys(names, "remat"))
    costs = {}
    for name in names:
        kept_bytes, kept_flops = analytic({n: "device" if n == name else "remat" for n in names})
        costs[name] = (kept_bytes - nothing_bytes, nothing_flops - kept_flops)
    return costs


def promotion_order(costs: dict[str, tuple[int, float]]) -> tuple[str, ...]:
    """The activations in the order the walk moves them: bytes per FLOP saved ascending (none saved: last), then
    bytes ascending, then the order given (see the module's docstring for why)."""
    position = {name: n for n, name in enumerate(costs)}

    def key(name: str) -> tuple[float, int, int]:
        kept, saved = costs[name]
        return (kept / saved if saved > 0 else math.inf, kept, position[name])

    return tuple(sorted(costs, key=key))


def walk(order: Sequence[str], places: Sequence[str] = DEFAULT_PLACES) -> list[dict[str, str]]:
    """MaxText's sequence of policies: everything rematerialized, then, for each place in `places` (towards the
    device) and each activation in `order`, that activation moved there: 1 + len(places) x len(order) policies,
    each keeping at least what the one before keeps. Each policy is activation -> place, in `order`."""
    current = dict.fromkeys(order, "remat")
    policies = [dict(current)]
    for place in places:
        for name in order:
            if _RANK[current[name]] < _RANK[place]:
                current[name] = place
                policies.append(dict(current))
    return policies


def pareto(points: Sequence[tuple[int | None, float | None]]) -> list[bool | None]:
    """For each (largest minibatch, predicted tokens/s): whether no other point is at least as large in both and
    larger in one (both are better larger). A point that fits nothing is not on the frontier (False); one without a
    prediction cannot be placed (None)."""
    placed = [(b, s) for b, s in points if b and s is not None]
    flags: list[bool | None] = []
    for batch, speed in points:
        if not batch:
            flags.append(False)
        elif speed is None:
            flags.append(None)
        else:
            beaten = any(b >= batch and s >= speed and (b > batch or s > speed) for b, s in placed)
            flags.append(not beaten)
    return flags


@dataclasses.dataclass
class Frontier:
    """The walk's rows (one per searched policy, in walk order), the policies it did not search, and why."""

    rows: list[dict]
    unsearched: list[str]
    stopped: str | None  # why the walk stopped before its last policy, or None
    cut_by_bound: bool  # the compile bound stopped it (an answer among fewer policies than the walk holds)


# answer(policy name, largest minibatch to try, probes it may take) -> the policy's fit row (fit_search.fit_row's)
Answer = Callable[[str, int, int], dict]


def search(policies: Sequence[str], answer: Answer, limit: int, per_policy: int, total: int) -> Frontier:
    """Searches each policy's largest minibatch in walk order, as MaxText's estimator does.

    Args:
      policies: policy names in walk order (each keeps at least what the one before keeps).
      answer: searches one policy (fit's search, reusing kept probes) and returns its row.
      limit: the largest minibatch the first policy may try; each later one tries at most the previous policy's
        largest (keeping more never fits more: the row's `frontier_capped` says when a policy met that cap).
      per_policy: probes one policy's search may take (fit's --max_compiles).
      total: probes of the whole walk (--frontier_compiles); when spent, the rest are not searched and the
        Frontier says so.
    Returns:
      The Frontier; every row carries frontier_step, frontier_cap, frontier_capped.
    """
    rows: list[dict] = []
    cap, spent, stopped, cut = limit, 0, None, False
    for step, name in enumerate(policies):
        if spent >= total:
            stopped, cut = f"--frontier_compiles {total} spent after {step} of {len(policies)} policies", True
            break
        row = answer(name, cap, min(per_policy, total - spent))
        spent += row.get("fit_compiles") or 0
        largest = row.get("fit_largest_minibatch")
        row.update(frontier_step=step, frontier_cap=cap, frontier_capped=bool(largest and largest == cap < limit))
        rows.append(row)
        if row.get("status") == "oom" and step + 1 < len(policies):
            stopped = f"policy {step} fits no minibatch; those after it keep more and are not searched"
            break
        cap = largest or cap  # a failed compile (status error) says nothing of what fits: the cap stays
    return Frontier(rows, list(policies[len(rows) :]), stopped, cut)


def walk_config(
    config: ml_collections.ConfigDict, answer: Callable[[str, dict], dict], places: Sequence[str], limits: dict
) -> list[dict]:
    """The frontier of one question (fit's config, method and precision): its activations ordered, walked,
    searched within fit's limits (limit, max_compiles per policy, frontier_compiles in all) and marked.

    Args:
      answer: (policy name, {"limit", "max_compiles"}) -> its fit row (fit's search, reusing recorded rows/probes).
    Returns:
      The searched policies' rows in walk order, each with the walk's columns (frontier_*).
    """
    order = promotion_order(activation_costs(config))
    names = [policy_name(p) for p in walk(order, places)]
    found = search(names, lambda name, cap, probes: answer(name, {"limit": cap, "max_compiles": probes}),
                   limits["limit"], limits["max_compiles"], limits["frontier_compiles"])  # fmt: skip
    mark(found.rows)
    for row in found.rows:
        policy = describe(places_of(row["fit_choice"]))
        row.update(
            fit_remat=f"Block, frontier step {row['frontier_step']} ({policy})",  # the label; fit_choice runs it
            frontier_policy=policy,
            frontier_order=list(order),
            frontier_policies=len(names),
            frontier_stopped=found.stopped,
            frontier_cut_by_bound=found.cut_by_bound,
            frontier_unsearched=found.unsearched,
        )
    return found.rows


def notes(rows: list[dict]) -> list[str]:
    """What the walk's rows say beside the table: the order, where and why it stopped, that speeds are predicted."""
    if not rows:
        return []
    first = rows[0]
    lines = [f"walk: {len(rows)} of {first['frontier_policies']} policies searched, activations moved in the order "
             f"{', '.join(first['frontier_order'])} (bytes kept per recompute FLOP saved, ascending)"]  # fmt: skip
    if first.get("frontier_stopped"):
        bound = " (the bound cut the walk: raise --frontier_compiles to search the rest)"
        lines.append(f"stopped: {first['frontier_stopped']}" + (bound if first.get("frontier_cut_by_bound") else ""))
    if any(r.get("frontier_capped") for r in rows):
        lines.append("(cap): the largest minibatch equals the previous policy's, the most it tried (keeping more "
                     "is assumed never to fit more, as MaxText's estimator assumes)")  # fmt: skip
    fastest = next((r for r in rows if r.get("frontier_fastest")), None)
    if fastest is not None:
        lines.append(f"the fastest that fits runs with --config.model.remat='(\"Block\",)' "
                     f"--config.model.remat_policy={fastest['fit_choice']}")  # fmt: skip
    if any(r.get("predicted_tokens_per_s") is not None for r in rows):
        priced = any("predicted_host_link_s" in r for r in rows)
        link = "priced at the target's PCIe link" if priced else "not priced at the PCIe link by this predictor"
        lines.append("steps and tokens/s are predicted from the target's compiled program (docs/predict.md), not "
                     f"measured; offloaded activations' host copies are {link}")  # fmt: skip
    else:
        lines.append("no predicted speeds (no --target): the frontier is not placed, the answer is by tokens per step")
    return lines


def mark(rows: list[dict]) -> dict | None:
    """Sets frontier_on (pareto) and frontier_fastest on each row, in place; returns the fastest that fits: the
    fit recommendation by predicted tokens/s (fit_recommend, whose tie rule it keeps), or None when none fits."""
    flags = pareto([(r.get("fit_largest_minibatch"), r.get("predicted_tokens_per_s")) for r in rows])
    best, _ = fit_recommend.recommend(rows, rank="predicted")
    for row, flag in zip(rows, flags, strict=True):
        row.update(frontier_on=flag, frontier_fastest=row is best)
    return best


def format_table(rows: list[dict]) -> str:
    """One line per searched policy: the policy, its largest minibatch, predicted step and tokens/s, and whether
    it is on the frontier (the fastest marked)."""
    head = ("step", "policy (not remat)", "largest minibatch", "predicted step s", "predicted tokens/s", "frontier")
    lines = [head]
    for r in rows:
        largest = r.get("fit_largest_minibatch")
        shown = "none" if not largest else f"{largest}" + ("" if r.get("fit_search_complete", True) else "+ (cut)")
        shown += " (cap)" if r.get("frontier_capped") else ""
        step_s, speed = r.get("predicted_step_s"), r.get("predicted_tokens_per_s")
        on = {True: "yes", False: "no", None: "-"}[r.get("frontier_on")]
        lines.append((
            str(r.get("frontier_step")), describe(places_of(r["fit_choice"])), shown,
            "-" if not largest or step_s is None else f"{step_s:.3f}",
            "-" if not largest or speed is None else f"{speed:,.0f}",
            on + (" (fastest)" if r.get("frontier_fastest") else ""),
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)

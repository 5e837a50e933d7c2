"""The collectives of a compiled step as result-row columns: how many run per step and how many bytes each device
moves, per kind, counted from the optimized HLO with loop trip counts (`jaxscale.measure.hlo.count_collectives`).

Per kind (all_reduce, all_gather, reduce_scatter, all_to_all, collective_permute):

- `compiled_collective_<kind>_count`: executions per optimizer step (a collective inside the scanned layers'
  loop counts once per layer and minibatch);
- `compiled_collective_<kind>_bytes`: the sum over those executions of the buffer each works on, per device:
  an all-reduce's operand (= result), an all-gather's gathered result, a reduce-scatter's operand, an
  all-to-all's or collective-permute's operand (see hlo.Collective). It is a size, not the wire traffic.

Totals: `compiled_collective_count`, `compiled_collective_bytes`, and `compiled_collective_ring_bytes`: what
each device sends if every collective runs as a ring over its replica group of n devices, 2(n-1)/n · bytes
for an all-reduce, (n-1)/n · bytes for all-gather, reduce-scatter and all-to-all, bytes for a
collective-permute. The CPU backend has no reduce-scatter: there FSDP's gradient reduction compiles to an
all-reduce followed by a slice (2x the ring traffic of a reduce-scatter); GPU targets compile reduce-scatters.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxscale.measure import hlo

KIND_COLUMNS = {kind: kind.replace("-", "_") for kind in hlo.COLLECTIVE_KINDS}


def summarize(collectives: Iterable[hlo.Collective]) -> dict[str, dict[str, float]]:
    """Per kind (and "other"): {"count", "bytes", "ring_bytes"} per step, each collective times its executions.

    This is the reusable part: a step-time model can cost each kind with its own bandwidth.
    """
    totals = {kind: {"count": 0, "bytes": 0, "ring_bytes": 0.0} for kind in (*hlo.COLLECTIVE_KINDS, "other")}
    for collective in collectives:
        entry = totals[collective.kind]
        entry["count"] += collective.executions
        entry["bytes"] += collective.executions * collective.bytes
        entry["ring_bytes"] += collective.executions * collective.ring_bytes
    return totals


def collective_columns(hlo_text: str) -> dict[str, int | float]:
    """The compiled_collective_* columns (module docstring) of one compiled step's HLO text."""
    totals = summarize(hlo.count_collectives(hlo.parse(hlo_text)))
    row: dict[str, int | float] = {}
    for kind, column in KIND_COLUMNS.items():
        row[f"compiled_collective_{column}_count"] = totals[kind]["count"]
        row[f"compiled_collective_{column}_bytes"] = totals[kind]["bytes"]
    row["compiled_collective_count"] = sum(t["count"] for t in totals.values())
    row["compiled_collective_bytes"] = sum(t["bytes"] for t in totals.values())
    row["compiled_collective_ring_bytes"] = round(sum(t["ring_bytes"] for t in totals.values()))
    return row


def summary_line(row: dict) -> str | None:
    """One line for the run summary: collectives per step and bytes per device, by kind (None without any)."""
    if not row.get("compiled_collective_count"):
        return None
    parts = [
        f"{row[f'compiled_collective_{c}_count']} {kind} {row[f'compiled_collective_{c}_bytes'] / 2**20:.2f} MiB"
        for kind, c in KIND_COLUMNS.items()
        if row.get(f"compiled_collective_{c}_count")
    ]
    return (
        f"  collectives per step (compiled HLO, per device): {', '.join(parts)}; ring traffic "
        f"{row['compiled_collective_ring_bytes'] / 2**20:.2f} MiB sent per device"
    )

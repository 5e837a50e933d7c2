"""docs/measurements.md's tables, written from the committed rows of the CPU seed-table sweeps."""

from __future__ import annotations

import pathlib
import statistics
import string

from jaxscale.report.models_tables import markdown
from jaxscale.sweep.results import read_rows

UNRECORDED_ALLOCATOR = "glibc"  # rows from before host_allocator was recorded were all measured with glibc's malloc


def _allocator(rows: list[dict]) -> str:
    found = {row.get("host_allocator") or UNRECORDED_ALLOCATOR for row in rows}
    if len(found) != 1:
        raise ValueError(f"a sweep measured with several allocators: {sorted(found)}")
    return found.pop()


def allocator_table(*sweeps: pathlib.Path) -> str:
    """The same variants measured by several sweeps, lettered A, B, ... in the order given and grouped by the
    host allocator their rows record (the first allocator before the second): each sweep's median step and the
    change of the median over each group's sweeps.

    Args:
      sweeps: results.jsonl of each sweep; the first sets the variants' order.

    Returns:
      The markdown table.
    """
    groups: dict[str, list[tuple[str, dict[str, float]]]] = {}
    for letter, path in zip(string.ascii_uppercase, sweeps, strict=False):
        rows = read_rows(path)
        groups.setdefault(_allocator(rows), []).append((letter, {r["variant"]: r["step_s_median"] for r in rows}))
    (old, before), (new, after) = groups.items()
    header = ("variant", *(f"{name}: {' / '.join(letter for letter, _ in found)} s"
                           for name, found in ((old, before), (new, after))), "median change")  # fmt: skip
    lines = []
    for variant in before[0][1]:
        steps = [[m[variant] for _, m in found] for found in (before, after)]
        change = statistics.median(steps[1]) / statistics.median(steps[0]) - 1
        lines.append((variant, *(" / ".join(f"{x:.3f}" for x in s) for s in steps), f"{change:+.0%}"))
    return markdown(header, lines)

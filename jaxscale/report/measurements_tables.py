"""docs/measurements.md's tables, written from committed rows: the CPU seed-table sweeps' (the allocator), and
experiments/layer_bytes.py's H100 plans (what one layer keeps, beside the closed form)."""

from __future__ import annotations

import pathlib
import re
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


_PROBE_NAME = re.compile(r"^(?P<keep>.+)_L(?P<layers>\d+)_(?P<seq>\d+)k$")


def layer_slopes(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per way of keeping (the variant's name without its `_L<layers>_<seq>k`), from its four plans (two layer counts
    at two sequence lengths, experiments/layer_bytes.py): `kept`, the bytes one layer keeps per token (the per-token
    slopes' difference over the layer counts'), `working`, the per-token bytes of neither (the slope at the most layers
    less their kept bytes), and the largest plan's row (`largest`). A way with other than four ok plans is left out.

    Args:
      rows: one sweep's rows.
    """
    groups: dict[str, dict[tuple[int, int], dict]] = {}
    for row in rows:
        found = _PROBE_NAME.match(row["variant"])
        if found and row.get("status") == "ok":
            size = (int(found["layers"]), row["config.data.seq_len"])
            groups.setdefault(found["keep"], {})[size] = row
    ways = {}
    for keep, plans in groups.items():
        layers, seqs = sorted({n for n, _ in plans}), sorted({s for _, s in plans})
        if len(plans) != 4 or len(layers) != 2 or len(seqs) != 2:
            continue
        tokens = (seqs[1] - seqs[0]) * plans[layers[0], seqs[0]]["config.data.batch_size"]
        slopes = [(plans[n, seqs[1]]["compiled_temp_bytes"] - plans[n, seqs[0]]["compiled_temp_bytes"]) / tokens
                  for n in layers]  # fmt: skip
        kept = (slopes[1] - slopes[0]) / (layers[1] - layers[0])
        ways[keep] = {"kept": kept, "working": slopes[1] - layers[1] * kept, "largest": plans[layers[1], seqs[1]]}
    return ways


def layer_bytes_table(*sweeps: pathlib.Path) -> str:
    """What one layer keeps per token, compiled (layer_slopes; and for scanned layers the largest plan's forward loop
    outputs, compiled_scan_saved_bytes) beside the memory model's count and the closed form (what the layer's backward
    pass reads), in bytes per token per layer over the hidden size h, and the working set (per token, over h) and
    predicted step of the largest plan; one block of rows per family (sweep).

    Args:
      sweeps: results.jsonl of experiments/layer_bytes.py's sweeps, one per preset.

    Returns:
      The markdown table.
    """
    header = ("model", "layers", "keeps", "compiled, slope (h)", "compiled, scan loop (h)", "memory model (h)",
              "closed form (h)", "slope / closed", "working set (h)", "predicted step (ms)")  # fmt: skip
    lines = []
    for path in sweeps:
        for keep, way in layer_slopes(read_rows(path)).items():
            row = way["largest"]
            h, tokens = row["config.model.hidden_size"], row["config.data.seq_len"] * row["config.data.batch_size"]
            analytic = row["analytic_activation_per_layer_bytes"] / tokens
            closed = row["analytic_closed_form_per_layer_bytes"] / tokens
            loop = row.get("compiled_scan_saved_bytes")
            loop = "-" if loop is None else f"{loop / (row['config.model.num_layers'] * tokens * h):.1f}"
            scan, _, name = keep.partition("_")
            lines.append((row["config.preset"], "scanned" if scan == "scan" else "unrolled", name,
                          f"{way['kept'] / h:.1f}", loop, f"{analytic / h:.1f}",
                          f"{closed / h:.1f}", f"{way['kept'] / closed:.2f}", f"{way['working'] / h:.1f}",
                          f"{row['predicted_step_s'] * 1000:.0f}"))  # fmt: skip
    return markdown(header, lines)


def accumulation_table(sweep: pathlib.Path) -> str:
    """What accumulating four minibatches adds to one minibatch's step, per layout, with each minibatch's whole
    gradient made and then added (after4) and with the layers' and the chunked head's gradients added into the
    accumulator inside the backward pass (in4): the compiled plans' temporaries and peaks per GPU, the memory
    model's peak and the predicted step (experiments/accumulation_memory.py's rows, `<layout>_<mode>`).

    Args:
      sweep: results.jsonl of experiments/accumulation_memory.py's sweep.

    Returns:
      The markdown table.
    """
    rows = {row["variant"]: row for row in read_rows(sweep)}
    header = ("layout (GPUs)", "temp, 1 minibatch (GB)", "temp, 4 after (GB)", "temp, 4 inside (GB)",
              "added: after / inside (GB)", "peak: after / inside (GiB)", "memory model: after / inside (GiB)",
              "fits: after / inside", "predicted step: after / inside (s)")  # fmt: skip
    lines = []
    for layout in dict.fromkeys(name.rpartition("_")[0] for name in rows):
        one, after, inside = (rows[f"{layout}_{mode}"] for mode in ("mb1", "after4", "in4"))
        temp = [row["compiled_temp_bytes"] / 1e9 for row in (one, after, inside)]
        devices = one["config.mesh.data"] * one["config.mesh.fsdp"]
        stage = f", ZeRO-{one['config.mesh.zero_stage']}" if one["config.mesh.fsdp"] > 1 else ""
        lines.append((f"{layout} ({devices}{stage})", f"{temp[0]:.1f}", f"{temp[1]:.1f}", f"{temp[2]:.1f}",
                      f"{temp[1] - temp[0]:.1f} / {temp[2] - temp[0]:.1f}",
                      f"{after['compiled_peak_bytes'] / 2**30:.1f} / {inside['compiled_peak_bytes'] / 2**30:.1f}",
                      f"{after['analytic_peak_bytes'] / 2**30:.1f} / {inside['analytic_peak_bytes'] / 2**30:.1f}",
                      f"{'yes' if after['plan_fits'] else 'no'} / {'yes' if inside['plan_fits'] else 'no'}",
                      f"{after['predicted_step_s']:.2f} / {inside['predicted_step_s']:.2f}"))  # fmt: skip
    return markdown(header, lines)

"""docs/mesh.md's pipeline tables: the compiled GPipe and circular plans of experiments/pipeline.py, their bubble read
from the compiled loop, and the analytic 1F1B and interleaved 1F1B schedules beside them (labelled analytic)."""

from __future__ import annotations

import pathlib

from jaxscale.plan.pipeline_schedules import AnalyticSchedule
from jaxscale.report.mesh_tables import GIB, _fits, _num, _per_gpu, markdown, sweep_rows
from jaxscale.run_summary import compiled_bubble, pipeline_schedule

GB = 1e9
_KINDS = ("collective_permute", "all_to_all", "all_reduce", "all_gather")  # the table's collective columns, in order


def _bytes(row: dict, kind: str) -> float:
    return (row.get(f"compiled_collective_{kind}_bytes") or 0) / GB


def pipeline_table(rows: pathlib.Path, sweep: str) -> str:
    """One row per variant: the schedule, the compiled loop's iterations and the bubble they leave ((iterations -
    v·m) / iterations, beside the schedule's (p - 1)/(v·m + p - 1)), the plan's peak per GPU, the collectives (GB a
    step per GPU), the predicted step (its matmul seconds include the bubble's iterations) and tokens/s per GPU."""
    cells = []
    for row in sweep_rows(rows, sweep):
        found = pipeline_schedule(row)
        iterations = row.get("compiled_pipeline_iterations")
        if found:
            p, m, v = found
            name = "GPipe" if v == 1 else f"circular, {v} visits"
            bubble = _num(compiled_bubble(row), ".1%")
            expected = f"{(p - 1) / (v * m + p - 1):.1%}"
        else:
            name, m, bubble, expected = "no pipeline", "-", "-", "-"
        cells.append({
            "variant": f"{row['variant']} (`{row['mesh_layout']}`)",
            "schedule": name, "microbatches in flight": str(m),
            "compiled loop iterations": _num(iterations, "d"),
            "bubble: compiled / (p-1)/(vm+p-1)": f"{bubble} / {expected}",
            "plan GiB / GPU": f"{row['compiled_peak_bytes'] / GIB:.1f}", "fits": _fits(row, bold=True),
            "permute / all-to-all / all-reduce / all-gather GB": " / ".join(f"{_bytes(row, k):.1f}" for k in _KINDS),
            "predicted step s (matmul)": f"{row['predicted_step_s']:.2f} ({row['predicted_matmul_s']:.2f})",
            "predicted tokens/s per GPU": f"{_per_gpu(row):,.0f}",
        })  # fmt: skip
    return markdown(cells)


def schedules_table(rows: pathlib.Path, sweep: str) -> str:
    """For each compiled pipeline of the sweep, the analytic schedules of the same stages and microbatches
    (jaxscale.plan.pipeline_schedules): bubble, and the (microbatch, layer) activation sets the first and the last
    rank hold at their peak, in units of one layer's input for one microbatch; GPipe's m·L/p is what the compiled
    program keeps (Block remat: each layer's input, every iteration's)."""
    cells = []
    for row in sweep_rows(rows, sweep):
        found = pipeline_schedule(row)
        if not found:
            continue
        p, m, v = found
        layers = int(row["config.model.num_layers"])
        options = [AnalyticSchedule("gpipe", p, m), AnalyticSchedule("1f1b", p, m)]
        if m % p == 0:
            options.append(AnalyticSchedule("interleaved_1f1b", p, m, max(v, 2)))
        for schedule in options:
            chunks = f", {schedule.chunks} chunks" if schedule.chunks > 1 else ""
            cells.append({
                "compiled variant": row["variant"], "schedule (analytic)": schedule.name + chunks,
                "p x m": f"{p} x {m}", "bubble": f"{schedule.bubble:.1%}",
                "first rank: layer activations": str(schedule.peak_layer_activations(0, layers)),
                "last rank": str(schedule.peak_layer_activations(p - 1, layers)),
            })  # fmt: skip
    return markdown(cells)

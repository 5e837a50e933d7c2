"""docs/mesh.md's tables, written from the committed rows of the mesh, layout and long-context sweeps."""

from __future__ import annotations

import pathlib
import runpy

import pandas as pd

from jaxscale.report.markdown import to_markdown
from jaxscale.sweep.results import _f32_shares, mesh_of, read_rows
from jaxscale.sweep.sweep_file import load_sweep

GIB, MIB, GB = 2**30, 2**20, 1e9
_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def sweep_rows(rows: pathlib.Path, sweep: str) -> list[dict]:
    """A sweep's committed rows in its sweep file's variant order (rows of variants it no longer has last).

    Args:
      rows: the sweep's results.jsonl.
      sweep: its sweep file with the preset, e.g. /repo/experiments/mesh.py:cpu.

    Returns:
      The rows (the last of each variant), ordered as get_variants lists them.
    """
    order = {name: i for i, name in enumerate(load_sweep(sweep).variant_names)}
    found = read_rows(rows)
    return sorted(found, key=lambda row: order.get(row.get("variant"), len(order)))


def markdown(cells: list[dict[str, str]]) -> str:
    """Rows of ready-formatted cells (header -> text) as a GitHub markdown table."""
    return to_markdown(pd.DataFrame(cells))


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


def _fits(row: dict, bold: bool) -> str:
    return "yes" if row.get("plan_fits") else ("**no**" if bold else "no")


def _per_gpu(row: dict) -> float:
    """Predicted tokens/s per GPU: the step's tokens over the predicted step time and the mesh's devices."""
    return row["tokens_per_step"] / row["predicted_step_s"] / row["mesh_devices"]


def _kinds(row: dict, kinds: tuple[str, ...], unit: float) -> str:
    return " / ".join(f"{(row.get(f'compiled_collective_{kind}_bytes') or 0) / unit:.1f}" for kind in kinds)


def cpu_mesh_table(rows: pathlib.Path, sweep: str) -> str:
    """The mesh sweep on simulated CPU devices: measured step, CPU plan and analytic memory, collectives (MiB)."""
    cells = []
    for row in sweep_rows(rows, sweep):
        cells.append({
            "variant": row["variant"], "mesh": mesh_of(row),
            "step s median (p90)": f"{_num(row['step_s_median'], '.2f')} ({_num(row['step_s_p90'], '.2f')})",
            "tokens/s": _num(row["tokens_per_s"], ",.0f"),
            "peak MiB / device (CPU plan)": _num(row["compiled_peak_bytes"] / MIB, ".1f"),
            "analytic MiB": _num(row["analytic_peak_bytes"] / MIB, ".1f"),
            "plan / analytic": _num(row["compiled_to_analytic_peak_ratio"], ".2f"),
            "all-reduce / all-gather / reduce-scatter MiB": _kinds(row, _KINDS, MIB),
            "collective MiB": _num(row["compiled_collective_bytes"] / MIB, ".1f"),
            "ring MiB sent": _num(row["compiled_collective_ring_bytes"] / MIB, ".1f"),
        })  # fmt: skip
    return markdown(cells)


def gpu_mesh_table(rows: pathlib.Path, sweep: str) -> str:
    """The mesh sweep planned for GPUs: per-GPU plan (Triton / cuBLAS), analytic estimate, fit, collectives."""
    cells = []
    for row in sweep_rows(rows, sweep):
        band = f"{row['compiled_triton_peak_bytes'] / GIB:.2f} / {row['compiled_cublas_peak_bytes'] / GIB:.2f}"
        state = row["analytic_params_bytes"] + row["analytic_optimizer_bytes"]
        cells.append({
            "variant": row["variant"], "mesh": mesh_of(row),
            "GPUs (topology)": f"{row['plan_devices']} ({row['plan_topology']})",
            "planned peak GiB / GPU (Triton / cuBLAS)": f"{row['compiled_peak_bytes'] / GIB:.2f} ({band})",
            "analytic GiB / GPU": f"{row['analytic_peak_bytes'] / GIB:.2f}",
            "plan / analytic": _num(row["compiled_to_analytic_peak_ratio"], ".2f"),
            "params + Adam GiB / GPU (analytic)": f"{state / GIB:.2f}",
            "fits": _fits(row, bold=False),
            "all-reduce / all-gather / reduce-scatter MiB": _kinds(row, _KINDS, MIB),
            "of them float32": _f32_shares(row),
            "ring MiB sent / GPU": _num(row["compiled_collective_ring_bytes"] / MIB, ".1f"),
        })  # fmt: skip
    return markdown(cells)


def _analytic_parts(row: dict) -> str:
    parts = ("params", "grads", "optimizer", "activation")
    split = " / ".join(f"{row[f'analytic_{part}_bytes'] / GIB:.2f}" for part in parts)
    return f"{row['analytic_peak_bytes'] / GIB:.2f} ({split})"


def layouts_table(rows: pathlib.Path, sweep: str) -> str:
    """Every layout of experiments/layouts*.py: plan and analytic memory per GPU, fit, collectives (GB), prediction."""
    cells = []
    for row in sweep_rows(rows, sweep):
        cells.append({
            "layout": f"{row['variant']} (`{row['mesh_layout']}`)", "mesh": mesh_of(row),
            "plan GiB / GPU": f"{row['compiled_peak_bytes'] / GIB:.2f}",
            "analytic GiB (params / grads / Adam / activations)": _analytic_parts(row),
            "fits": _fits(row, bold=True),
            "all-reduce / all-gather / reduce-scatter / permute GB": _kinds(row, (*_KINDS, "collective_permute"), GB),
            "predicted step s (collectives exposed)":
                f"{row['predicted_step_s']:.3f} ({row['predicted_collective_s']:.3f})",
            "predicted tokens/s per GPU": f"{_per_gpu(row):,.0f}",
            "MFU": f"{row['predicted_mfu']:.1%}",
        })  # fmt: skip
    return markdown(cells)


def _ratio_range(rows: list[dict]) -> str:
    ratios = [row["compiled_to_analytic_peak_ratio"] for row in rows]
    return f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "-"


def layout_answers_table(*sweeps: str) -> str:
    """Per layout sweep (alternating rows path and sweep file): the fastest layout that fits, what does not fit,
    and plan / analytic over the plans that fit."""
    cells = []
    for rows_path, sweep in zip(sweeps[::2], sweeps[1::2], strict=True):
        rows = sweep_rows(pathlib.Path(rows_path), sweep)
        fits = [row for row in rows if row.get("plan_fits")]
        best = max(fits, key=_per_gpu) if fits else None
        cells.append({
            "GPUs": str(rows[0]["mesh_devices"]),
            "fastest layout that fits": f"`{best['variant']}`" if best else "none",
            "predicted tokens/s per GPU (MFU)": f"{_per_gpu(best):,.0f} ({best['predicted_mfu']:.1%})" if best else "-",
            "plan GiB / GPU": f"{best['compiled_peak_bytes'] / GIB:.2f}" if best else "-",
            "do not fit": ", ".join(f"`{row['variant']}`" for row in rows if not row.get("plan_fits")) or "-",
            "plan / analytic where it fits": _ratio_range(fits),
        })  # fmt: skip
    return markdown(cells)


def _torchtitan(experiment: str) -> dict[tuple[str, int], tuple[float, float]]:
    return runpy.run_path(experiment.partition(":")[0])["TORCHTITAN_TABLE_2"]


def long_context_table(rows: pathlib.Path, sweep: str) -> str:
    """FSDP x context parallelism at long sequences beside torchtitan's measured Table 2 (where it has the point)."""
    published, cells = _torchtitan(sweep), []
    for row in sweep_rows(rows, sweep):
        seq = row["config.data.seq_len"]
        measured = published.get((row["variant"].rsplit("_", 1)[0], seq))
        cells.append({
            "variant": row["variant"], "mesh": mesh_of(row), "sequence": f"{seq:,}",
            "plan GiB / GPU": f"{row['compiled_peak_bytes'] / GIB:.2f}",
            "analytic GiB": f"{row['analytic_peak_bytes'] / GIB:.2f}",
            "fits": _fits(row, bold=True),
            "predicted step s": f"{row['predicted_step_s']:.2f}",
            "predicted tokens/s per GPU": f"{_per_gpu(row):,.0f}",
            "MFU": f"{row['predicted_mfu']:.1%}",
            "ring permutes GB": f"{(row.get('compiled_collective_collective_permute_bytes') or 0) / GB:.1f}",
            "torchtitan measured tokens/s per GPU (memory)": f"{measured[0]:,} ({measured[1]} GiB)" if measured else "",
            "predicted / measured": f"{_per_gpu(row) / measured[0]:.2f}" if measured else "",
        })  # fmt: skip
    return markdown(cells)


def long_context_answers_table(rows: pathlib.Path, sweep: str) -> str:
    """Per FSDP x CP layout: the largest sequence that fits, its plan and prediction, and torchtitan's beside it."""
    published, largest = _torchtitan(sweep), {}
    for row in sweep_rows(rows, sweep):
        layout = row["variant"].rsplit("_", 1)[0]
        if row.get("plan_fits") and row["config.data.seq_len"] > largest.get(layout, {}).get("config.data.seq_len", 0):
            largest[layout] = row
        largest.setdefault(layout, {})
    cells = []
    for layout, row in largest.items():
        measured = [f"{seq:,}: {rate:,}" for (name, seq), (rate, _) in published.items() if name == layout]
        cells.append({
            "layout": f"`{layout}`",
            "largest sequence that fits": f"{row['config.data.seq_len']:,}" if row else "none",
            "plan GiB / GPU": f"{row['compiled_peak_bytes'] / GIB:.2f}" if row else "-",
            "predicted tokens/s per GPU": f"{_per_gpu(row):,.0f}" if row else "-",
            "torchtitan measured (sequence: tokens/s per GPU)": ", ".join(measured) or "-",
        })  # fmt: skip
    return markdown(cells)

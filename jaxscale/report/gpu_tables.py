"""docs/fp8.md's and docs/gpu.md's tables: runs measured on a GPU beside what was planned and predicted for them,
and the fit planner's bf16 and FP8 answers side by side."""

from __future__ import annotations

import pathlib

from jaxscale.report.models_tables import markdown
from jaxscale.sweep.results import read_rows

GIB = 2**30


def _by_variant(path: pathlib.Path) -> dict[str, dict]:
    return {row["variant"]: row for row in read_rows(path)}


def _ratio(value: float | None, of: float | None) -> str:
    return f"{value / of:.2f}" if value and of else "–"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def fp8_table(*pairs: pathlib.Path) -> str:
    """bf16 and FP8 of each model: the committed deviceless prediction, the GPU's measurement, and how they compare.

    Args:
      pairs: for each model, the `--plan --target` sweep's results.jsonl, then the `--on_this_device` one's.

    Returns:
      The markdown table: first sight = the plan's predicted step (committed before the GPU ran) / the measured
      median; "on the GPU" = the step predicted from the program compiled on the GPU itself, in the run's row.
    """
    header = ("model", "variant", "predicted s (plan, first)", "measured s (median / p90)", "first sight: pred / meas",
              "on the GPU: pred / meas", "speedup over bf16: measured / predicted", "MFU of bf16 peak",
              "MFU of FP8 peak", "device GiB", "plan GiB")  # fmt: skip
    lines = []
    for plan_path, measured_path in zip(pairs[::2], pairs[1::2], strict=True):
        plans, measured = _by_variant(plan_path), _by_variant(measured_path)
        base_plan, base_measured = plans["bf16"]["predicted_step_s"], measured["bf16"]["step_s_median"]
        for variant, row in measured.items():
            plan = plans[variant]
            step = row["step_s_median"]
            speedup = "–" if variant == "bf16" else (
                f"{base_measured / step:.2f}x / {base_plan / plan['predicted_step_s']:.2f}x")  # fmt: skip
            lines.append((row["config.preset"], variant, f"{plan['predicted_step_s']:.4f}",
                          f"{step:.4f} / {row['step_s_p90']:.4f}", f"**{plan['predicted_step_s'] / step:.2f}**",
                          _ratio(row.get("predicted_step_s"), step), speedup, _pct(row.get("mfu")),
                          _pct(row.get("mfu_fp8_peak")), f"{row['device_peak_bytes'] / GIB:.2f}",
                          f"{plan['compiled_peak_bytes'] / GIB:.2f}"))  # fmt: skip
    return markdown(header, lines)


def seed_on_gpu_table(measured_path: pathlib.Path, plan_path: pathlib.Path) -> str:
    """The seed table measured on a GPU beside the deviceless plan of the same GPU.

    Args:
      measured_path: the `--on_this_device` sweep's results.jsonl.
      plan_path: the `--plan --target` sweep's results.jsonl for that GPU.

    Returns:
      The markdown table: the step (median, p90), the allocator's peak against the plan's, and the predicted step
      of the program compiled on the GPU (in the run's row, made by the predictor as committed when it ran) and of
      the deviceless plan, each over the measured median.
    """
    plans = _by_variant(plan_path)
    header = ("variant", "measured s (median / p90)", "tokens/s", "MFU", "device GiB", "plan GiB", "device / plan",
              "predicted on the GPU / measured", "plan's predicted / measured")  # fmt: skip
    lines = []
    for variant, row in _by_variant(measured_path).items():
        plan, step = plans.get(variant, {}), row["step_s_median"]
        plan_peak = plan.get("compiled_peak_bytes")
        lines.append((variant, f"{step:.4f} / {row['step_s_p90']:.4f}", f"{row['tokens_per_s']:,.0f}",
                      _pct(row.get("mfu")), f"{row['device_peak_bytes'] / GIB:.2f}",
                      f"{plan_peak / GIB:.2f}" if plan_peak else "–", _ratio(row["device_peak_bytes"], plan_peak),
                      _ratio(row.get("predicted_step_s"), step),
                      _ratio(plan.get("predicted_step_s"), step)))  # fmt: skip
    return markdown(header, lines)


def precision_fit_table(path: pathlib.Path) -> str:
    """A `fit --precision bf16,fp8` answer: per fine-tuning method, precision and remat choice, the largest minibatch
    per GPU that fits, its plan, and the predicted speed there (per GPU: the mesh's tokens over its GPUs).

    Args:
      path: the fit's results.jsonl.

    Returns:
      The markdown table.
    """
    header = ("method", "precision", "remat", "largest minibatch / GPU", "plan GiB / GPU", "predicted step s",
              "predicted tokens/s / GPU", "predicted MFU of bf16 peak", "of FP8 peak")  # fmt: skip
    lines = []
    for row in read_rows(path):
        largest, devices = row.get("fit_largest_minibatch"), row.get("fit_devices") or 1
        tokens = row.get("predicted_tokens_per_s") if largest else None
        lines.append((row.get("fit_finetune") or "as configured", row.get("fit_precision") or "-",
                      row.get("fit_remat", row["variant"]), str(largest) if largest else f"none ({row.get('status')})",
                      f"{row['compiled_peak_bytes'] / GIB:.1f}" if largest else "-",
                      f"{row['predicted_step_s']:.3f}" if largest else "-",
                      f"{tokens / devices:,.0f}" if tokens else "-",
                      _pct(row.get("predicted_mfu") if largest else None),
                      _pct(row.get("predicted_mfu_fp8_peak") if largest else None)))  # fmt: skip
    return markdown(header, lines)


def plan_then_measured_table(plan_path: pathlib.Path, measured_path: pathlib.Path) -> str:
    """Each variant's deviceless plan (committed before the GPU ran) beside what the GPU measured, or why it did not
    run (an out-of-memory row, as the plan said).

    Args:
      plan_path: the `--plan --target` sweep's results.jsonl.
      measured_path: the `--on_this_device` sweep's results.jsonl.

    Returns:
      The markdown table.
    """
    measured = _by_variant(measured_path)
    header = ("variant", "plan GiB", "plan fits", "predicted s (plan, first)", "on the GPU",
              "measured s (median / p90)", "device GiB", "first sight: pred / meas")  # fmt: skip
    lines = []
    for variant, plan in _by_variant(plan_path).items():
        row = measured.get(variant, {})
        step = row.get("step_s_median")
        lines.append((variant, f"{plan['compiled_peak_bytes'] / GIB:.1f}", "yes" if plan.get("plan_fits") else "no",
                      f"{plan['predicted_step_s']:.4f}", row.get("status", "not run"),
                      f"{step:.4f} / {row['step_s_p90']:.4f}" if step else "–",
                      f"{row['device_peak_bytes'] / GIB:.1f}" if row.get("device_peak_bytes") and step else "–",
                      _ratio(plan["predicted_step_s"], step)))  # fmt: skip
    return markdown(header, lines)

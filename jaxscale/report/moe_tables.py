"""docs/models.md's mixture-of-experts layout tables, written from the committed rows of
`python -m jaxscale.sweep --config experiments/moe_layouts.py:<preset> --plan --target h100 --devices 8`."""

from __future__ import annotations

import pathlib

from jaxscale.report.models_tables import GIB, NONE, markdown
from jaxscale.sweep.results import read_rows


def _optimizer(row: dict) -> str:
    """The optimizer as the variant set it: Adafactor, or Adam with its state as stored."""
    name = row["config.optimizer.name"]
    if name != "adam":
        return name
    if row.get("config.optimizer.offload_state"):
        return "adam, state on host"
    return {"bfloat16": "adam, bf16 first moment", "int8": "adam, 8-bit moments"}.get(
        row["config.optimizer.state_dtype"], "adam")


def _number(value, scale: float = 1.0, spec: str = ".2f") -> str:
    return NONE if value is None or value == "" else f"{float(value) / scale:{spec}}"


def layouts_table(rows: pathlib.Path) -> str:
    """One row per variant, fastest predicted first among the plans that fit, then the rest (fastest first).

    Args:
      rows: the sweep's results.jsonl.

    Returns:
      The markdown table: the layout (data x fsdp x tensor x context x expert), dispatch, optimizer; the plan's
      peak per GPU and whether it fits (XLA's own limit at JAX's default 75% pool, as every plan row judges it);
      the predicted step, tokens/s per GPU and MFU (model FLOPs of the k active experts, jaxscale.measure.flops);
      the all-to-all bytes a GPU sends a step (compiled); the experts' matmul FLOPs the compiled program executes
      over the active experts' (jaxscale.measure.expert_flops).
    """
    found = [row for row in read_rows(rows) if row.get("status") == "ok"]
    found.sort(key=lambda r: (not r.get("plan_fits"), -float(r.get("predicted_tokens_per_s") or 0)))
    header = ("variant", "layout", "dispatch", "optimizer", "plan GiB", "fits", "predicted s", "tokens/s per GPU",
              "MFU %", "all-to-all GiB", "expert FLOPs / active")  # fmt: skip
    lines = []
    for row in found:
        devices = row.get("plan_devices") or row.get("mesh_devices") or 1
        lines.append((
            row["variant"], row["mesh_layout"], row["config.model.moe_dispatch"], _optimizer(row),
            _number(row["compiled_peak_bytes"], GIB, ".1f"), "yes" if row.get("plan_fits") else "no",
            _number(row.get("predicted_step_s"), 1, ".3f"),
            _number(row.get("predicted_tokens_per_s"), devices, ",.0f"), _number(row.get("predicted_mfu"), 0.01, ".1f"),
            _number(row.get("compiled_collective_all_to_all_bytes"), GIB, ".1f"),
            _number(row.get("compiled_to_analytic_expert_flops_ratio"), 1, ".2f"),
        ))  # fmt: skip
    return markdown(header, lines)

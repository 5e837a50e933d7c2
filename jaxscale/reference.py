"""The reference notebook's variants, and its measured peaks beside their plans for GPU targets.

`python -m jaxscale.reference --target a5000 --target h100` compiles each variant at the `seed` scale for
each target (`jaxscale.gpu_plan`, no GPU needed) and prints planned vs notebook peak memory.

The notebook (UvA DL "Profiling and Scaling Single-GPU Transformer Models", one RTX A5000) read its peaks
from TensorBoard's memory viewer, which prints binary units: it calls a [12, 16, 512, 4096] bfloat16 array
"768MB", i.e. 768 MiB. So its "14.6GB" is 14.6 GiB, and the figures below are GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections

from jaxscale import gpu_plan
from jaxscale.cli import UsageError, fail
from jaxscale.config import validate

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class NotebookVariant:
    """One row of the notebook's table: a config file at `seed` plus dotted overrides, and what it measured."""

    name: str
    config_file: str
    overrides: dict[str, Any]
    notebook_peak_gib: float  # as printed by the notebook (TensorBoard memory viewer, GiB)
    note: str = ""


NOTEBOOK_VARIANTS: tuple[NotebookVariant, ...] = (
    NotebookVariant("fp32, scan", "fp32.py", {}, 20.6, "XLA auto-remat warnings on the A5000"),
    NotebookVariant("bf16, scan", "bf16.py", {}, 14.6),
    NotebookVariant("bf16, no scan", "bf16_noscan.py", {}, 8.8),
    NotebookVariant("bf16, scan, remat MLP+Attn", "bf16_remat.py", {}, 3.9),
    NotebookVariant("bf16, scan, remat Block", "bf16_remat_block.py", {}, 3.8),
    NotebookVariant("bf16, remat MLP+Attn, 1 minibatch", "bf16_remat_noaccum.py", {}, 6.2),
    NotebookVariant("bf16, remat, batch 256", "bf16_remat_noaccum.py", {"data.batch_size": 256}, 15.0, "'15GB usage'"),
)


def load_config(config_file: str, preset: str = "seed", overrides: dict[str, Any] | None = None):
    """`configs/<config_file>`'s get_config(preset) with dotted overrides applied, validated and locked."""
    path = CONFIG_DIR / config_file
    spec = importlib.util.spec_from_file_location(f"_jaxscale_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config: ml_collections.ConfigDict = module.get_config(preset)
    for dotted, value in (overrides or {}).items():
        group, field = dotted.split(".")
        config[group][field] = value
    validate(config)
    config.lock()
    return config


def plan_variant(variant: NotebookVariant, target: str, gemm: str = "both") -> dict[str, Any]:
    """The target plan of one notebook variant at `seed`, with the notebook's peak and the ratio beside it."""
    config = load_config(variant.config_file, "seed", variant.overrides)
    row = {"variant": variant.name, "config_file": variant.config_file, "overrides": variant.overrides}
    try:
        row.update(gpu_plan.plan_for_target(config, target, gemm=gemm))
        row["status"], row["error"] = "ok", None
    except gpu_plan.PlanError as error:
        row.update(status="error", error=str(error), plan_target=target, compiled_peak_bytes=None)
    row["notebook_peak_bytes"] = round(variant.notebook_peak_gib * GIB)
    peak = row.get("compiled_peak_bytes")
    row["planned_over_notebook"] = None if peak is None else peak / row["notebook_peak_bytes"]
    return row


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Planned vs notebook peak per variant and target, in GiB."""
    lines = [
        "| variant | target | planned peak GiB | triton / cublas GiB | notebook GiB (A5000) | planned / notebook "
        "| fits | XLA remat limit GiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.get("planned_over_notebook") is None else f"{r['planned_over_notebook']:.2f}"
        fits = {True: "yes", False: "**no**", None: r.get("error") or "-"}[r.get("plan_fits")]
        compile_s = "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"
        lines.append(
            f"| {r['variant']} | {r['plan_target']} | {_gib(r.get('compiled_peak_bytes'))} "
            f"| {_gib(r.get('compiled_triton_peak_bytes'))} / {_gib(r.get('compiled_cublas_peak_bytes'))} "
            f"| {_gib(r['notebook_peak_bytes'])} | {ratio} | {fits} | {_gib(r.get('compiled_remat_limit_bytes'))} "
            f"| {compile_s} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxscale.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, help="GPU target (repeatable)")
    parser.add_argument("--gemm", choices=gpu_plan.GEMM_CHOICES, default="both")
    parser.add_argument("--jsonl", type=pathlib.Path, help="also write one JSON row per plan here")
    args = parser.parse_args(argv)
    try:
        for name in args.target:
            gpu_plan.check_target_flag(name, plan=True)
    except UsageError as error:
        return fail(str(error))
    rows = []
    for name in args.target:
        for variant in NOTEBOOK_VARIANTS:
            rows.append(plan_variant(variant, name, args.gemm))
            print(f"planned {variant.name} for {name}: {_gib(rows[-1]['compiled_peak_bytes'])} GiB", file=sys.stderr)
            if args.jsonl:
                with args.jsonl.open("a") as handle:
                    handle.write(json.dumps(rows[-1], default=str) + "\n")
    print(markdown_table(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

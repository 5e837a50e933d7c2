"""The measurement columns of a result row: FLOPs and memory estimates beside XLA's, MFU, trace summary.

jaxscale.run calls `after_compile` once the step is compiled (also for --plan) and `after_run` after the
timed and profiled steps; each returns columns to merge into the row.
"""

from __future__ import annotations

import gzip
import pathlib

import jax
import ml_collections

from jaxscale.config.spec import RunSpec
from jaxscale.measure import collectives, expert_flops, flops, layer_loop, memory, traces


def after_compile(config: ml_collections.ConfigDict, compiled: jax.stages.Compiled | None, row: dict) -> dict:
    """Analytic FLOPs and memory, XLA's (loop-aware) FLOP count, the collectives, compiled/analytic peak ratio (per
    device on a mesh), and a mixture of experts' matmul FLOPs compiled against its active experts' (expert_flops).

    `compiled` is None for a GPU target's plan (compiled in a child process, which counts its collectives
    itself): the ratio then compares the estimate with that plan, and the compiled FLOP columns are left out.
    """
    compiled_columns, text = {}, None
    if compiled is not None:
        text = compiled.as_text()
        compiled_columns = {**flops.compiled_columns(compiled, text), **collectives.collective_columns(text)}
    run = RunSpec.from_config(config)  # the analytic models' view of the config, read once for both
    if text is not None and run.mesh.stage > 1:  # a pipeline: its loop's iterations, as the compiled program runs them
        compiled_columns["compiled_pipeline_iterations"] = layer_loop.pipeline_iterations(text)
    return {
        **flops.analytic_columns(run),
        **compiled_columns,
        **memory.analytic_columns(run, row.get("compiled_peak_bytes")),
        **expert_flops.row_columns(config, text, row),
    }


def after_run(config: ml_collections.ConfigDict, compiled: jax.stages.Compiled, row: dict) -> dict:
    """MFU / HFU from the median step, device/analytic peak ratio, and the trace's summary columns.

    A trace that cannot be analysed does not fail the run: the row gets trace_analysis_error instead.
    """
    columns = flops.utilization_columns(row, config.model.dtype, fp8=config.model.fp8 != "none")
    device_peak, _ = memory.device_peak_bytes()
    analytic = row.get("analytic_peak_bytes")
    columns["device_to_analytic_peak_ratio"] = device_peak / analytic if device_peak and analytic else None
    if row.get("trace_dir"):
        trace_dir = pathlib.Path(row["trace_dir"])
        try:
            text = compiled.as_text()
            with gzip.open(trace_dir / traces.HLO_FILE, "wt") as handle:
                handle.write(text)
            summary, _ = traces.analyze(trace_dir, text)
            columns.update(summary)
        except Exception as error:  # noqa: BLE001 - any reader failure is reported in the row, not raised
            columns["trace_analysis_error"] = f"{type(error).__name__}: {error}"[:300]
    return columns


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value / scale, spec)


def _flop(value: float | None) -> str:
    """FLOPs with a unit: 179 MFLOP, 103 GFLOP, 32.6 TFLOP."""
    if value is None:
        return "n/a"
    scale, unit = next(((s, u) for s, u in ((1e12, "T"), (1e9, "G"), (1e6, "M")) if value >= s), (1.0, ""))
    return f"{value / scale:.3g} {unit}FLOP"


def _above_peak(row: dict) -> str:
    """Why a utilization above 100% cannot be: the step ran faster than the peak it is divided by, so the peak is
    wrong; a CPU's is a measurement (jaxscale.measure.peaks), cached, and one taken while the machine was loaded
    stays low until a faster one replaces it."""
    if row.get("backend") == "cpu":
        return (
            "  utilization above 100%: this step ran faster than the cached roofline, which was measured while "
            "the machine was busier; `python -m jaxscale.bench` measures it again and keeps the faster"
        )
    return "  utilization above 100%: this step ran faster than the peak it is divided by; that peak is wrong"


_DISPATCH_WORDS = {
    "scatter": "capacity's slots by index",
    "capacity": "GShard's one-hot einsums",
    "ragged": "dropless jax.lax.ragged_dot, which XLA expands over every expert on a GPU",
    "dense": "every expert on every token",
}
_SCOPE_WORDS = {"minibatch": "each minibatch's rows on every device", "device": "each device's rows",
                "sequence": "each sequence"}  # fmt: skip


def moe_line(row: dict) -> str | None:
    """A mixture of experts' dispatch and where its load-balancing statistics are taken (jaxscale.model.moe), from
    the row's config; None for a dense model."""
    if not row.get("config.model.num_experts"):
        return None
    dispatch = row["config.model.moe_dispatch"]
    text = f"  mixture of experts: {dispatch} dispatch ({_DISPATCH_WORDS[dispatch]}"
    if dispatch in ("scatter", "capacity"):
        text += f"; capacity factor {row['config.model.moe_capacity_factor']:g}, choices past it dropped"
    text += ")"
    if row.get("config.model.moe_aux_loss_weight"):
        text += f"; load balance over {_SCOPE_WORDS[row['config.model.moe_balance_scope']]}"
    return text


def per_parameter_line(row: dict) -> str | None:
    """What full training holds per parameter on a device, from the analytic model's bytes (weights, gradients,
    optimizer state; with optimizer.in_backward the gradients one layer at a time); None when some parameters are
    frozen, on a mesh, or before the analytic model ran."""
    trained, total = row.get("trainable_params"), row.get("params")
    if not trained or trained != total or row.get("analytic_params_bytes") is None or row.get("mesh_devices", 1) > 1:
        return None
    per = {name: row[f"analytic_{name}_bytes"] / trained for name in ("params", "grads", "optimizer")}
    grads = f"gradients {per['grads']:.2f} B"
    if row.get("config.optimizer.in_backward"):
        grads += " (one layer's at a time: each updated inside the backward pass)"
    return (f"  per parameter (analytic): weights {per['params']:.2f} B, {grads}, optimizer state "
            f"{per['optimizer']:.2f} B")  # fmt: skip


def summary_lines(row: dict) -> list[str]:
    """Human-readable lines for jaxscale.run's summary: FLOPs, MFU, analytic memory, trace shares."""
    lines = []
    if row.get("analytic_model_flops_per_step") is not None:
        text = (
            f"  per step: model {_flop(row['analytic_model_flops_per_step'])}, hardware "
            f"{_flop(row.get('analytic_hardware_flops_per_step'))} (analytic)"
        )
        if row.get("compiled_matmul_flops_per_step") is not None:
            bound = ", a lower bound: loop bodies counted once" if row.get("compiled_xla_flops_lower_bound") else ""
            text += (
                f"; compiled matmuls {_flop(row['compiled_matmul_flops_per_step'])}; XLA's cost analysis "
                f"{_flop(row.get('compiled_xla_flops_per_step'))}{bound}"
            )
        lines.append(text)
        lines.append(
            f"  analytic peak {_fmt(row.get('analytic_peak_bytes'), 2**30, '.3f')} GiB; compiled/analytic "
            f"{_fmt(row.get('compiled_to_analytic_peak_ratio'), 1, '.2f')}"
        )
    lines += [line for line in [moe_line(row), per_parameter_line(row)] if line]
    if row.get("compiled_to_analytic_expert_flops_ratio") is not None:
        lines.append(
            f"  experts' matmuls: compiled {_flop(row['compiled_expert_matmul_flops_per_step'])} (remat "
            f"{_flop(row['compiled_expert_recompute_flops_per_step'])}), active experts "
            f"{_flop(row['analytic_expert_matmul_flops_per_step'])} (analytic): "
            f"{row['compiled_to_analytic_expert_flops_ratio']:.2f}x"
        )
    collective_line = collectives.summary_line(row)
    if collective_line:
        lines.append(collective_line)
    if row.get("mfu") is not None:
        lines.append(
            f"  MFU {row['mfu']:.1%}  HFU {_fmt(row.get('hfu'), 0.01, '.1f')}%  (peak: {row['peak_flops_source']})"
        )
        if max(row["mfu"], row.get("hfu") or 0) > 1:
            lines.append(_above_peak(row))
    if "mfu_fp8_peak" in row:  # model.fp8: the same FLOP/s over the FP8 tensor peak
        value = row["mfu_fp8_peak"]
        lines.append(f"  MFU of the FP8 peak {'n/a (no FP8 peak on this device)' if value is None else f'{value:.1%}'}")
    if row.get("trace_step_s") is not None:
        lines.append(
            f"  trace analysis: step {row['trace_step_s']:.4f} s; matmul {row['trace_matmul_share']:.0%}, fusion "
            f"{row['trace_fusion_share']:.0%}, dynamic-update-slice {row['trace_dus_share']:.0%}, copy "
            f"{row['trace_copy_share']:.0%}, remat {_fmt(row.get('trace_remat_share'), 0.01, '.0f')}%"
        )
    return lines

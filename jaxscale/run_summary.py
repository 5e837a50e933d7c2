"""A result row in words: the run summary printed after a run."""

from __future__ import annotations

import pathlib

from jaxscale.config import finetune
from jaxscale.config.spec import mesh_axes_text
from jaxscale.measure import columns
from jaxscale.plan import cost, gpu_plan, predict
from jaxscale.train import loop as train_loop


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def _cache_text(row: dict) -> str:
    if row.get("compile_cache_hit"):
        return f" (from the compilation cache; it saved {row['compile_cache_saved_s']:.1f} s)"
    return "" if row.get("compile_cache_hit") is None else " (compiled: not in the compilation cache)"


def pipeline_schedule(row: dict) -> tuple[int, int, int] | None:
    """(stages p, microbatches m, visits v) of a row's pipeline (its config columns), None without one."""
    stages = int(row.get("config.mesh.stage") or 1)
    if stages == 1:
        return None
    microbatches = int(row.get("config.mesh.pipeline_microbatches") or 0) or stages
    return stages, microbatches, int(row.get("config.mesh.pipeline_repeats") or 1)


def compiled_bubble(row: dict) -> float | None:
    """The share of a row's pipeline loop iterations no stage uses: (iterations - v·m) / iterations, the iterations
    read from the compiled program (compiled_pipeline_iterations); None without a pipeline or that column."""
    found, iterations = pipeline_schedule(row), row.get("compiled_pipeline_iterations")
    if found is None or not iterations:
        return None
    _, m, v = found
    return (iterations - v * m) / iterations


def pipeline_line(row: dict) -> str | None:
    """The summary's pipeline line: its schedule, the compiled loop's iterations and the bubble they leave."""
    found = pipeline_schedule(row)
    if found is None:
        return None
    (p, m, v), bubble = found, compiled_bubble(row)
    name = "GPipe" if v == 1 else f"circular, {v} visits a stage"
    loop = "loop iterations not read" if bubble is None else (
        f"{row['compiled_pipeline_iterations']} loop iterations in the compiled program, bubble {bubble:.1%} of the "
        "stages' layer work")  # fmt: skip
    return f"  pipeline: {p} stages, {name}, {m} microbatches in flight: {loop}"


def summary(row: dict) -> str:
    """A short human-readable account of a result row."""
    lines = [f"run {row['name']}: {row['status']}" + (f" ({row['error']})" if row["error"] else "")]
    if row.get("params") is not None:
        lines.append(
            f"  params {row['params']:,}   tokens/step {row['tokens_per_step']:,}   compile {row['compile_s']:.1f} s"
            + _cache_text(row)
        )
        lines += [line for line in [finetune.summary_line(row)] if line]  # what trains (and what is frozen)
        if row.get("grad_accumulation"):
            where = {
                "in_backward": "each layer's gradient added into the accumulator inside the backward pass",
                "after_backward": "each minibatch's whole gradient made, then added",
            }[row["grad_accumulation"]]
            lines.append(f"  accumulation: {row['config.train.num_minibatches']} minibatches, {where} "
                         f"(train.grad_accumulation={row['config.train.grad_accumulation']})")  # fmt: skip
        lines += [line for line in [pipeline_line(row)] if line]
        lines.append(
            f"  compiled plan ({row['compiled_backend']}): peak {_gib(row['compiled_peak_bytes'])} = "
            f"args {_gib(row['compiled_argument_bytes'])} + out {_gib(row['compiled_output_bytes'])} - "
            f"alias {_gib(row['compiled_alias_bytes'])} + temp {_gib(row['compiled_temp_bytes'])}"
        )
    if row.get("plan_target") is not None:
        lines.append(gpu_plan.summary_line(row))
    if row.get("step_s_median") is not None:
        lines.append(
            f"  step {row['step_s_median']:.4f} s median, {row['step_s_p90']:.4f} s p90 over "
            f"{len(row['step_s_all'])} steps   {row['tokens_per_s']:,.0f} tokens/s"
        )
        first = "n/a: resumed" if row.get("loss_first") is None else f"{row['loss_first']:.4f}"
        lines.append(f"  loss {row['loss']:.4f} (first step {first})   accuracy {row['accuracy']:.4f}")
    lines += train_loop.summary_lines(row)
    lines += columns.summary_lines(row)
    if row.get("predicted_step_s") is not None:
        lines.append(predict.summary_line(row))
    if cost.cost_text(row):
        lines.append(f"  {cost.cost_text(row)}")
    if row.get("mesh_devices", 1) > 1:
        layout = f"{mesh_axes_text(row['mesh'])}: {row.get('mesh_layout', '')}"
        lines.insert(1, f"  mesh {row['mesh']} ({layout}) on {row['mesh_devices']} devices, "
                        f"{row['process_count']} process(es); memory figures are per device")  # fmt: skip
    lines += [f"  shape warning: {warning}" for warning in row.get("shape_warnings") or ()]
    device = _gib(row["device_peak_bytes"]) if row["device_peak_bytes"] is not None else row["device_peak_note"]
    malloc = f" (malloc: {row['host_allocator']})" if row.get("host_allocator") else ""
    if row.get("host_allocator") == "glibc" and row.get("backend") == "cpu":
        malloc = " (malloc: glibc, which maps buffers over 32 MiB afresh each step; see docs/measurements.md)"
    lines.append(f"  device peak: {device}   host peak RSS: {_gib(row['host_peak_rss_bytes'])}{malloc}")
    if row.get("trace_dir"):
        lines.append(
            f"  trace: {row['trace_dir']}  (tensorboard --logdir {pathlib.Path(row['trace_dir']).parent} "
            "--host 127.0.0.1)"
        )
    return "\n".join(lines)

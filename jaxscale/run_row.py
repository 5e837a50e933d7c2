"""One run's result row: compile (timed), the memory plan and prediction, the steps, the failure as a row."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import time

import jax
import ml_collections

from jaxscale import compile_cache, hosts
from jaxscale.config import flatten, mesh_shape, mesh_text
from jaxscale.config.spec import accumulates_in_backward, layout_text, tokens_per_step
from jaxscale.measure import columns, flops, memory, params
from jaxscale.plan import calibrate, gpu_plan, predict
from jaxscale.run_steps import RunError, execute
from jaxscale.train import sharding
from jaxscale.train.step import param_columns


def base_row(config: ml_collections.ConfigDict, name: str, run_dir: pathlib.Path) -> dict:
    """The identifying part of a result row: what ran, where, with what (and on which mesh)."""
    device = jax.devices()[0]
    return {
        "name": name,
        "status": "running",
        "error": None,
        **flatten(config),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "hostname": platform.node(),
        "host_allocator": memory.host_allocator(),
        "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "tokens_per_step": tokens_per_step(config),
        # where each minibatch's gradient joins the accumulator (train.grad_accumulation resolved; None: one minibatch)
        "grad_accumulation": (None if config.train.num_minibatches == 1 else
                              "in_backward" if accumulates_in_backward(config) else "after_backward"),  # fmt: skip
        "mesh": mesh_text(config),  # data x fsdp x tensor (x context); every memory column is per device
        "mesh_devices": mesh_shape(config).devices,
        "mesh_layout": layout_text(config),  # e.g. "dp2 zero1x4 tp2+sp cp2"
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "analytic_model_flops_per_step": flops.model_flops_per_step(config),
        "shape_warnings": params.shape_warnings(config.model),
        "run_dir": str(run_dir),
        "trace_dir": None,
    }

def compile_step(config: ml_collections.ConfigDict):
    """Lowers and compiles the train step for abstract inputs, on one device or on the config's mesh.

    Returns:
      (compiled, placement (how the step is fed, jaxscale.train.sharding), abstract train state,
      lower + compile seconds).
    """
    placement = sharding.placement(config)
    abstract_state, abstract_metrics, abstract_batch = placement.abstract_inputs()
    start = time.perf_counter()
    compiled = placement.step().lower(abstract_state, abstract_metrics, abstract_batch).compile()
    return compiled, placement, abstract_state, time.perf_counter() - start

def local_prediction(
    config: ml_collections.ConfigDict, compiled: jax.stages.Compiled, calibration: calibrate.Calibration | None = None
) -> dict:
    """The step time predicted from the compiled program on this machine's rooflines (jaxscale.plan.predict),
    calibrated when a calibration is given (jaxscale.plan.calibrate); a prediction that fails leaves
    predicted_error in the row, never fails the run."""
    try:
        if calibration is not None:
            return calibrate.local_columns(config, compiled.as_text(), jax.devices()[0], calibration)
        return predict.local_columns(config, compiled.as_text(), jax.devices()[0])
    except Exception as error:  # noqa: BLE001 - the prediction is an extra; the run's own numbers come first
        return {"predicted_step_s": None, "predicted_error": f"{type(error).__name__}: {error}"[:300]}

def classify_failure(text: str) -> str:
    """Row status for a failure message: `oom` for XLA's out-of-memory errors (RESOURCE_EXHAUSTED), else `error`."""
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return "oom"
    return "error"

def check_memory_budget(row: dict, budget_bytes: int | None) -> None:
    """Raises RunError("oom") when the compiled plan's peak exceeds a device-memory budget (bytes)."""
    peak = row.get("compiled_peak_bytes")
    if budget_bytes is None or peak is None or peak <= budget_bytes:
        return
    backend = row["compiled_backend"]
    plan = f"the {backend.upper()} compiler's plan" + (", a proxy for a GPU's" if backend == "cpu" else "")
    if backend.startswith("cuda:"):
        plan = f"XLA's GPU plan for target {backend.removeprefix('cuda:')}"
    raise RunError(
        "oom",
        f"compiled peak {peak:,} bytes ({peak / 2**30:.2f} GiB) exceeds the device-memory budget of "
        f"{budget_bytes:,} bytes ({budget_bytes / 2**30:.2f} GiB) (source: compiled plan, {plan}); steps not run",
    )

def run(
    config: ml_collections.ConfigDict,
    run_dir: pathlib.Path,
    name: str,
    plan_only: bool = False,
    progress: bool = True,
    device_memory_bytes: int | None = None,
    target: str | None = None,
    gemm: str = "both",
    devices: int | None = None,
    calibration: calibrate.Calibration | None = None,
) -> dict:
    """Compiles, runs and measures one config; always returns a result row (status ok|oom|error|nan).

    A `device_memory_bytes` budget stands in for a smaller accelerator: a step whose compiled plan exceeds it
    is recorded as `oom` without running its steps. With `target` (plan only) the compiled_* columns are XLA's
    plan for that GPU (jaxscale.gpu_plan, GEMM modes `gemm`) on `devices` of them (the config's mesh), and
    the budget is checked against that plan. On a mesh every memory column is per device. With a `calibration`
    (jaxscale.plan.calibrate) the predicted_* columns are calibrated on its run, and the row says so.
    """
    if target is not None and not plan_only:
        raise ValueError("run: a target GPU can only be planned (plan_only=True)")
    row = base_row(config, name, run_dir)
    row["device_memory_budget_bytes"] = device_memory_bytes
    placement = None
    try:
        if target is not None:
            row.update(gpu_plan.plan_for_target(config, target, gemm=gemm, devices=devices or 1, hlo_dir=run_dir))
        else:
            with compile_cache.watch() as cache:
                compiled, placement, abstract_state, row["compile_s"] = compile_step(config)
            row.update(cache.columns())
            row.update(param_columns(abstract_state))
            row.update(memory.compiled_memory(compiled))
            row["compiled_backend"] = jax.default_backend()
            row.update(local_prediction(config, compiled, calibration))
        row.update(columns.after_compile(config, None if target else compiled, row))
        check_memory_budget(row, device_memory_bytes)
        if not plan_only:
            execute(config, compiled, placement, run_dir, row, progress)
            row.update(columns.after_run(config, compiled, row))
            row["predicted_over_measured"] = predict.over_measured(row)
        row["status"] = "ok"
    except RunError as error:
        row["status"], row["error"] = error.status, str(error)
    except Exception as error:  # a failed variant is a row, not a crash (XLA raises many types)
        row["status"], row["error"] = (
            classify_failure(str(error)),
            hosts.failure_text(" ".join(f"{type(error).__name__}: {error}".split()))[:500],
        )
    if plan_only:  # nothing ran: the allocator's peak would be of an idle device, not of this step
        row["device_peak_bytes"], row["device_peak_note"] = None, "plan only: no step ran on the device"
    else:
        local = placement.local_devices if placement is not None else None
        row["device_peak_bytes"], row["device_peak_note"] = memory.device_peak_bytes(local)
    row["host_peak_rss_bytes"] = memory.host_peak_rss_bytes()
    row["plan_only"] = plan_only
    return row

def write_row(path: pathlib.Path, row: dict) -> None:
    """Writes the row as JSON atomically (temp file + rename), so a crash leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(row, indent=1, default=str) + "\n")
    tmp.replace(path)

"""One measured run: `python -m jaxscale.run --config configs/bf16_remat.py[:preset] [--plan]`.

compile (ahead of time, timed) -> warm-up -> timed steps -> profiled steps -> result row (JSON).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

import jax
import ml_collections
from absl import flags
from tqdm import tqdm

from jaxscale import compile_cache, data, hosts
from jaxscale.cli import (
    CONFIG_FIELDS_NOTE,
    Usage,
    UsageError,
    check_cost_flags,
    config_path,
    define_cache_flag,
    define_calibrate_flag,
    define_config_flag,
    define_cost_flags,
    fail,
    parse_bytes,
    parse_config_flags,
    print_help,
    wants_help,
)
from jaxscale.config import ConfigError, check_mesh_devices, describe, finetune, flatten, mesh_shape, mesh_text
from jaxscale.config.spec import layout_text, mesh_axes_text
from jaxscale.measure import columns, flops, memory, params, profiling
from jaxscale.measure.scalars import ScalarWriter
from jaxscale.plan import calibrate, cost, gpu_plan, predict, targets
from jaxscale.train import evaluate, sharding
from jaxscale.train import loop as train_loop
from jaxscale.train.step import param_columns

USAGE = Usage(
    command="python -m jaxscale.run --config CONFIG.py[:PRESET] [--config.GROUP.FIELD=VALUE ...] [flags]",
    summary="Compiles, runs and measures one config (step time, memory, FLOPs and MFU, a profiler trace) and "
    "writes the result row as JSON; --plan compiles only, --plan --target plans for a GPU you do not have.",
    examples=(
        "python -m jaxscale.run --config configs/bf16_remat.py:cpu",
        "python -m jaxscale.run --config configs/bf16_remat.py:cpu --config.train.steps=20 --config.model.num_layers=2",
        "python -m jaxscale.run --config configs/bf16_remat.py:seed --plan --target a5000",
        "python -m jaxscale.run --config configs/bf16_remat.py:llama3.1-8b --config.data.seq_len=8192 "
        "--config.data.batch_size=16 --config.mesh.fsdp=8 --plan --target h100 --devices 8",
        "python -m jaxscale.run --config configs/bf16_remat.py:cpu --calibrate traces/seed_table_cpu/bf16_scan",
        "python -m jaxscale.run --config configs/bf16_remat.py:cpu --show_config",
    ),
    notes=(
        "Presets: seed (the reference scale), cpu (about a second a step on 2 cores), tiny (tests); without one "
        "the run picks seed on a GPU/TPU and cpu on the CPU; real models at full size: gpt2, gpt2-medium, "
        "gpt2-large, gpt2-xl, tinyllama-1.1b, llama2-7b, llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b "
        "(docs/models.md). Configs: configs/*.py.",
        CONFIG_FIELDS_NOTE,
        "Output: <output_root>/traces/<run name>/result.json and the trace beside it; the row's columns are "
        "described in README.md and docs/measurements.md.",
    ),
)

# Rough sustained FLOP/s per backend, used only to warn before a long run (never reported as a measurement).
_ASSUMED_FLOPS_FOR_ESTIMATE = {"cpu": 5e10, "gpu": 5e13, "tpu": 5e13}
_LONG_RUN_S = 120.0


class RunError(Exception):
    """The run failed after it started; carries the row status (oom | error | nan)."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def _flag_values(argv: Sequence[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    define_config_flag(fv, argv)
    flags.DEFINE_bool(
        "plan", False, "Compile only: report params, tokens per step and the memory plan.", flag_values=fv
    )
    flags.DEFINE_string("name", None, "Run name (default: <config name>_<preset>_<timestamp>).", flag_values=fv)
    flags.DEFINE_string("output_root", ".", "Root under which traces/<run name>/ is written.", flag_values=fv)
    flags.DEFINE_string(
        "run_dir", None, "Exact directory for this run's trace and result (overrides the above).", flag_values=fv
    )
    flags.DEFINE_string(
        "device_memory",
        None,
        "Memory budget such as 24GiB: a step whose compiled plan exceeds it is recorded as oom, not run.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "target",
        None,
        f"With --plan: plan for this GPU instead of this machine, no GPU needed ({', '.join(targets.TARGETS)} "
        "or a GpuTargetConfig .txtpb); needs the gpu-plan extra. See docs/gpu_planning.md.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "gemm",
        "both",
        gpu_plan.GEMM_CHOICES,
        "With --target: plan with Triton GEMMs, cuBLAS GEMMs, or both (the band; the larger peak is reported).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "devices",
        None,
        "With --target: plan for this many target GPUs (8 GPUs per host, e.g. 8 or 16); the config's mesh "
        "must use them all. See docs/mesh.md.",
        lower_bound=1,
        flag_values=fv,
    )
    define_cost_flags(fv)
    define_calibrate_flag(fv)
    flags.DEFINE_bool(
        "quiet", False, "No progress bar and no summary; the result path is still printed.", flag_values=fv
    )
    flags.DEFINE_bool(
        "show_config",
        False,
        "Print every config field (after the preset and --config.* overrides) with its value and its "
        "description from jaxscale/config/defaults.py, then exit without compiling.",
        flag_values=fv,
    )
    define_cache_flag(fv)
    hosts.define_flags(fv)
    return fv


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
        "tokens_per_step": config.data.batch_size * config.data.seq_len,
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


def _evaluation(config: ml_collections.ConfigDict, placement: sharding.Placement):
    """params -> validation loss on the fixed held-out batches, or None when train.eval_every is 0.

    On a mesh the batches are split like the training batch and the model is traced with the mesh's rules.
    """
    if not config.train.eval_every:
        return None
    batches = data.validation_batches(config, placement)
    eval_step = evaluate.make_eval_step(config)

    def evaluation(params):
        with placement.activate():
            return evaluate.evaluate(eval_step, params, batches)

    return evaluation


def _steps(config, loop: train_loop.TrainLoop, run_dir: pathlib.Path, row: dict, bar: tqdm) -> None:
    """Warm-up, timed and profiled steps from wherever the loop starts (0, or a checkpoint's step)."""
    trained = config.train.warmup_steps + config.train.steps
    row.setdefault("loss_first", None)  # stays None when resumed after step 1
    while loop.steps_done < trained:
        record = loop.step()
        if record.step == 1:
            row["loss_first"] = record.loss
        bar.update()
        bar.set_postfix(loss=f"{record.loss:.3f}")
    remaining = trained + config.profile.steps - loop.steps_done
    if config.profile.steps > 0 and remaining > 0:
        first = loop.steps_done
        row["trace_files"] = profiling.capture(run_dir, remaining, lambda: loop.step().loss, first_step=first)
        row["trace_dir"] = str(run_dir)
        bar.update(remaining)
    if loop.evaluation is not None and (not loop.validation or loop.validation[-1][0] != loop.steps_done):
        loop.evaluate()  # and at the end


def execute(config, compiled, placement: sharding.Placement, run_dir: pathlib.Path, row: dict, progress: bool) -> None:
    """Warm-up, timed and profiled steps, resumed from the last checkpoint if there is one; fills `row` in place.

    Raises RunError on a non-finite loss.
    """
    evaluation = _evaluation(config, placement)
    first, state, data_state, checkpoints = 0, None, None, None
    with contextlib.ExitStack() as cleanup:  # closed in reverse, also on errors and Ctrl-C
        if config.train.checkpoint_every:
            from jaxscale.train.checkpoint import Checkpoints  # orbax is imported only by runs that checkpoint

            checkpoints = Checkpoints(run_dir / "checkpoints", config)
            cleanup.callback(_close_checkpoints, checkpoints, row, run_dir / "checkpoints")
            if checkpoints.latest_step() is not None:  # meta checked first, then read into the abstract state
                first, state, data_state = checkpoints.restore(placement.abstract_inputs()[0])
        if state is None:  # a fresh run: the only state ever initialised
            state = placement.init_state()
            if config.finetune.init_from:  # the base parameters of another run's checkpoint
                from jaxscale.train.checkpoint import with_base_params

                state = with_base_params(state, config)
        row["resumed_from_step"] = first or None
        row.update(data.data_columns(config))
        source = data.make_source(config, placement, state=data_state)
        cleanup.callback(source.close)
        scalars = ScalarWriter(run_dir)
        cleanup.callback(scalars.close)
        loop = train_loop.TrainLoop(compiled, state, placement.init_metrics(), source, scalars, evaluation,
                                    config.train.eval_every, checkpoints, first_step=first)  # fmt: skip
        cleanup.callback(lambda: row.update(loop.columns(config, row["tokens_per_step"])))
        if config.finetune.init_from and not first and evaluation is not None and config.train.eval_every:
            loop.evaluate()  # the loaded model on this data, before fine-tuning moves it (validation step 0)
        total = config.train.warmup_steps + config.train.steps + config.profile.steps
        bar = tqdm(total=total, initial=first, desc=row["name"], unit="step", disable=not progress, file=sys.stderr)
        cleanup.callback(bar.close)
        try:
            _steps(config, loop, run_dir, row, bar)
        except FloatingPointError as error:
            raise RunError("nan", str(error)) from None


def check_resume(config: ml_collections.ConfigDict, run_dir: pathlib.Path) -> None:
    """The newest checkpoint in run_dir, if any, against this run's config and data (its meta alone is read).

    Raises:
      UsageError: one line naming the field the checkpoint was written with otherwise; nothing is written.
    """
    from jaxscale.train import checkpoint  # orbax is imported only by runs that checkpoint

    try:
        checkpoint.check_resume(run_dir / "checkpoints", config)
    except checkpoint.CheckpointError as error:
        raise UsageError(str(error)) from None


def check_init_from(config: ml_collections.ConfigDict) -> None:
    """finetune.init_from's newest checkpoint against this model (its meta alone is read).

    Raises:
      UsageError: one line naming the field at fault; nothing is written.
    """
    from jaxscale.train import checkpoint  # orbax is imported only by runs that checkpoint

    try:
        checkpoint.check_init_from(config)
    except checkpoint.CheckpointError as error:
        raise UsageError(str(error)) from None


def _close_checkpoints(checkpoints, row: dict, directory: pathlib.Path) -> None:
    """Waits for the writes; the row names the checkpoints as the run's directory does (relative where it is)."""
    checkpoints.close()
    row["checkpoint_dir"], row["checkpoint_steps"] = str(directory), checkpoints.saved_steps
    row["checkpoint_save_s_total"] = checkpoints.save_s


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
            " ".join(f"{type(error).__name__}: {error}".split())[:500],
        )
    if plan_only:  # nothing ran: the allocator's peak would be of an idle device, not of this step
        row["device_peak_bytes"], row["device_peak_note"] = None, "plan only: no step ran on the device"
    else:
        local = placement.local_devices if placement is not None else None
        row["device_peak_bytes"], row["device_peak_note"] = memory.device_peak_bytes(local)
    row["host_peak_rss_bytes"] = memory.host_peak_rss_bytes()
    row["plan_only"] = plan_only
    return row


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def _cache_text(row: dict) -> str:
    if row.get("compile_cache_hit"):
        return f" (from the compilation cache; it saved {row['compile_cache_saved_s']:.1f} s)"
    return "" if row.get("compile_cache_hit") is None else " (compiled: not in the compilation cache)"


def summary(row: dict) -> str:
    """A short human-readable account of a result row."""
    lines = [f"run {row['name']}: {row['status']}" + (f" ({row['error']})" if row["error"] else "")]
    if row.get("params") is not None:
        lines.append(
            f"  params {row['params']:,}   tokens/step {row['tokens_per_step']:,}   compile {row['compile_s']:.1f} s"
            + _cache_text(row)
        )
        lines += [line for line in [finetune.summary_line(row)] if line]  # what trains (and what is frozen)
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


def write_row(path: pathlib.Path, row: dict) -> None:
    """Writes the row as JSON atomically (temp file + rename), so a crash leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(row, indent=1, default=str) + "\n")
    tmp.replace(path)


def _estimate_message(config: ml_collections.ConfigDict, backend: str | None = None) -> str | None:
    backend = backend or jax.default_backend()
    steps = config.train.warmup_steps + config.train.steps + config.profile.steps
    flops_per_step = flops.model_flops_per_step(config)
    seconds = steps * flops_per_step / _ASSUMED_FLOPS_FOR_ESTIMATE.get(backend, 5e10)
    if seconds < _LONG_RUN_S:
        return None
    return (
        f"estimate: this run may take about {seconds / 60:.0f} min ({steps} steps x "
        f"{flops_per_step / 1e12:.2f} TFLOP, assuming ~{_ASSUMED_FLOPS_FOR_ESTIMATE.get(backend, 5e10) / 1e12:g} "
        f"TFLOP/s on {backend}); use a smaller preset (:cpu or :tiny) or --plan to compile only"
    )


def _resolve_run_dir(fv: flags.FlagValues, config: ml_collections.ConfigDict) -> tuple[str, pathlib.Path]:
    if fv.run_dir:
        run_dir = pathlib.Path(fv.run_dir)
        name = fv.name or run_dir.name
    else:
        stamp = datetime.datetime.fromtimestamp(hosts.shared_time()).strftime("%Y%m%d-%H%M%S")
        plan = ("_plan" if fv.plan else "") + (f"-{pathlib.Path(fv.target).stem}" if fv.target else "")
        plan += f"-x{fv.devices}" if fv.target and fv.devices else ""
        name = fv.name or f"{config.name}_{config.preset}{plan}_{stamp}"
        run_dir = pathlib.Path(fv.output_root) / "traces" / name
    if (run_dir / "result.json").exists() and hosts.is_main_process():  # process 0 writes it
        raise UsageError(f"--name: {run_dir} already holds a result; choose another --name (runs never overwrite)")
    return name, run_dir


def check_devices(config: ml_collections.ConfigDict, target: str | None, devices: int | None) -> None:
    """The mesh against the devices it runs on: this run's (all processes') or --devices of a target.

    Raises:
      UsageError: one line naming mesh or --devices and what would work (a 1x1x1 mesh with --devices N > 1
        included: it would plan one of the N GPUs).
    """
    if target is not None or devices is not None:
        try:
            gpu_plan.check_devices_flag(config, target, devices)
        except gpu_plan.PlanFlagError as error:
            raise UsageError(str(error)) from None
        return
    count, platform = jax.device_count(), jax.default_backend()
    hint = f"; simulate CPU devices with --host_devices={mesh_shape(config).devices}" if platform == "cpu" else ""
    try:
        check_mesh_devices(config, count, f"this run ({platform})", hint)
    except ConfigError as error:
        raise UsageError(str(error)) from None


def calibration_flag(run_dir: str | None, target: str | None) -> calibrate.Calibration | None:
    """The calibration --calibrate names (None without it), fitted for this machine's device.

    Raises:
      UsageError: one line naming --calibrate: with --target (a calibration holds for this device only), or a
        run that cannot calibrate (jaxscale.plan.calibrate.CalibrationError).
    """
    if run_dir is None:
        return None
    if target is not None:
        raise UsageError(f"--calibrate: fits the predictor of this machine's device; --target {target} plans "
                         "another GPU, whose prediction stays uncalibrated: drop one of the two")  # fmt: skip
    try:
        return calibrate.calibration(run_dir)
    except calibrate.CalibrationError as error:
        raise UsageError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one run; exit 0 (ok), 1 (the run failed: its row says why) or 2 (bad input)."""
    argv = list(sys.argv if argv is None else argv)
    fv = _flag_values(argv)
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        early = hosts.parse_early(argv)
        hosts.configure(early)  # simulated devices: before anything starts JAX's backends
        if hosts.wants_distributed(early) and ":" not in (config_path(argv, "config") or ":"):
            raise UsageError("--config: name the preset (e.g. configs/bf16_remat.py:seed) in a multi-process run; "
                             "picking one by backend would start JAX before jax.distributed")  # fmt: skip
        config = parse_config_flags(fv, argv)
        if fv.show_config:
            print(describe(config))
            return 0
        compile_cache.set_enabled(fv.compilation_cache)
        gpu_plan.check_target_flag(fv.target, fv.plan, fv.gemm, config.model.attention)
        if fv.plan and config.finetune.init_from:  # a plan loads no weights: its program is the same without them
            raise UsageError(f"finetune.init_from: {config.finetune.init_from!r} cannot be loaded with --plan, which "
                             "compiles the step and loads no weights (the plan is the same without them); drop "
                             "--plan or finetune.init_from")  # fmt: skip
        check_cost_flags(fv)
    except (UsageError, gpu_plan.PlanFlagError) as error:  # bad input ends this process before it joins the others
        return fail(str(error))
    try:
        hosts.initialize(early)
    except (RuntimeError, ValueError) as error:  # e.g. no cluster found to take the process count from
        return fail(f"jax.distributed.initialize: {error}", code=1)
    try:
        check_devices(config, fv.target, fv.devices)
        name, run_dir = _resolve_run_dir(fv, config)
        budget = None if fv.device_memory is None else parse_bytes(fv.device_memory, "--device_memory")
        if config.data.source == "text" and not fv.plan:
            data.check(config)  # token files against the config, before anything is written
        if config.train.checkpoint_every and not fv.plan:
            check_resume(config, hosts.process_dir(run_dir))  # a checkpoint's meta, before anything is written
        if config.finetune.init_from and not fv.plan:
            check_init_from(config)
        calibration = calibration_flag(fv.calibrate, fv.target)
    except (UsageError, data.DataError) as error:
        return fail(str(error))
    if config.preset_source != "given":
        print(
            f"jaxscale: no preset given, so using '{config.preset}' ({config.preset_source}); "
            "add :seed, :cpu or :tiny to the config path to choose"
        )
    estimate = None if fv.plan else _estimate_message(config)
    if estimate:
        print(f"jaxscale: {estimate}")
    compile_cache.configure()
    main_process = hosts.is_main_process()
    row = run(
        config,
        hosts.process_dir(run_dir),  # every process keeps its own trace
        name,
        plan_only=fv.plan,
        progress=not fv.quiet and main_process,
        device_memory_bytes=budget,
        target=fv.target,
        gemm=fv.gemm,
        devices=fv.devices,
        calibration=calibration,
    )
    if not main_process:  # process 0 writes the one result row of a multi-process run
        return 0 if row["status"] == "ok" else 1
    row.update(cost.cost_columns(row, fv.train_tokens, fv.gpu_hour_usd))
    result_path = run_dir / "result.json"
    write_row(result_path, row)
    if not fv.quiet:
        print(summary(row))
    print(f"result: {result_path}")
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

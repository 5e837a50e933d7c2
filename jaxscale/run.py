"""One measured run: `python -m jaxscale.run --config configs/bf16_remat.py[:preset] [--plan]`.

compile (ahead of time, timed) -> warm-up -> timed steps -> profiled steps -> result row (JSON).
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jaxscale import train  # noqa: E402
from jaxscale.cli import UsageError, define_config_flag, fail, parse_bytes, parse_config_flags
from jaxscale.config import flatten  # noqa: E402
from jaxscale.measure import columns, flops, memory, params, profiling, timing  # noqa: E402
from jaxscale.model import count_params  # noqa: E402
from jaxscale.plan import gpu_plan, targets  # noqa: E402

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
    flags.DEFINE_bool(
        "quiet", False, "No progress bar and no summary; the result path is still printed.", flag_values=fv
    )
    return fv


def base_row(config: ml_collections.ConfigDict, name: str, run_dir: pathlib.Path) -> dict:
    """The identifying part of a result row: what ran, where, with what."""
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
        "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "tokens_per_step": config.data.batch_size * config.data.seq_len,
        "analytic_model_flops_per_step": flops.model_flops_per_step(config),
        "shape_warnings": params.shape_warnings(config.model),
        "run_dir": str(run_dir),
        "trace_dir": None,
    }


def compile_step(config: ml_collections.ConfigDict):
    """Lowers and compiles the train step for abstract inputs.

    Returns:
      (compiled, init_fn, abstract train state, lower + compile seconds).
    """
    init_fn = train.make_init_fn(config)
    abstract_state, abstract_metrics, abstract_batch = train.abstract_inputs(config, init_fn)
    start = time.perf_counter()
    compiled = train.make_train_step(config).lower(abstract_state, abstract_metrics, abstract_batch).compile()
    return compiled, init_fn, abstract_state, time.perf_counter() - start


def _read_metrics(metrics: train.Metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _step_stats(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(mean loss, accuracy) of the steps between two snapshots of the running sums."""
    tokens = after["tokens"] - before["tokens"]
    return (after["loss_sum"] - before["loss_sum"]) / tokens, (after["correct"] - before["correct"]) / tokens


def execute(config, compiled, init_fn, run_dir: pathlib.Path, row: dict, progress: bool) -> None:
    """Warm-up, timed and profiled steps; fills `row` in place. Raises RunError on a non-finite loss."""
    state = jax.jit(init_fn)()
    metrics = train.init_metrics()
    batch = train.make_batch(
        jax.random.PRNGKey(config.data.seed), config.data.batch_size, config.data.seq_len, config.model.vocab_size
    )
    total = config.train.warmup_steps + config.train.steps + config.profile.steps
    bar = tqdm(total=total, desc=row["name"], unit="step", disable=not progress, file=sys.stderr)
    seconds, previous = [], _read_metrics(metrics)
    for i in range(config.train.warmup_steps + config.train.steps):
        (state, metrics), elapsed = timing.time_call(compiled, state, metrics, batch)
        current = _read_metrics(metrics)  # after the timer: a few bytes, the step already finished
        loss, accuracy = _step_stats(previous, current)
        if i == 0:
            row["loss_first"] = loss
        if not math.isfinite(loss):
            raise RunError("nan", f"loss became {loss} at step {i}; lower optimizer.learning_rate or use float32")
        if i >= config.train.warmup_steps:
            seconds.append(elapsed)
        previous = current
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")
    row.update(timing.summarize(seconds))
    row["step_s_all"] = seconds
    row["tokens_per_s"] = row["tokens_per_step"] / row["step_s_median"]
    row["loss"], row["accuracy"] = loss, accuracy
    if config.profile.steps > 0:
        holder = {"state": state, "metrics": metrics}

        def step():
            holder["state"], holder["metrics"] = compiled(holder["state"], holder["metrics"], batch)
            return holder["metrics"]

        files = profiling.capture(run_dir, config.profile.steps, step, first_step=i + 1)
        bar.update(config.profile.steps)
        row["trace_dir"] = str(run_dir)
        row["trace_files"] = files
        final = _read_metrics(holder["metrics"])
        if not math.isfinite(final["loss_sum"]):
            raise RunError("nan", "loss became non-finite during the profiled steps")
    bar.close()


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
) -> dict:
    """Compiles, runs and measures one config; always returns a result row (status ok|oom|error|nan).

    A `device_memory_bytes` budget stands in for a smaller accelerator: a step whose compiled plan exceeds it
    is recorded as `oom` without running its steps. With `target` (plan only) the compiled_* columns are XLA's
    plan for that GPU (jaxscale.gpu_plan, GEMM modes `gemm`), and the budget is checked against that plan.
    """
    if target is not None and not plan_only:
        raise ValueError("run: a target GPU can only be planned (plan_only=True)")
    row = base_row(config, name, run_dir)
    row["device_memory_budget_bytes"] = device_memory_bytes
    try:
        if target is not None:
            row.update(gpu_plan.plan_for_target(config, target, gemm=gemm))
        else:
            compiled, init_fn, abstract_state, row["compile_s"] = compile_step(config)
            row["params"] = count_params(abstract_state.params)
            row.update(memory.compiled_memory(compiled))
            row["compiled_backend"] = jax.default_backend()
        row.update(columns.after_compile(config, None if target else compiled, row))
        check_memory_budget(row, device_memory_bytes)
        if not plan_only:
            execute(config, compiled, init_fn, run_dir, row, progress)
            row.update(columns.after_run(config, compiled, row))
        row["status"] = "ok"
    except RunError as error:
        row["status"], row["error"] = error.status, str(error)
    except Exception as error:  # a failed variant is a row, not a crash (XLA raises many types)
        row["status"], row["error"] = (
            classify_failure(str(error)),
            " ".join(f"{type(error).__name__}: {error}".split())[:500],
        )
    row["device_peak_bytes"], row["device_peak_note"] = memory.device_peak_bytes()
    row["host_peak_rss_bytes"] = memory.host_peak_rss_bytes()
    row["plan_only"] = plan_only
    return row


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def summary(row: dict) -> str:
    """A short human-readable account of a result row."""
    lines = [f"run {row['name']}: {row['status']}" + (f" ({row['error']})" if row["error"] else "")]
    if row.get("params") is not None:
        lines.append(
            f"  params {row['params']:,}   tokens/step {row['tokens_per_step']:,}   compile {row['compile_s']:.1f} s"
        )
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
        lines.append(f"  loss {row['loss']:.4f} (first step {row['loss_first']:.4f})   accuracy {row['accuracy']:.4f}")
    lines += columns.summary_lines(row)
    lines += [f"  shape warning: {warning}" for warning in row.get("shape_warnings") or ()]
    device = _gib(row["device_peak_bytes"]) if row["device_peak_bytes"] is not None else row["device_peak_note"]
    lines.append(f"  device peak: {device}   host peak RSS: {_gib(row['host_peak_rss_bytes'])}")
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
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        plan = ("_plan" if fv.plan else "") + (f"-{pathlib.Path(fv.target).stem}" if fv.target else "")
        name = fv.name or f"{config.name}_{config.preset}{plan}_{stamp}"
        run_dir = pathlib.Path(fv.output_root) / "traces" / name
    if (run_dir / "result.json").exists():
        raise UsageError(f"--name: {run_dir} already holds a result; choose another --name (runs never overwrite)")
    return name, run_dir


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    fv = _flag_values(argv)
    try:
        config = parse_config_flags(fv, argv)
        gpu_plan.check_target_flag(fv.target, fv.plan, fv.gemm)
        name, run_dir = _resolve_run_dir(fv, config)
        budget = None if fv.device_memory is None else parse_bytes(fv.device_memory, "--device_memory")
    except UsageError as error:
        return fail(str(error))
    if config.preset_source != "given":
        print(
            f"jaxscale: no preset given, so using '{config.preset}' ({config.preset_source}); "
            "add :seed, :cpu or :tiny to the config path to choose"
        )
    estimate = None if fv.plan else _estimate_message(config)
    if estimate:
        print(f"jaxscale: {estimate}")
    row = run(
        config,
        run_dir,
        name,
        plan_only=fv.plan,
        progress=not fv.quiet,
        device_memory_bytes=budget,
        target=fv.target,
        gemm=fv.gemm,
    )
    result_path = run_dir / "result.json"
    write_row(result_path, row)
    if not fv.quiet:
        print(summary(row))
    print(f"result: {result_path}")
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

"""One measured run: `python -m jaxscale.run --config configs/bf16_remat.py[:preset] [--plan]`.

compile (ahead of time, timed) -> warm-up -> timed steps -> profiled steps -> result row (JSON).
"""

from __future__ import annotations

import datetime
import pathlib
import sys
from collections.abc import Sequence

import jax
import ml_collections
from absl import flags

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
from jaxscale.config import describe
from jaxscale.measure import flops
from jaxscale.plan import cost, gpu_plan, targets
from jaxscale.run_checks import calibration_flag, check_devices, check_init_from, check_resume
from jaxscale.run_row import (
    base_row,
    check_memory_budget,
    classify_failure,
    compile_step,
    local_prediction,
    run,
    write_row,
)
from jaxscale.run_steps import RunError, execute
from jaxscale.run_summary import summary

# The run's parts, importable from here as before they had modules of their own (the sweep, the fit, the tests).
__all__ = ["USAGE", "RunError", "base_row", "calibration_flag", "check_devices", "check_init_from",
           "check_memory_budget", "check_resume", "classify_failure", "compile_step", "execute", "local_prediction",
           "main", "run", "summary", "write_row"]  # fmt: skip


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
        gpu_plan.check_flash_blocks(config, fv.target)
        gpu_plan.check_fp8(config, fv.target)
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

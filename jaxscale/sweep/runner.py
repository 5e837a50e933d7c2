"""Sweeps: `python -m jaxscale.sweep --config experiments/seed_table.py:cpu`, each variant in a fresh process.

The sweep file (see `jaxscale.sweep_file`) gives the base config, named variants and a baseline. Each variant
runs as `python -m jaxscale.run --config <sweep file>:<preset> --config.<field>=<value> ...` in its own
process, so its peak memory is its own and a crash ends only it. Rows go to
<output_root>/experiments/results/<sweep>/results.jsonl, traces to <output_root>/traces/<sweep>/.
`--plan [--target a5000]` compiles only (for that GPU, no GPU needed; see docs/gpu_planning.md), and the
sweep's name says so (seed_table_seed_plan_a5000), so a plan's rows never mix with a run's; `--devices 8`
plans the variants' meshes on 8 target GPUs (seed_table_seed_plan_a5000_x8; a 1x1x1 variant is planned on one
GPU, its row says so). `--calibrate RUN_DIR` calibrates every variant's prediction on a run measured here
(jaxscale.plan.calibrate; the sweep is named <sweep>_calibrated_<run>). `--host_devices N` and the
multi-process flags (jaxscale.hosts) are passed to every variant's run; with several processes only process 0
records rows (docs/mesh.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys
from collections.abc import Sequence

import pandas as pd
from absl import flags
from tqdm import tqdm

from jaxscale import compile_cache, hosts
from jaxscale.cli import (
    Usage,
    UsageError,
    define_cache_flag,
    define_calibrate_flag,
    fail,
    parse_bytes,
    parse_flags,
    print_help,
    wants_help,
)
from jaxscale.config import describe, flatten, mesh_shape
from jaxscale.plan import calibrate, gpu_plan, targets
from jaxscale.run import write_row
from jaxscale.sweep import variant_process
from jaxscale.sweep.results import ResultsFile, format_table, load_results, read_rows
from jaxscale.sweep.sweep_file import Sweep, Variant, cli_value, expand_grid, load_sweep, plan_suffix, select_variants

__all__ = [
    "Sweep", "SweepOutcome", "Variant", "expand_grid", "load_results", "load_sweep", "run_sweep", "select_variants",
]  # fmt: skip

# Run flags the sweep sets itself; anything else may be passed through run_args.
_RESERVED_RUN_FLAGS = ("--config", "--name", "--run_dir", "--output_root", "--quiet")
# Run flags that are the sweep's own flags (they name the sweep, so they may not come through run_args).
_SWEEP_RUN_FLAGS = ("--plan", "--noplan", "--target", "--gemm", "--device_memory", "--device-memory", "--devices",
                    "--calibrate", *(f"--{name}" for name in hosts.FLAG_NAMES))  # fmt: skip
DEFAULT_TIMEOUT_S = 1800.0

USAGE = Usage(
    command="python -m jaxscale.sweep --config SWEEP.py:PRESET [flags]",
    summary="Runs every variant of a sweep file, each in its own `python -m jaxscale.run` process, into one "
    "results table (resumable: finished variants are skipped); --plan [--target GPU] compiles only.",
    examples=(
        "python -m jaxscale.sweep --config experiments/seed_table.py:cpu",
        "python -m jaxscale.sweep --config experiments/seed_table.py:cpu --only 'bf16_*' --rerun",
        "python -m jaxscale.sweep --config experiments/seed_table.py:seed --plan --target a5000",
        "python -m jaxscale.sweep --config experiments/seed_table.py:seed --on_this_device   # on a GPU",
        "python -m jaxscale.sweep --config experiments/seed_table.py:cpu --calibrate traces/seed_table_cpu/bf16_scan",
        "python -m jaxscale.sweep --config experiments/seed_table.py:cpu --show_config",
    ),
    notes=(
        "A sweep file (experiments/*.py; see experiments/README.md and docs/sweep.md) gives get_config(preset), "
        "get_variants(config) (named variants as dotted config overrides) and BASELINE. Rows go to "
        "<output_root>/experiments/results/<sweep>/results.jsonl (and .csv), traces to <output_root>/traces/<sweep>/.",
        "Config fields: every field, with what it means, is in jaxscale/config/defaults.py (base_config). "
        "A sweep changes fields in its variants, not on the command line; --show_config lists the sweep's base "
        "config at the preset (values and descriptions) and each variant's overrides.",
    ),
)


@dataclasses.dataclass(frozen=True)
class SweepOutcome:
    """What run_sweep leaves: where the rows are, and which variants this call selected."""

    sweep: Sweep
    results_path: pathlib.Path
    selected: tuple[str, ...]

    def frame(self) -> pd.DataFrame:
        """All of the sweep's rows (see results.load_results)."""
        return load_results(self.results_path)

    def failed(self) -> list[str]:
        """Selected variants whose row is not `ok` (or that have no row)."""
        status = {r.get("variant"): r.get("status") for r in read_rows(self.results_path)}
        return [name for name in self.selected if status.get(name) != "ok"]

    def table(self) -> str:
        return format_table(read_rows(self.results_path), order=self.sweep.variant_names)


def _run_args(
    run_args: Sequence[str],
    device_memory: int | str | None,
    plan: bool,
    target: str | None,
    gemm: str,
    devices: int | None = None,
    host_args: Sequence[str] = (),
    calibrate_dir: str | None = None,
) -> list[str]:
    """The run flags of every variant: the sweep's own (--plan, --target, --gemm, --devices, --device_memory,
    --calibrate, then the jaxscale.hosts flags), then run_args."""
    for arg in run_args:
        flag = arg.split("=", 1)[0].split(".", 1)[0]
        if flag in _RESERVED_RUN_FLAGS:
            hint = "; config changes belong in the sweep's variants" if arg.startswith("--config") else ""
            raise UsageError(f"--run_arg: {arg!r} is set by the sweep{hint}")
        if flag in _SWEEP_RUN_FLAGS:
            raise UsageError(f"--run_arg: {arg!r}: use the sweep's own {flag.replace('--no', '--')} flag")
    try:
        gpu_plan.check_target_flag(target, plan, gemm)
    except gpu_plan.PlanFlagError as error:
        raise UsageError(str(error)) from None
    if devices is not None and target is None:
        raise UsageError(f"--devices {devices}: sets how many target GPUs to plan for; add --plan --target")
    args = ["--plan"] if plan else []
    if target is not None:
        args.append(f"--target={target}")
    if gemm != "both":
        args.append(f"--gemm={gemm}")
    if devices is not None:
        args.append(f"--devices={devices}")
    if device_memory is not None:
        budget = device_memory if isinstance(device_memory, int) else parse_bytes(device_memory, "--device-memory")
        args.append(f"--device_memory={budget}")
    if calibrate_dir is not None:
        args.append(f"--calibrate={calibrate_dir}")
    return [*args, *host_args, *run_args]


def calibration_dir(run_dir: str | os.PathLike, target: str | None) -> str:
    """A --calibrate run's directory, as given (the variants run in this directory), after the checks this process
    can make without the device (each variant's run checks the device, jaxscale.plan.calibrate.check_device).

    Raises:
      UsageError: one line naming --calibrate: with --target, or a run that cannot calibrate (calibrate.read_run).
    """
    if target is not None:
        raise UsageError(f"--calibrate: fits the predictor of this machine's device; --target {target} plans "
                         "another GPU, whose prediction stays uncalibrated: drop one of the two")  # fmt: skip
    try:
        calibrate.read_run(run_dir)
    except calibrate.CalibrationError as error:
        raise UsageError(str(error)) from None
    return str(run_dir)


def _is_current(row: dict | None, variant: Variant, run_args: list[str]) -> bool:
    """Whether a recorded row was made from this variant's config and run options (so resume may skip it)."""
    if row is None:
        return False
    config = json.loads(json.dumps(flatten(variant.config)))
    return all(row.get(k) == v for k, v in config.items()) and row.get("run_args", []) == run_args


def _on_device(row: dict, target: str | None) -> bool:
    """Whether a row's step is for `target` (a targets-table name): planned for it, or run on that GPU."""
    if target is None:
        return False
    return row.get("plan_target") == target or row.get("device_kind") == targets.TARGETS[target].device_kind


def _process_id(run_args: Sequence[str]) -> int | None:
    """The --process_id among a variant's run flags (a multi-process sweep), else None."""
    found = [arg.split("=", 1)[1] for arg in run_args if arg.startswith("--process_id=")]
    return int(found[-1]) if found else None


def _one_gpu_args(variant: Variant, run_args: list[str]) -> tuple[list[str], str | None]:
    """(the run flags of one variant, a note): a sweep's --devices N plans the variants whose mesh uses the N
    GPUs; a 1x1x1 variant (the usual baseline) is planned on one GPU without --devices (the run refuses N GPUs
    that its mesh would leave idle), and its row's `plan_devices_note` says so."""
    given = [arg for arg in run_args if arg.startswith("--devices=")]
    if not given or mesh_shape(variant.config).devices > 1:
        return run_args, None
    count = given[-1].split("=", 1)[1]
    note = f"planned on one GPU: the mesh is 1x1x1 (the sweep's --devices {count} plans the meshes that use them)"
    return [arg for arg in run_args if not arg.startswith("--devices=")], note


def run_variant(
    sweep: Sweep, variant: Variant, output_root: pathlib.Path, run_args: list[str], timeout_s: float | None
) -> dict | None:
    """Runs one variant in a fresh `python -m jaxscale.run` process; returns its row (None on process i > 0 of
    a multi-process sweep, whose run writes only its trace, in <run dir>/process_<i>)."""
    run_dir = output_root / "traces" / sweep.name / variant.name
    process = _process_id(run_args)
    if process is None and run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished or replaced attempt: its run refuses to overwrite a result
    elif process == 0:  # other processes may be writing their traces inside it
        (run_dir / "result.json").unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    variant_args, devices_note = _one_gpu_args(variant, run_args)
    command = [
        "-m", "jaxscale.run", f"--config={sweep.path}:{sweep.preset}",
        *(f"--config.{field}={cli_value(value, field)}" for field, value in variant.overrides.items()),
        f"--config.name={variant.name}", f"--run_dir={run_dir}", "--quiet", *variant_args,
    ]  # fmt: skip
    log = run_dir / ("run.log" if not process else f"run_process_{process}.log")
    finished = variant_process.launch(command, log, timeout_s)
    if process:
        return None
    result_path = run_dir / "result.json"
    if result_path.exists():
        row = json.loads(result_path.read_text())
    else:
        status, error = variant_process.failure(finished, timeout_s)
        row = {"name": variant.name, "status": status, "error": error, **flatten(variant.config)}
        row.update(run_dir=str(run_dir), trace_dir=None)
    if variant.name in sweep.notebook_peak_bytes:
        notebook = row["notebook_peak_bytes"] = sweep.notebook_peak_bytes[variant.name]
        peak = row.get("compiled_peak_bytes")
        row["planned_over_notebook"] = None if peak is None else peak / notebook
    if variant.name in sweep.notebook_step_s and _on_device(row, sweep.notebook_device):
        notebook = row["notebook_step_s"] = sweep.notebook_step_s[variant.name]
        predicted = row.get("predicted_step_s")
        row["predicted_over_notebook"] = None if predicted is None else predicted / notebook
    if devices_note is not None:
        row["plan_devices_note"] = devices_note
    row.update(
        sweep=sweep.name,
        variant=variant.name,
        baseline=sweep.baseline,
        variant_overrides=", ".join(f"{k}={cli_value(v, k)}" for k, v in variant.overrides.items()),
        run_args=run_args,
        process_exit_code=finished.returncode,
        process_wall_s=finished.wall_s,
        log_file=str(run_dir / "run.log"),
    )
    write_row(result_path, row)
    return row


def device_suffix(plan: bool) -> str:
    """ "_<device slug>" of the accelerator this machine's variants run on (h100, a5000, h100-pcie, ...).

    The device kind is read in a short child process (variant_process.device_kind_in_child): this process
    never opens the accelerator, whose memory the variants' processes need.

    Raises:
      UsageError: with --plan (a plan does not run on this device), or the machine has no accelerator.
    """
    if plan:
        raise UsageError("--on_this_device: names a sweep whose variants run here; a --plan compiles only "
                         "(use --target to plan for a GPU)")  # fmt: skip
    try:
        kind = variant_process.device_kind_in_child()
    except RuntimeError as error:
        raise UsageError(f"--on_this_device: {error}") from None
    if kind.strip().lower() == "cpu":
        raise UsageError("--on_this_device: JAX finds no accelerator here (its device is the CPU); the flag names "
                         "a sweep after the GPU or TPU its variants run on")  # fmt: skip
    return f"_{targets.device_slug(kind)}"


def _for_process_0(run_args: list[str]) -> list[str]:
    """The run flags process 0 of the same sweep records in its rows (only --process_id differs)."""
    return [("--process_id=0" if arg.startswith("--process_id=") else arg) for arg in run_args]


def _one_line(row: dict) -> str:
    text = f"{row['variant']}: {row['status']}"
    text += " (1x1x1: planned on one GPU)" if row.get("plan_devices_note") else ""
    if row.get("step_s_median") is not None:
        text += f", {row['step_s_median']:.4f} s/step median"
    return text + (f" ({row['error']})" if row.get("error") else "")


def run_sweep(
    config: str | os.PathLike,
    preset: str | None = None,
    *,
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    rerun: bool = False,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    device_memory: int | str | None = None,
    plan: bool = False,
    target: str | None = None,
    gemm: str = "both",
    devices: int | None = None,
    host_args: Sequence[str] = (),
    output_root: str | os.PathLike = ".",
    name: str | None = None,
    run_args: Sequence[str] = (),
    progress: bool = True,
    on_this_device: bool = False,
    calibrate_on: str | os.PathLike | None = None,
) -> SweepOutcome:
    """Runs a sweep's variants that have no current row yet, each in its own process, recording each row.

    Args:
      config: sweep file, optionally with ":preset" (experiments/seed_table.py:cpu).
      preset: the preset if not given after the colon.
      only, skip: variant names or shell patterns to keep / drop.
      rerun: run the selected variants even where a current row exists (it is replaced).
      timeout_s: per-variant wall-clock limit in seconds (None: none); a variant past it becomes a
        `timeout` row.
      device_memory: memory budget (bytes, or text such as "24GiB"); a variant whose compiled plan exceeds
        it becomes an `oom` row without running its steps (with `target`, the target's plan is compared).
      plan: compile only (`jaxscale.run --plan`); the default name gets "_plan".
      target: with plan, plan for this GPU (a name in jaxscale.targets or a .txtpb); the name gets "_<target>".
      gemm: with target, "both" GEMM modes (the band), or only "triton" or "cublas" (the name gets it).
      devices: with target, plan each variant's mesh on this many target GPUs (the name gets "_x<devices>").
      host_args: jaxscale.hosts flags for every run (--host_devices=8, the multi-process flags); a sweep
        that is process i > 0 of a multi-process run records nothing (process 0 records every row).
      output_root: root of experiments/results/<sweep>/ and traces/<sweep>/<variant>/.
      name: sweep name (default <file stem>_<preset>[_plan[_<target>[_<gemm>]]]).
      run_args: extra `python -m jaxscale.run` flags for every variant.
      progress: show a bar across variants and a line per finished variant.
      on_this_device: name the sweep after the accelerator its variants run on (default name
        <file stem>_<preset>_<device slug>, e.g. seed_table_seed_h100); see device_suffix.
      calibrate_on: a run measured on this device with a trace: every variant's prediction is calibrated on it
        (jaxscale.plan.calibrate); the default name gets "_calibrated_<its directory name>".

    Returns:
      SweepOutcome: the results path, the selected variants, and the table / DataFrame of all rows.
    """
    calibrate_dir = None if calibrate_on is None else calibration_dir(calibrate_on, target)
    run_args = _run_args(run_args, device_memory, plan, target, gemm, devices, host_args, calibrate_dir)
    suffix = plan_suffix(plan, target, gemm, devices) + (device_suffix(plan) if on_this_device else "")
    suffix += f"_calibrated_{pathlib.Path(calibrate_dir).name}" if calibrate_dir else ""
    sweep = load_sweep(config, preset, name, suffix)
    selected = select_variants(sweep.variant_names, only, skip)
    output_root = pathlib.Path(output_root)
    traces_dir = (output_root / "traces" / sweep.name).resolve()
    if calibrate_dir is not None and pathlib.Path(calibrate_dir).resolve().is_relative_to(traces_dir):
        raise UsageError(f"--calibrate: {calibrate_on} lies in this sweep's traces ({traces_dir}), which a rerun "
                         "replaces; calibrate on another sweep's run, or give --name")  # fmt: skip
    store = ResultsFile(output_root / "experiments" / "results" / sweep.name)
    if _process_id(run_args):  # process i > 0: the same variants as process 0 (read from its rows), no records
        recorded = {row.get("variant"): row for row in store.rows()}
        for variant in (v for v in sweep.variants if v.name in selected):
            if rerun or not _is_current(recorded.get(variant.name), variant, _for_process_0(run_args)):
                run_variant(sweep, variant, output_root, run_args, timeout_s)
        return SweepOutcome(sweep, store.path, tuple(selected))
    with store.locked():
        recorded = {row.get("variant"): row for row in store.rows()}
        chosen = [v for v in sweep.variants if v.name in selected]
        todo = [v for v in chosen if rerun or not _is_current(recorded.get(v.name), v, run_args)]
        if progress:
            stale = [v.name for v in todo if not rerun and v.name in recorded]
            print(f"sweep {sweep.name}: {len(sweep.variants)} variants (baseline {sweep.baseline}); "
                  f"{len(chosen)} selected, {len(chosen) - len(todo)} already finished (--rerun to redo), "
                  f"{len(todo)} to run -> {store.directory}")  # fmt: skip
            if stale:
                print(f"  rerunning {', '.join(stale)}: recorded with another config or other run options")
        bar = tqdm(total=len(todo), unit="variant", desc=sweep.name, disable=not (progress and todo), file=sys.stderr)
        for variant in todo:
            bar.set_postfix_str(variant.name)
            row = run_variant(sweep, variant, output_root, run_args, timeout_s)
            store.record(row)
            bar.update()
            if progress:
                bar.write(_one_line(row))
        bar.close()
        store.write_csv()
    return SweepOutcome(sweep, store.path, tuple(selected))


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("config", None, "Sweep file and preset: experiments/seed_table.py:cpu.", flag_values=fv)
    flags.DEFINE_list("only", [], "Run only these variants (comma-separated names or patterns).", flag_values=fv)
    flags.DEFINE_list("skip", [], "Skip these variants (comma-separated names or patterns).", flag_values=fv)
    flags.DEFINE_bool("rerun", False, "Run selected variants again even if they have a current row.", flag_values=fv)
    flags.DEFINE_bool("strict", False, "Exit 1 at the end if any selected variant is not ok.", flag_values=fv)
    flags.DEFINE_float("timeout", DEFAULT_TIMEOUT_S, "Per-variant limit in seconds (0: none).", flag_values=fv)
    flags.DEFINE_string(
        "device_memory", None, "Memory budget (24GiB): plans above it are oom rows, not run.", flag_values=fv
    )
    flags.DEFINE_alias("device-memory", "device_memory", flag_values=fv)
    flags.DEFINE_bool("plan", False, "Compile only: each variant's memory plan, no steps run.", flag_values=fv)
    flags.DEFINE_string(
        "target", None, f"With --plan: plan for this GPU, no GPU needed ({', '.join(targets.TARGETS)} or a "
        ".txtpb); the sweep name gets _plan_<target>. See docs/gpu_planning.md.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_enum(
        "gemm", "both", gpu_plan.GEMM_CHOICES, "With --target: Triton GEMMs, cuBLAS GEMMs or both (the band).",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "devices", None, "With --target: plan each variant's mesh on this many target GPUs; the name gets _x<N>.",
        lower_bound=1, flag_values=fv,
    )  # fmt: skip
    hosts.define_flags(fv)
    flags.DEFINE_string("output_root", ".", "Root of experiments/results/ and traces/.", flag_values=fv)
    flags.DEFINE_string("name", None, "Sweep name (default: <file stem>_<preset>).", flag_values=fv)
    flags.DEFINE_multi_string("run_arg", [], "Extra jaxscale.run flag for every run", flag_values=fv)
    flags.DEFINE_bool("quiet", False, "No progress bar or per-variant lines; the table is printed.", flag_values=fv)
    flags.DEFINE_bool(
        "show_config", False, "Print the sweep's base config (every field, its value and description) and each "
        "variant's overrides, then exit without running anything.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_bool(
        "on_this_device", False, "Name the sweep after the accelerator its variants run on: "
        "<file stem>_<preset>_<device> (h100, a5000, ...: the planning target with the same device_kind, else "
        "the device_kind shortened), e.g. experiments/results/seed_table_seed_h100/. The device is read in a "
        "short child process; this process never opens the GPU.", flag_values=fv,
    )  # fmt: skip
    define_calibrate_flag(fv)
    define_cache_flag(fv)
    return fv


def show_config(spec: str) -> str:
    """The base config of a sweep file at its preset (config.describe) and each variant's overrides."""
    sweep = load_sweep(spec)
    lines = [f"sweep {sweep.name}: base config (get_config({sweep.preset!r}))", describe(sweep.base), "",
             f"variants (baseline {sweep.baseline}):"]  # fmt: skip
    for variant in sweep.variants:
        overrides = ", ".join(f"{k}={cli_value(v, k)}" for k, v in variant.overrides.items()) or "(the base)"
        lines.append(f"  {variant.name}: {overrides}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: runs the sweep, prints its table; exit 0, 1 (--strict and a failed variant), 2 (bad input)."""
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        try:
            rest = parse_flags(fv, argv)
        except UsageError as error:
            hint = "; config changes belong in the sweep's variants" if "config." in str(error) else ""
            raise UsageError(f"{error}{hint}") from None
        if len(rest) > 1:
            raise UsageError(f"unexpected argument {rest[1]!r}")
        if not fv.config:
            raise UsageError("--config is required, e.g. --config experiments/seed_table.py:cpu")
        if fv.timeout < 0:
            raise UsageError(f"--timeout: must be >= 0 seconds (0: no limit), got {fv.timeout:g}")
        if fv.show_config:
            print(show_config(fv.config))
            return 0
        compile_cache.set_enabled(fv.compilation_cache)  # the variants' processes inherit it
        outcome = run_sweep(
            fv.config,
            only=fv.only,
            skip=fv.skip,
            rerun=fv.rerun,
            timeout_s=fv.timeout or None,
            device_memory=fv.device_memory,
            plan=fv.plan,
            target=fv.target,
            gemm=fv.gemm,
            devices=fv.devices,
            host_args=hosts.forwarded(fv),
            output_root=fv.output_root,
            name=fv.name,
            run_args=fv.run_arg,
            progress=not fv.quiet,
            on_this_device=fv.on_this_device,
            calibrate_on=fv.calibrate,
        )
    except UsageError as error:
        return fail(str(error))
    except KeyboardInterrupt:
        print("jaxscale: interrupted; finished rows are kept, run the same command to resume", file=sys.stderr)
        return 130
    if fv.process_id:
        print(f"sweep {outcome.sweep.name}: process {fv.process_id} done; process 0 records the rows")
        return 0
    print(outcome.table())
    print(f"results: {outcome.results_path} (and {outcome.results_path.with_suffix('.csv')})")
    return 1 if fv.strict and outcome.failed() else 0

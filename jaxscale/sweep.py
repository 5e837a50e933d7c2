"""Sweeps: `python -m jaxscale.sweep --config experiments/seed_table.py:cpu`, each variant in a fresh process.

A sweep file holds `get_config(preset)` (the base config), `get_variants(config)` (named variants as dotted
overrides, e.g. {"name": "bf16_scan_remat_block", "model.remat": ("Block",)}) and `BASELINE` (the variant
the others are compared with). Each variant runs as `python -m jaxscale.run --config <sweep file>:<preset>
--config.<field>=<value> ...` in its own process, so its peak memory is its own and a crash ends only it.
Rows go to <output_root>/experiments/results/<sweep>/results.jsonl, traces to <output_root>/traces/<sweep>/.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import importlib.util
import itertools
import json
import os
import pathlib
import re
import shutil
import sys
from collections.abc import Sequence

import ml_collections
import pandas as pd
from absl import flags
from tqdm import tqdm

from jaxscale import variant_process
from jaxscale.cli import UsageError, fail, parse_bytes
from jaxscale.config import ConfigError, flatten
from jaxscale.results import ResultsFile, format_table, load_results, read_rows
from jaxscale.run import write_row

__all__ = ["Sweep", "SweepOutcome", "Variant", "expand_grid", "load_results", "load_sweep", "run_sweep"]

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SET_BY_SWEEP = ("name", "preset", "preset_source")
# Run flags the sweep sets itself; anything else (--plan, --target, ...) may be passed through run_args.
_RESERVED_RUN_FLAGS = ("--config", "--name", "--run_dir", "--output_root", "--quiet")
DEFAULT_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One named variant: its dotted overrides and the full config they give."""

    name: str
    overrides: dict[str, object]
    config: ml_collections.ConfigDict


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A loaded sweep file at one preset."""

    name: str
    path: pathlib.Path
    preset: str
    baseline: str
    variants: tuple[Variant, ...]

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]


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


def expand_grid(axes: dict[str, dict[str, object]]) -> list[dict[str, object]]:
    """Every combination of the axes as named variants.

    Args:
      axes: dotted field -> {label: value}, e.g. {"model.dtype": {"fp32": "float32", "bf16": "bfloat16"},
        "model.remat": {"noremat": (), "block": ("Block",)}}.

    Returns:
      Variants named by their labels joined with "_" (fp32_noremat, fp32_block, bf16_noremat, bf16_block).
    """
    variants = []
    for combo in itertools.product(*(list(choices.items()) for choices in axes.values())):
        variant: dict[str, object] = {"name": "_".join(label for label, _ in combo)}
        variant.update({field: value for field, (_, value) in zip(axes, combo, strict=True)})
        variants.append(variant)
    return variants


def cli_value(value: object, where: str) -> str:
    """The command-line text ml_collections parses back into `value` (str, bool, int, float or a tuple)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)) or (
        isinstance(value, tuple) and all(isinstance(v, (str, bool, int, float)) for v in value)
    ):
        return repr(value)
    raise UsageError(f"{where}: {value!r} is a {type(value).__name__}; use a str, bool, int, float or a tuple of them")


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, object], where: str) -> None:
    """Sets dotted fields of `config` in place; raises UsageError naming an unknown field or a wrong type."""
    for dotted, value in overrides.items():
        *groups, field = dotted.split(".")
        node = config
        for depth, group in enumerate(groups):
            if group not in node or not isinstance(node[group], ml_collections.ConfigDict):
                allowed = ", ".join(k for k, v in node.items() if isinstance(v, ml_collections.ConfigDict))
                raise UsageError(f"{where}: {dotted}: no group {'.'.join(groups[: depth + 1])!r}; allowed: {allowed}")
            node = node[group]
        if not groups and field in _SET_BY_SWEEP:
            raise UsageError(f"{where}: {dotted}: set by the sweep, not by a variant")
        if field not in node or isinstance(node[field], ml_collections.ConfigDict):
            fields = ", ".join(sorted(k for k, v in node.items() if not isinstance(v, ml_collections.ConfigDict)))
            raise UsageError(f"{where}: {dotted}: no field {field!r} in {'.'.join(groups) or 'the config'}; "
                             f"allowed: {fields}")  # fmt: skip
        cli_value(value, f"{where}: {dotted}")
        try:
            node[field] = value
        except TypeError as error:
            raise UsageError(f"{where}: {dotted}: {error}") from None


def _import_sweep_file(path: pathlib.Path):
    if not path.is_file():
        raise UsageError(f"--config: sweep file {str(path)!r} not found")
    module_spec = importlib.util.spec_from_file_location(f"_jaxscale_sweep_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # any error in the user's file is bad input
        raise UsageError(f"--config: {path}: {type(error).__name__}: {error}") from None
    missing = [attr for attr in ("get_config", "get_variants", "BASELINE") if not hasattr(module, attr)]
    if missing:
        raise UsageError(f"--config: {path} is not a sweep file: it lacks {', '.join(missing)} (see experiments/)")
    return module


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise UsageError(f"{what}: {name!r} is not a valid name; use letters, digits, '_', '-' and '.'")
    return name


def load_sweep(config: str | os.PathLike, preset: str | None = None, name: str | None = None) -> Sweep:
    """Loads a sweep file and builds every variant's config (without touching any accelerator).

    Args:
      config: the sweep file, optionally with the preset after a colon (experiments/seed_table.py:cpu).
      preset: the preset, when not given after the colon (required one way or the other).
      name: the sweep's name (default: <file stem>_<preset>); it names the results and traces directories.

    Raises:
      UsageError: a one-line message naming the file, variant or field at fault.
    """
    path_text, _, spec_preset = str(config).partition(":")
    preset = preset or spec_preset
    if not preset:
        raise UsageError(f"--config: add a preset after the colon, e.g. {path_text}:cpu (seed | cpu | tiny); "
                         "a sweep keeps its results per preset")  # fmt: skip
    path = pathlib.Path(path_text)
    module = _import_sweep_file(path)
    try:
        base = module.get_config(preset)
        specs = module.get_variants(copy.deepcopy(base))
    except ConfigError as error:
        raise UsageError(f"--config: {path}: {error}") from None
    except Exception as error:  # an error in the user's get_config / get_variants is bad input
        raise UsageError(f"--config: {path}: {type(error).__name__}: {error}") from None
    variants = []
    for spec in specs:
        variant_name = _check_name(spec.get("name"), f"{path}: variant name")
        overrides = {k: v for k, v in spec.items() if k != "name"}
        variant_config = copy.deepcopy(base)
        apply_overrides(variant_config, overrides, f"{path}: variant {variant_name}")
        variant_config.name = variant_name
        variants.append(Variant(variant_name, overrides, variant_config))
    names = [v.name for v in variants]
    if not names or len(set(names)) != len(names):
        raise UsageError(f"{path}: get_variants must give variants with distinct names, got {names}")
    if module.BASELINE not in names:
        raise UsageError(f"{path}: BASELINE {module.BASELINE!r} is not a variant; variants: {', '.join(names)}")
    sweep_name = _check_name(name or f"{path.stem}_{preset}", "--name")
    return Sweep(sweep_name, path, preset, module.BASELINE, tuple(variants))


def select_variants(names: Sequence[str], only: Sequence[str] = (), skip: Sequence[str] = ()) -> list[str]:
    """The names kept by --only (if given) and not dropped by --skip; both take shell patterns (bf16_*)."""

    def matching(patterns: Sequence[str], flag: str) -> set[str]:
        chosen: set[str] = set()
        for pattern in patterns:
            hits = fnmatch.filter(names, pattern)
            if not hits:
                raise UsageError(f"{flag}: {pattern!r} matches no variant; variants: {', '.join(names)}")
            chosen.update(hits)
        return chosen

    kept, dropped = matching(only, "--only") if only else set(names), matching(skip, "--skip")
    selected = [n for n in names if n in kept and n not in dropped]
    if not selected:
        raise UsageError("--only/--skip: no variant left to run")
    return selected


def _run_args(run_args: Sequence[str], device_memory: int | str | None) -> list[str]:
    for arg in run_args:
        if arg.split("=", 1)[0].split(".", 1)[0] in _RESERVED_RUN_FLAGS:
            hint = "; config changes belong in the sweep's variants" if arg.startswith("--config") else ""
            raise UsageError(f"--run_arg: {arg!r} is set by the sweep{hint}")
    if device_memory is None:
        return list(run_args)
    budget = device_memory if isinstance(device_memory, int) else parse_bytes(device_memory, "--device-memory")
    return [*run_args, f"--device_memory={budget}"]


def _is_current(row: dict | None, variant: Variant, run_args: list[str]) -> bool:
    """Whether a recorded row was made from this variant's config and run options (so resume may skip it)."""
    if row is None:
        return False
    config = json.loads(json.dumps(flatten(variant.config)))
    return all(row.get(k) == v for k, v in config.items()) and row.get("run_args", []) == run_args


def run_variant(
    sweep: Sweep, variant: Variant, output_root: pathlib.Path, run_args: list[str], timeout_s: float | None
) -> dict:
    """Runs one variant in a fresh `python -m jaxscale.run` process; always returns its row."""
    run_dir = output_root / "traces" / sweep.name / variant.name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished or replaced attempt: its run refuses to overwrite a result
    run_dir.mkdir(parents=True)
    command = [
        "-m", "jaxscale.run", f"--config={sweep.path}:{sweep.preset}",
        *(f"--config.{field}={cli_value(value, field)}" for field, value in variant.overrides.items()),
        f"--config.name={variant.name}", f"--run_dir={run_dir}", "--quiet", *run_args,
    ]  # fmt: skip
    finished = variant_process.launch(command, run_dir / "run.log", timeout_s)
    result_path = run_dir / "result.json"
    if result_path.exists():
        row = json.loads(result_path.read_text())
    else:
        status, error = variant_process.failure(finished, timeout_s)
        row = {"name": variant.name, "status": status, "error": error, **flatten(variant.config)}
        row.update(run_dir=str(run_dir), trace_dir=None)
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


def _one_line(row: dict) -> str:
    text = f"{row['variant']}: {row['status']}"
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
    output_root: str | os.PathLike = ".",
    name: str | None = None,
    run_args: Sequence[str] = (),
    progress: bool = True,
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
        it becomes an `oom` row without running its steps.
      output_root: root of experiments/results/<sweep>/ and traces/<sweep>/<variant>/.
      name: sweep name (default <file stem>_<preset>).
      run_args: extra `python -m jaxscale.run` flags for every variant (e.g. --plan).
      progress: show a bar across variants and a line per finished variant.

    Returns:
      SweepOutcome: the results path, the selected variants, and the table / DataFrame of all rows.
    """
    sweep = load_sweep(config, preset, name)
    selected = select_variants(sweep.variant_names, only, skip)
    run_args = _run_args(run_args, device_memory)
    output_root = pathlib.Path(output_root)
    store = ResultsFile(output_root / "experiments" / "results" / sweep.name)
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
    flags.DEFINE_string("output_root", ".", "Root of experiments/results/ and traces/.", flag_values=fv)
    flags.DEFINE_string("name", None, "Sweep name (default: <file stem>_<preset>).", flag_values=fv)
    flags.DEFINE_multi_string("run_arg", [], "Extra flag for every run, e.g. --run_arg=--plan.", flag_values=fv)
    flags.DEFINE_bool("quiet", False, "No progress bar or per-variant lines; the table is printed.", flag_values=fv)
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: runs the sweep, prints its table; exit 0, 1 (--strict and a failed variant), 2 (bad input)."""
    fv = _flag_values()
    try:
        try:
            rest = fv(list(sys.argv if argv is None else argv))
        except flags.Error as error:
            hint = "; config changes belong in the sweep's variants" if "config." in str(error) else ""
            raise UsageError(f"{error}{hint}") from None
        if len(rest) > 1:
            raise UsageError(f"unexpected argument {rest[1]!r}")
        if not fv.config:
            raise UsageError("--config is required, e.g. --config experiments/seed_table.py:cpu")
        if fv.timeout < 0:
            raise UsageError(f"--timeout: must be >= 0 seconds (0: no limit), got {fv.timeout:g}")
        outcome = run_sweep(
            fv.config,
            only=fv.only,
            skip=fv.skip,
            rerun=fv.rerun,
            timeout_s=fv.timeout or None,
            device_memory=fv.device_memory,
            output_root=fv.output_root,
            name=fv.name,
            run_args=fv.run_arg,
            progress=not fv.quiet,
        )
    except UsageError as error:
        return fail(str(error))
    except KeyboardInterrupt:
        print("jaxscale: interrupted; finished rows are kept, run the same command to resume", file=sys.stderr)
        return 130
    print(outcome.table())
    print(f"results: {outcome.results_path} (and {outcome.results_path.with_suffix('.csv')})")
    return 1 if fv.strict and outcome.failed() else 0


if __name__ == "__main__":
    sys.exit(main())

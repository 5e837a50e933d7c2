"""Predictions held to published measurements: `python -m jaxscale.published [--only ID,...]`.

`experiments/published_runs.json` lists real training runs as their authors published them (each with its
source, the quoted table row, the setup and what was measured) and, under `lab`, the lab's nearest
configuration: a config file and preset, field overrides, the GPU target and device count, and the
differences the lab cannot express. For each run this command plans that configuration deviceless for the
published GPU and count (jaxscale.plan.gpu_plan) and predicts its step (jaxscale.plan.predict), then
writes one row per run to experiments/results/published/results.jsonl (resumable: a run with a row is
skipped unless --rerun) and a table, published.md, with predicted / published for time and, where
published, memory, and the mean absolute error. docs/published.md presents it.

No constant of the predictor is fitted to these rows: they only check it.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections
from absl import flags

from jaxscale import run
from jaxscale.cli import Usage, UsageError, fail, no_arguments, print_help, wants_help
from jaxscale.config import ConfigError, load_config_file, validate
from jaxscale.config.overrides import apply_overrides
from jaxscale.plan import gpu_plan, targets
from jaxscale.report.published_errors import (
    error_ratios,
    held_now,
    held_sets,
    mean_abs_error,
    split_table,
    summary_line,
)
from jaxscale.report.published_errors import number_text as _number
from jaxscale.sweep.results import ResultsFile

GIB = 2**30
REPO = pathlib.Path(__file__).resolve().parents[1]
RUNS_FILE = REPO / "experiments" / "published_runs.json"
RESULTS_NAME = "published"
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a run's id names its directory under runs/
# the fields this command reads, and their JSON types (positive for numbers, non-empty for text and lists)
RUN_FIELDS = {"id": str, "project": str, "framework": str, "source": str, "model": str, "gpu": str, "n_gpus": int,
              "seq_len": int, "global_batch": int, "lab": dict}  # fmt: skip
# The software stack whose kernels ran the step (the errors are split by it): PyTorch (eager or torch.compile, with
# its own or Hugging Face models), PyTorch + Megatron-Core (NVIDIA's NeMo and Megatron-Bridge: Transformer Engine's
# kernels), JAX (XLA's GPU compiler, as the lab), CUDA (llm.c's hand-written kernels).
FRAMEWORKS = ("PyTorch", "PyTorch + Megatron-Core", "JAX", "CUDA")
# A run has `measured` (its published figures) and/or `first_sight` (the lab's prediction, registered before the
# figures entered the repository: `--register`); a new run has neither until it is registered.
FIRST_SIGHT_FIELDS = ("predicted_step_s", "commit", "registered")
LAB_FIELDS = {"config": str, "preset": str, "overrides": dict, "target": str, "devices": int, "differences": list}
MEASURED_FIELDS = ("step_time_s", "tokens_per_s_per_gpu", "sequences_per_s", "peak_memory_gib")  # a number or null
_KINDS = {str: "a non-empty string", int: "a positive integer", dict: "an object", list: "a non-empty list"}


def load_runs(path: pathlib.Path = RUNS_FILE) -> list[dict]:
    """The published runs, each with its `lab` configuration.

    Raises:
      UsageError: the file is missing or not the list this command reads (one line naming what is wrong).
    """
    try:
        runs = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--runs: no file {path}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"--runs: {path} is not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and "id" in r and "lab" in r for r in runs):
        raise UsageError(f"--runs: {path} must be a list of runs, each with an 'id' and a 'lab' configuration")
    for index, published in enumerate(runs):
        check_fields(published, index)
    ids = [r["id"] for r in runs]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise UsageError(f"--runs: run {repeated[0]!r}: id: given to {ids.count(repeated[0])} runs; ids must differ")
    return runs


def _has_kind(value: object, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0
    return isinstance(value, kind) and bool(value or kind is dict)


def check_fields(published: dict, index: int = 0) -> None:
    """Checks that a run has every field this command reads, each of its type (RUN_FIELDS, LAB_FIELDS; the
    measured figures numbers or null), before any configuration is built.

    Args:
      published: one run of the runs file.
      index: its place in the file, to name a run without a usable id.

    Raises:
      UsageError: one line naming the run and the field, and what is allowed.
    """
    name = published.get("id") if isinstance(published.get("id"), str) else f"#{index}"
    where = f"--runs: run {name!r}"
    for prefix, fields, node in (("", RUN_FIELDS, published), ("lab.", LAB_FIELDS, published.get("lab"))):
        for field, kind in fields.items():
            if field not in node:
                needed = ", ".join(prefix + f for f in fields)
                raise UsageError(f"{where}: {prefix}{field}: missing; a run needs {needed}")
            if not _has_kind(node[field], kind):
                raise UsageError(f"{where}: {prefix}{field}: must be {_KINDS[kind]}, got {node[field]!r}")
    if published["framework"] not in FRAMEWORKS:
        raise UsageError(f"{where}: framework: must be one of {', '.join(map(repr, FRAMEWORKS))}, got "
                         f"{published['framework']!r}")  # fmt: skip
    if not _SAFE_ID.fullmatch(name):
        raise UsageError(f"{where}: id: use letters, digits, '_', '-' and '.' (it names the run's directory)")
    if "measured" in published and not isinstance(published["measured"], dict):
        raise UsageError(f"{where}: measured: must be an object, got {published['measured']!r}")
    first = published.get("first_sight")
    if first is not None and (not isinstance(first, dict) or any(f not in first for f in FIRST_SIGHT_FIELDS)):
        raise UsageError(f"{where}: first_sight: must be an object with {', '.join(FIRST_SIGHT_FIELDS)} (written by "
                         f"--register), got {first!r}")  # fmt: skip
    for field in MEASURED_FIELDS:
        value = published.get("measured", {}).get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise UsageError(f"{where}: measured.{field}: must be a positive number or null, got {value!r}")


def published_step_s(published: dict) -> tuple[float | None, str]:
    """The published run's step in seconds and how it follows from what was published: a step time as
    published, or the tokens (sequences) of one step over the published tokens/s per GPU x GPUs (sequences/s), or,
    where only TFLOP/s per GPU was published, the step the source's own FLOP count gives (derived_by_source_reader:
    its formula is in `how`, and a test recomputes it)."""
    measured = published.get("measured", {})
    tokens = published["global_batch"] * published["seq_len"]
    if measured.get("step_time_s"):
        return float(measured["step_time_s"]), "published step time"
    if measured.get("tokens_per_s_per_gpu"):
        rate = measured["tokens_per_s_per_gpu"] * published["n_gpus"]
        return tokens / rate, "tokens per step / (published tokens/s per GPU x GPUs)"
    if measured.get("sequences_per_s"):
        return published["global_batch"] / measured["sequences_per_s"], "sequences per step / published sequences/s"
    derived = published.get("derived_by_source_reader", {})
    if measured.get("tflops_per_gpu") and derived.get("step_time_s"):  # only a rate in TFLOP/s was published
        return float(derived["step_time_s"]), "the source's own FLOPs per step / its published TFLOP/s per GPU"
    return None, "no time published"


def lab_config(published: dict) -> ml_collections.ConfigDict:
    """The lab's configuration of a published run: its config file at its preset, with its overrides applied
    (a list becomes the tuple a config field holds; names and types checked by the sweep's override parser),
    validated, and laid out on the run's GPUs (check_layout).

    Raises:
      UsageError: one line naming the run and the field at fault (lab.config, lab.preset, an override, the
        mesh, lab.devices, lab.target, lab.gemm), before anything is compiled.
    """
    lab, where = published["lab"], f"--runs: run {published['id']!r}"
    if not (REPO / lab["config"]).is_file():
        raise UsageError(f"{where}: lab.config: no file {lab['config']!r} (a path under the repository, "
                         "e.g. configs/bf16_remat.py)")  # fmt: skip
    try:
        config = load_config_file(REPO / lab["config"], lab["preset"])
    except ConfigError as error:  # an unknown preset
        raise UsageError(f"{where}: lab.{error}") from None
    except Exception as error:  # any other error in the config file is bad input too
        raise UsageError(f"{where}: lab.config: {lab['config']}: {type(error).__name__}: {error}") from None
    overrides = {key: tuple(value) if isinstance(value, list) else value for key, value in lab["overrides"].items()}
    apply_overrides(config, overrides, f"{where}: lab.overrides")
    try:
        validate(config)
    except ConfigError as error:
        raise UsageError(f"{where}: {error}") from None
    check_layout(published, config)
    return config


def check_layout(published: dict, config: ml_collections.ConfigDict) -> None:
    """Checks a run's configuration against the run: its sequence and batch as published, its GPU target and
    GEMM mode known, lab.devices the run's n_gpus, a mesh that uses them all, and cuDNN's libraries where its
    attention is cuDNN's.

    Raises:
      UsageError: one line naming the run and the field.
    """
    lab, where = published["lab"], f"--runs: run {published['id']!r}"
    for field, key in (("data.seq_len", "seq_len"), ("data.batch_size", "global_batch")):
        group, name = field.split(".")
        if config[group][name] != published[key]:
            raise UsageError(f"{where}: lab.overrides: {field} is {config[group][name]}, but the run's {key} is "
                             f"{published[key]}; set {field}={published[key]}")  # fmt: skip
    if lab["target"] not in targets.TARGETS:
        raise UsageError(f"{where}: lab.target: unknown {lab['target']!r}; allowed: {', '.join(targets.TARGETS)}")
    check_power_limit(published)
    if lab.get("gemm", "both") not in gpu_plan.GEMM_CHOICES:
        raise UsageError(f"{where}: lab.gemm: unknown {lab['gemm']!r}; allowed: {', '.join(gpu_plan.GEMM_CHOICES)}")
    if lab["devices"] != published["n_gpus"]:
        raise UsageError(f"{where}: lab.devices: {lab['devices']}, but the run's n_gpus is {published['n_gpus']}; "
                         "plan the published count")  # fmt: skip
    try:
        gpu_plan.check_devices_flag(config, lab["target"], lab["devices"])
    except gpu_plan.PlanFlagError as error:
        raise UsageError(f"{where}: {error}") from None
    missing = gpu_plan.missing_cudnn() if config.model.attention == "cudnn" else None
    if missing:
        raise UsageError(f"{where}: {missing}")


def check_power_limit(published: dict) -> None:
    """A run names its target by what it ran on: a run that states a power limit plans on a target capped at that
    limit, and a capped target plans only runs that state its limit (a target without one is the card at its own
    board power).

    Raises:
      UsageError: one line naming the run, gpu_power_limit_w and the targets that match.
    """
    stated, name = published.get("gpu_power_limit_w"), published["lab"]["target"]
    capped, where = targets.TARGETS[name].power_limit_w, f"--runs: run {published['id']!r}"
    if stated is not None and not _has_kind(stated, int):
        raise UsageError(f"{where}: gpu_power_limit_w: must be a positive integer (watts) or null, got {stated!r}")
    if stated == capped:
        return
    if stated is None:
        raise UsageError(f"{where}: gpu_power_limit_w: null, but lab.target {name!r} is capped at {capped} W; state "
                         "the run's published limit or name a target at its board power")  # fmt: skip
    matching = [key for key, card in targets.TARGETS.items() if card.power_limit_w == stated]
    allowed = (f"targets capped at {stated} W: {', '.join(matching)}" if matching
               else f"no target is capped at {stated} W")
    raise UsageError(f"{where}: gpu_power_limit_w: {stated}, but lab.target {name!r} plans "
                     f"{f'{capped} W' if capped else 'the card at its board power'}; {allowed}")  # fmt: skip


def excluded(published: dict, row: dict) -> str | None:
    """Why the run is not counted in the mean error, or None: the runs file's reason (a published figure that is
    not a physical measurement), or the lab's plan not fitting the GPU the run used. A run that ran fitted its
    card, so a plan that does not is a program the run never was (the lab cannot pose it as it ran), and its
    predicted time is of a program that could not run there. Where the run's card had more memory than the lab's
    target (`gpu_memory_gib`, e.g. torchtitan's 96 GB H100s against the 80 GB target) and the planned peak is
    below it, the plan's not fitting the target says nothing of the run's card: it is counted."""
    if published.get("exclude"):
        return published["exclude"]
    peak = row.get("compiled_peak_bytes")
    if not plan_fitted_card(published, peak / GIB if peak else None, row.get("plan_fits")):
        return (f"the lab's nearest program does not fit the {published['gpu']} the run used "
                f"({row.get('plan_fits_reason')}); the run fitted, so the lab has not posed it as it ran")  # fmt: skip
    return None


def plan_fitted_card(published: dict, peak_gib: float | None, plan_fits: bool | None) -> bool:
    """Whether a plan of the run (its peak in GiB, its `plan_fits` on the lab's target) fitted the card the run used:
    it fitted the target, or the run's card had more memory than the target (`gpu_memory_gib`, e.g. torchtitan's 96 GB
    H100s against the 80 GB target) and the peak is below it."""
    card = published.get("gpu_memory_gib")
    if card and peak_gib and peak_gib < card:  # a larger card than the lab's target: it had the room
        return True
    return plan_fits is not False


def first_sight_fitted(published: dict) -> bool:
    """Whether the plan registered with the run's first sight fitted the card the run used (plan_fitted_card)."""
    first = published.get("first_sight") or {}
    return plan_fitted_card(published, first.get("plan_peak_gib"), first.get("plan_fits"))


def excluded_at_first_sight(published: dict) -> bool:
    """Whether the run's first sight is left out of the first-sight error: the runs file's reason, or the plan
    registered with it not fitting the card the run used (excluded's rule, applied to the first sight's own plan). A
    later plan that fits does not add the run to the first-sight error: a first-sight figure and the summary over
    them are never rewritten; the run is counted apart (format_table)."""
    return bool(published.get("exclude")) or not first_sight_fitted(published)


def compare(published: dict, row: dict) -> dict[str, Any]:
    """The published figures beside the plan's row, and predicted / published for time and memory."""
    step, how = published_step_s(published)
    measured = published.get("measured", {})
    devices = published["lab"]["devices"]
    # A prediction registered after the run's figure was already in the repository is not a first sight: the runs
    # file says so (first_sight_void, with where the figure was), and the run counts in the development set.
    first = {} if published.get("first_sight_void") else published.get("first_sight") or {}
    predicted = row.get("predicted_step_s")
    tokens = row.get("predicted_tokens_per_s")
    plan_gib = row["compiled_peak_bytes"] / GIB if row.get("compiled_peak_bytes") else None
    return {
        "published_id": published["id"],
        "published_project": published["project"],
        "published_framework": published["framework"],
        "published_source": published["source"],
        "published_model": published["model"],
        "published_gpu": published["gpu"],
        "published_n_gpus": published["n_gpus"],
        "published_step_s": step,
        "published_step_source": how,
        "published_tokens_per_s_per_gpu": published["global_batch"] * published["seq_len"] / step / devices
        if step
        else None,
        "published_peak_gib": measured.get("peak_memory_gib"),
        "published_memory_kind": measured.get("memory_kind"),
        "published_differences": published["lab"]["differences"],
        "published_excluded": excluded(published, row),  # why a published figure is not held against the lab
        "predicted_tokens_per_s_per_gpu": tokens / devices if tokens else None,
        "predicted_over_published_step": predicted / step if predicted and step else None,
        "plan_over_published_memory": plan_gib / measured["peak_memory_gib"]
        if plan_gib and measured.get("peak_memory_gib")
        else None,
        "published_pending": "measured" not in published,  # registered, its figures not yet in the repository
        "first_sight_step_s": first.get("predicted_step_s"),
        "first_sight_void": published.get("first_sight_void"),
        "first_sight_excluded": excluded_at_first_sight(published) if first else None,
        "first_sight_commit": first.get("commit"),
        "first_sight_over_published_step": first["predicted_step_s"] / step
        if first.get("predicted_step_s") and step
        else None,
        "first_sight_plan_over_published_memory": first["plan_peak_gib"] / measured["peak_memory_gib"]
        if first.get("plan_peak_gib") and measured.get("peak_memory_gib")
        else None,
    }


def plan_run(published: dict, output_root: pathlib.Path, config: ml_collections.ConfigDict | None = None) -> dict:
    """Plans and predicts one published run (its `config` from lab_config, built here when not given); the
    run's row (status error or oom with the reason when it fails)."""
    lab = published["lab"]
    config = lab_config(published) if config is None else config
    run_dir = output_root / "experiments" / "results" / RESULTS_NAME / "runs" / published["id"]
    row = run.run(config, run_dir, published["id"], plan_only=True, progress=False, target=lab["target"],
                  gemm=lab.get("gemm", "both"), devices=lab["devices"])  # fmt: skip
    row.update(compare(published, row), variant=published["id"], sweep=RESULTS_NAME)
    return row


def record(store: ResultsFile, row: dict, had_ok_row: bool) -> str | None:
    """Stores a run's new row unless it would replace an ok row with a failure of this machine; the failure's
    one line, or None when the run planned.

    A row with status error (the plan did not compile: a missing library, a compiler crash or timeout; the
    run's own configuration was checked before) never replaces an ok row: the ok row stays and the line says
    so. An oom row is the run's own result and replaces it.
    """
    if row["status"] == "ok":
        store.record(row)
        return None
    if row["status"] == "error" and had_ok_row:
        return f"{row['variant']}: not replanned, its earlier ok row kept: {row.get('error')}"
    store.record(row)
    return f"{row['variant']}: {row['status']}: {row.get('error')}"


def format_table(rows: list[dict], runs: Sequence[dict] | None = None) -> str:
    """The markdown table: one line per run, then the mean absolute errors.

    With `runs` (the runs file) each row's comparison is taken again from the file as it is now (a figure added
    after the run was planned counts without planning it again). Pre-registered runs (`first_sight`) get their
    first-sight prediction beside the current one, and a summary of their own: the development set (runs the
    predictor was corrected on) and the runs it first saw at registration are never mixed.
    """
    by_id = {r["id"]: r for r in runs or ()}
    rows = [{**row, **compare(by_id[row["variant"]], row)} if row["variant"] in by_id and row.get("status") == "ok"
            else row for row in rows]  # fmt: skip
    lines = [
        "| run | GPUs | published step s | predicted step s | predicted / published | first sight / published "
        "| published GiB | plan GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {row['variant']} | – | – | {row.get('status')}: {row.get('error')} | – | – | – | – |")
            continue
        plan_gib = row["compiled_peak_bytes"] / GIB if row.get("compiled_peak_bytes") else None
        excluded = " (excluded: see its row)" if row.get("published_excluded") else ""
        if row.get("first_sight_void"):
            excluded += " (registered, not a first sight: its runs-file entry says why)"
        pending = row.get("published_pending")
        published_step = "registered, not yet measured" if pending else _number(row["published_step_s"], 3)
        lines.append(
            f"| {row['variant']}{excluded} | {row['published_n_gpus']} x {row['plan_target']} "
            f"| {published_step} | {_number(row.get('predicted_step_s'), 3)} "
            f"| {_number(row.get('predicted_over_published_step'))} "
            f"| {_number(row.get('first_sight_over_published_step'))} | {_number(row.get('published_peak_gib'), 1)} "
            f"| {_number(plan_gib, 1)} |"
        )
    sets = held_sets(rows)
    development, registered, fit_since = sets["development"], sets["registered"], sets["fit_since"]
    time_ratios = error_ratios(development, "predicted_over_published_step")
    memory_ratios = [r["plan_over_published_memory"] for r in development if r.get("plan_over_published_memory")]
    memory_error = mean_abs_error(memory_ratios)
    lines.append("")
    lines.append(
        f"{summary_line(time_ratios, 'time, development set')}; memory: "
        f"{_number(None if memory_error is None else 100 * memory_error, 1)}% over {len(memory_ratios)} runs"
    )
    if any(r.get("first_sight_step_s") for r in rows if r.get("status") == "ok"):  # a run registered
        first = error_ratios(registered, "first_sight_over_published_step")
        first_memory = mean_abs_error([r["first_sight_plan_over_published_memory"] for r in registered
                                       if r.get("first_sight_plan_over_published_memory")])  # fmt: skip
        memory_runs = sum(bool(r.get("first_sight_plan_over_published_memory")) for r in registered)
        now = error_ratios(held_now(registered), "predicted_over_published_step")
        waiting = sum(bool(r.get("published_pending")) for r in sets["held"])
        lines.append("")
        lines.append(f"{summary_line(first, 'time, first sight (pre-registered)')}; the current predictor on them: "
                     f"{summary_line(now)}; memory at first sight: "
                     f"{_number(None if first_memory is None else 100 * first_memory, 1)}% over {memory_runs} runs; "
                     f"{waiting} registered runs await their figures")  # fmt: skip
        if fit_since:  # first sights of plans that did not fit: counted apart, by the current predictor only
            since = error_ratios(fit_since, "predicted_over_published_step")
            lines.append("")
            lines.append(f"{summary_line(since, 'time, registered runs whose plan fits only since their first sight')} "
                         f"(the current predictor; not in either error above)")  # fmt: skip
        lines += ["", split_table(rows)]
    return "\n".join(lines)


PLAN_FORMAT = ("a jaxscale.published row: XLA's deviceless plan of the lab's configuration for the run's GPU target "
               "and count, both GEMM modes compiled, the faster one's predicted step (jaxscale.plan.predict)")


def uncommitted_code() -> str | None:
    """The lab's code and configs that differ from the last commit (what a registered prediction would not name),
    or None when they are committed; None also outside a git checkout (nothing to name)."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--", "jaxscale", "configs"], cwd=REPO,
                              capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return ", ".join(line[3:] for line in done.stdout.splitlines()) or None


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def to_register(runs: list[dict], only: Sequence[str]) -> list[dict]:
    """The runs --register plans: those without figures or a first-sight prediction (of `only`, if given).

    Raises:
      UsageError: an --only run that has its figures already (a prediction made after them is not first sight) or a
        first-sight prediction (never rewritten).
    """
    for published in _wanted(runs, only) if only else ():
        if "measured" in published or "first_sight" in published:
            has = "its figures (measured)" if "measured" in published else "a first-sight prediction"
            raise UsageError(f"--register: run {published['id']!r} has {has} already; a run is registered once, "
                             "before its figures enter the repository")  # fmt: skip
    return [r for r in _wanted(runs, only) if "measured" not in r and "first_sight" not in r]


def first_sight(row: dict, commit: str) -> dict[str, Any]:
    """What --register writes into a run: the prediction of its plan row, the commit of the code that made it."""
    devices = row.get("plan_devices") or 1
    tokens = row.get("predicted_tokens_per_s")
    return {
        "predicted_step_s": row.get("predicted_step_s"),
        "predicted_tokens_per_s_per_gpu": tokens / devices if tokens else None,
        "plan_peak_gib": row["compiled_peak_bytes"] / GIB if row.get("compiled_peak_bytes") else None,
        "plan_fits": row.get("plan_fits"),
        "commit": commit,
        "registered": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "plan_format": PLAN_FORMAT,
    }


def write_runs(runs: list[dict], path: pathlib.Path) -> None:
    """The runs file as it is kept: JSON, one space of indent, a newline at the end (atomically replaced)."""
    tmp = pathlib.Path(path).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(runs, indent=1) + "\n")
    tmp.replace(path)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("runs", str(RUNS_FILE), "The published runs (JSON).", flag_values=fv)
    flags.DEFINE_bool("register", False, "Pre-register: plan the runs that have neither figures nor a first-sight "
                      "prediction, and write each one's prediction and the code's commit into the runs file "
                      "(refused while jaxscale/ or configs/ has uncommitted changes).", flag_values=fv)  # fmt: skip
    flags.DEFINE_list("only", [], "Plan only these run ids (default: every run).", flag_values=fv)
    flags.DEFINE_bool("rerun", False, "Plan again where a row exists.", flag_values=fv)
    flags.DEFINE_string("output_root", ".", "Root of experiments/results/.", flag_values=fv)
    return fv


USAGE = Usage(
    command="python -m jaxscale.published [--only ID,...] [--rerun] [--register]",
    summary="Plans and predicts each published training run in experiments/published_runs.json with the lab's "
    "nearest configuration (deviceless, for the published GPU and count) and tables predicted / published.",
    examples=(
        "python -m jaxscale.published",
        "python -m jaxscale.published --only llmc-gpt2-124m-8xa100 --rerun",
        "python -m jaxscale.published --register     # new runs: their predictions first, their figures later",
    ),
    notes=(
        "Needs the gpu-plan extra (without it: one line naming what to install, exit 2). The whole runs file is "
        "checked first (every field, each override's name and type, the mesh against the run's GPUs): a mistake "
        "is one line naming the run and the field, exit 2, nothing planned or written. A run that fails to plan "
        "(a missing library, a compiler failure) keeps its earlier ok row and is one line on stderr, exit 1.",
        "Rows: experiments/results/published/results.jsonl; table: published.md beside it; docs/published.md "
        "explains them.",
        "Pre-registration: a new run enters the runs file without `measured`; --register plans it and writes its "
        "`first_sight` prediction with the code's commit into the file (refused while jaxscale/ or configs/ differ "
        "from that commit); commit that, then add the figures. A first-sight prediction is never rewritten.",
    ),  # fmt: skip
)


def _wanted(runs: list[dict], only: Sequence[str]) -> list[dict]:
    known = [r["id"] for r in runs]
    unknown = [i for i in only if i not in known]
    if unknown:
        raise UsageError(f"--only: unknown run {unknown[0]!r}; known: {', '.join(known)}")
    return [r for r in runs if not only or r["id"] in only]


def check_extra() -> None:
    """Raises UsageError naming what to install when the gpu-plan extra is missing (every run plans a GPU)."""
    missing = gpu_plan.missing_extra()
    if missing:
        raise UsageError(missing.removeprefix("--target: "))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: plans the runs not yet planned, prints and writes the table; exit 0, 1 when a run failed to
    plan (one line each on stderr; an earlier ok row is kept), or 2 for bad input (nothing planned or written)."""
    argv = list(sys.argv if argv is None else argv)
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        no_arguments(fv, argv, "flags only (--only, --rerun, --runs, --output_root)")
        check_extra()
        runs = load_runs(pathlib.Path(fv.runs))
        wanted = to_register(runs, fv.only) if fv.register else _wanted(runs, fv.only)
        dirty = uncommitted_code() if fv.register else None
        if dirty:
            raise UsageError(f"--register: the lab's code has uncommitted changes ({dirty}); commit them first, so "
                             "that each prediction names the code that made it")  # fmt: skip
        configs = {r["id"]: lab_config(r) for r in runs}  # the whole file checked before anything is compiled
        store = ResultsFile(pathlib.Path(fv.output_root) / "experiments" / "results" / RESULTS_NAME)
        commit = head_commit() if fv.register else None  # the code this process (and its compiles) started from
        failures = []
        with store.locked():
            done = {r["variant"] for r in store.rows() if r.get("status") == "ok"}
            for published in wanted:
                if published["id"] in done and not fv.rerun and not fv.register:
                    continue
                print(f"{published['id']}: planning {published['lab']['devices']} x {published['lab']['target']}",
                      flush=True)  # fmt: skip
                row = plan_run(published, pathlib.Path(fv.output_root), configs[published["id"]])
                failures.append(record(store, json.loads(json.dumps(row, default=str)), published["id"] in done))
                if fv.register and row["status"] == "ok":
                    published["first_sight"] = first_sight(row, commit)
                    write_runs(runs, pathlib.Path(fv.runs))  # after each run: a later failure loses nothing
            order = {r["id"]: n for n, r in enumerate(runs)}
            rows = sorted((r for r in store.rows() if r["variant"] in order), key=lambda r: order[r["variant"]])
    except (UsageError, gpu_plan.PlanFlagError) as error:
        return fail(str(error))
    table = format_table(rows, runs)
    (store.directory / "published.md").write_text(table + "\n")
    print(table)
    print(f"results: {store.path}")
    for failure in filter(None, failures):
        fail(failure, code=1)
    return 1 if any(failures) else 0


if __name__ == "__main__":
    sys.exit(main())

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

import json
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

from jaxscale import run
from jaxscale.cli import Usage, UsageError, fail, no_arguments, print_help, wants_help
from jaxscale.config import ConfigError, load_config_file, validate
from jaxscale.plan import gpu_plan
from jaxscale.sweep.results import ResultsFile

GIB = 2**30
REPO = pathlib.Path(__file__).resolve().parents[1]
RUNS_FILE = REPO / "experiments" / "published_runs.json"
RESULTS_NAME = "published"


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
    return runs


def published_step_s(published: dict) -> tuple[float | None, str]:
    """The published run's step in seconds and how it follows from what was published: a step time as
    published, or the tokens (sequences) of one step over the published tokens/s per GPU x GPUs (sequences/s)."""
    measured = published["measured"]
    tokens = published["global_batch"] * published["seq_len"]
    if measured.get("step_time_s"):
        return float(measured["step_time_s"]), "published step time"
    if measured.get("tokens_per_s_per_gpu"):
        rate = measured["tokens_per_s_per_gpu"] * published["n_gpus"]
        return tokens / rate, "tokens per step / (published tokens/s per GPU x GPUs)"
    if measured.get("sequences_per_s"):
        return published["global_batch"] / measured["sequences_per_s"], "sequences per step / published sequences/s"
    return None, "no time published"


def lab_config(published: dict):
    """The lab's configuration of a published run: its config file at its preset, with its overrides applied
    (a list becomes the tuple a config field holds) and validated.

    Raises:
      UsageError: an override names no config field, or the result does not validate.
    """
    lab = published["lab"]
    config = load_config_file(REPO / lab["config"], lab["preset"])
    for key, value in lab["overrides"].items():
        group, _, field = key.partition(".")
        if group not in config or field not in config[group]:
            raise UsageError(f"{published['id']}: override {key}: no such config field")
        config[group][field] = tuple(value) if isinstance(value, list) else value
    try:
        validate(config)
    except ConfigError as error:
        raise UsageError(f"{published['id']}: {error}") from None
    return config


def compare(published: dict, row: dict) -> dict[str, Any]:
    """The published figures beside the plan's row, and predicted / published for time and memory."""
    step, how = published_step_s(published)
    measured = published["measured"]
    devices = published["lab"]["devices"]
    predicted = row.get("predicted_step_s")
    tokens = row.get("predicted_tokens_per_s")
    plan_gib = row["compiled_peak_bytes"] / GIB if row.get("compiled_peak_bytes") else None
    return {
        "published_id": published["id"],
        "published_project": published["project"],
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
        "published_excluded": published.get("exclude"),  # why a published figure is not held against the lab
        "predicted_tokens_per_s_per_gpu": tokens / devices if tokens else None,
        "predicted_over_published_step": predicted / step if predicted and step else None,
        "plan_over_published_memory": plan_gib / measured["peak_memory_gib"]
        if plan_gib and measured.get("peak_memory_gib")
        else None,
    }


def plan_run(published: dict, output_root: pathlib.Path) -> dict:
    """Plans and predicts one published run; the run's row (status error with the reason when it fails)."""
    lab = published["lab"]
    config = lab_config(published)
    run_dir = output_root / "experiments" / "results" / RESULTS_NAME / "runs" / published["id"]
    row = run.run(config, run_dir, published["id"], plan_only=True, progress=False, target=lab["target"],
                  gemm=lab.get("gemm", "both"), devices=lab["devices"])  # fmt: skip
    row.update(compare(published, row), variant=published["id"], sweep=RESULTS_NAME)
    return row


def mean_abs_error(ratios: Sequence[float]) -> float | None:
    """Mean of |ratio - 1| (0.15 = 15%), or None without ratios."""
    return statistics.fmean(abs(r - 1) for r in ratios) if ratios else None


def _number(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def format_table(rows: list[dict]) -> str:
    """The markdown table: one line per run, then the mean absolute errors."""
    lines = [
        "| run | GPUs | published step s | predicted step s | predicted / published | published GiB | plan GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {row['variant']} | – | – | {row.get('status')}: {row.get('error')} | – | – | – |")
            continue
        plan_gib = row["compiled_peak_bytes"] / GIB if row.get("compiled_peak_bytes") else None
        excluded = " (excluded: see its row)" if row.get("published_excluded") else ""
        lines.append(
            f"| {row['variant']}{excluded} | {row['published_n_gpus']} x {row['plan_target']} "
            f"| {_number(row['published_step_s'], 3)} | {_number(row.get('predicted_step_s'), 3)} "
            f"| {_number(row.get('predicted_over_published_step'))} | {_number(row.get('published_peak_gib'), 1)} "
            f"| {_number(plan_gib, 1)} |"
        )
    held = [r for r in rows if not r.get("published_excluded")]
    time_ratios = [r["predicted_over_published_step"] for r in held if r.get("predicted_over_published_step")]
    memory_ratios = [r["plan_over_published_memory"] for r in held if r.get("plan_over_published_memory")]
    time_error, memory_error = mean_abs_error(time_ratios), mean_abs_error(memory_ratios)
    within = sum(0.75 <= r <= 1.25 for r in time_ratios)
    lines.append("")
    lines.append(
        f"time: mean absolute error {_number(None if time_error is None else 100 * time_error, 1)}% over "
        f"{len(time_ratios)} runs, {within} within ±25%; memory: "
        f"{_number(None if memory_error is None else 100 * memory_error, 1)}% over {len(memory_ratios)} runs"
    )
    return "\n".join(lines)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("runs", str(RUNS_FILE), "The published runs (JSON).", flag_values=fv)
    flags.DEFINE_list("only", [], "Plan only these run ids (default: every run).", flag_values=fv)
    flags.DEFINE_bool("rerun", False, "Plan again where a row exists.", flag_values=fv)
    flags.DEFINE_string("output_root", ".", "Root of experiments/results/.", flag_values=fv)
    return fv


USAGE = Usage(
    command="python -m jaxscale.published [--only ID,...] [--rerun]",
    summary="Plans and predicts each published training run in experiments/published_runs.json with the lab's "
    "nearest configuration (deviceless, for the published GPU and count) and tables predicted / published.",
    examples=(
        "python -m jaxscale.published",
        "python -m jaxscale.published --only llmc-gpt2-124m-8xa100 --rerun",
    ),
    notes=(
        "Needs the gpu-plan extra. Rows: experiments/results/published/results.jsonl; table: published.md "
        "beside it; docs/published.md explains them.",
    ),  # fmt: skip
)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: plans the runs not yet planned, prints and writes the table; exit 0, or 2 for bad input."""
    argv = list(sys.argv if argv is None else argv)
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        no_arguments(fv, argv, "flags only (--only, --rerun, --runs, --output_root)")
        runs = load_runs(pathlib.Path(fv.runs))
        known = [r["id"] for r in runs]
        unknown = [i for i in fv.only if i not in known]
        if unknown:
            raise UsageError(f"--only: unknown run {unknown[0]!r}; known: {', '.join(known)}")
        wanted = [r for r in runs if not fv.only or r["id"] in fv.only]
        store = ResultsFile(pathlib.Path(fv.output_root) / "experiments" / "results" / RESULTS_NAME)
        with store.locked():
            done = {r["variant"] for r in store.rows() if r.get("status") == "ok"}
            for published in wanted:
                if published["id"] in done and not fv.rerun:
                    continue
                print(f"{published['id']}: planning {published['lab']['devices']} x {published['lab']['target']}",
                      flush=True)  # fmt: skip
                store.record(json.loads(json.dumps(plan_run(published, pathlib.Path(fv.output_root)), default=str)))
            order = {i: n for n, i in enumerate(known)}
            rows = sorted((r for r in store.rows() if r["variant"] in order), key=lambda r: order[r["variant"]])
    except (UsageError, gpu_plan.PlanFlagError) as error:
        return fail(str(error))
    table = format_table(rows)
    (store.directory / "published.md").write_text(table + "\n")
    print(table)
    print(f"results: {store.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""This machine's benchmark: `python -m jaxscale.bench [--preset cpu] [--output PATH]`.

In one process: the matmul roofline (float32 and bfloat16), then for each reference variant at the preset
its step time, tokens/s and MFU as jaxscale.run measures them, the trace's time shares, and the runner's
overhead against a bare loop around the same compiled step. Prints a markdown table and saves it.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from absl import flags

from jaxscale import compile_cache, run, train
from jaxscale.cli import Usage, UsageError, define_cache_flag, fail, parse_flags, print_help, wants_help
from jaxscale.config import PRESETS, ConfigError, check_backend, load_config_file, validate
from jaxscale.config.spec import tokens_per_step
from jaxscale.measure import columns, memory, peaks
from jaxscale.plan import predict
from jaxscale.sweep.sweep_file import apply_overrides

VARIANTS = ("fp32", "bf16", "bf16_noscan", "bf16_remat", "bf16_remat_block", "bf16_remat_noaccum")

USAGE = Usage(
    command="python -m jaxscale.bench [--preset cpu] [--variants ...] [--set group.field=value,...] [flags]",
    summary="This machine's benchmark in one process: the float32 and bfloat16 matmul rooflines, then each "
    "reference variant's step time, tokens/s, MFU, trace shares and the runner's overhead, as a markdown table.",
    examples=(
        "python -m jaxscale.bench",
        "python -m jaxscale.bench --preset tiny --variants bf16_noscan --steps 2",
        "python -m jaxscale.bench --set model.hidden_size=512,model.head_dim=64,data.batch_size=8",
    ),
    notes=(
        "Variants are config files configs/<name>.py; their fields are described in jaxscale/config/defaults.py "
        "(python -m jaxscale.run --config configs/<name>.py:<preset> --show_config lists them). The table "
        "and its rows (.jsonl) are saved; see docs/measurements.md, 'The benchmark'.",
    ),
)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("preset", "cpu", f"Size preset of every variant: {', '.join(PRESETS)}.", flag_values=fv)
    flags.DEFINE_list("variants", list(VARIANTS), "Config files (configs/<name>.py) to measure.", flag_values=fv)
    flags.DEFINE_string("configs_dir", "configs", "Directory holding the variants' config files.", flag_values=fv)
    flags.DEFINE_integer("steps", None, "Timed steps per variant (default: the preset's train.steps).", flag_values=fv)
    flags.DEFINE_integer("matmul_size", 2048, "Side of the square matmul of the roofline.", flag_values=fv)
    flags.DEFINE_list(
        "set", [], "Overrides for every variant, e.g. model.hidden_size=512,data.batch_size=8.", flag_values=fv
    )
    flags.DEFINE_string(
        "output", None, "Markdown file (default experiments/results/bench/bench_<preset>_<time>.md).", flag_values=fv
    )
    flags.DEFINE_string("trace_root", "traces/bench", "Where each variant's trace and ops.csv go.", flag_values=fv)
    define_cache_flag(fv)
    return fv


def _override(config: ml_collections.ConfigDict, assignment: str) -> None:
    """Applies one `group.field=value` (value parsed as a Python literal, else kept as a string)."""
    field, _, text = assignment.partition("=")
    if not text or "." not in field:
        raise ConfigError(f"--set: {assignment!r} must be group.field=value, e.g. model.hidden_size=512")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    apply_overrides(config, {field: value}, "--set")  # names an unknown field and what is allowed


def load_variant(
    configs_dir: str, name: str, preset: str, steps: int | None, overrides: Sequence[str] = ()
) -> ml_collections.ConfigDict:
    """configs/<name>.py at `preset` with `overrides` applied, validated; `steps` overrides train.steps."""
    path = pathlib.Path(configs_dir) / f"{name}.py"
    if not path.exists():
        raise ConfigError(f"--variants: no config file {path}")
    config = load_config_file(path, preset)
    if steps is not None:
        config.train.steps = steps
    for assignment in overrides:
        _override(config, assignment)
    validate(config)
    check_backend(config)  # bench runs here
    return config


def bare_step_seconds(config: ml_collections.ConfigDict, compiled, placement, steps: int) -> list[float]:
    """Seconds per call of the compiled step in a loop that does nothing else (after one warm-up call)."""
    state, metrics = placement.init_state(), placement.init_metrics()
    batch = train.make_batch(
        jax.random.PRNGKey(config.data.seed), config.data.batch_size, config.data.seq_len, config.model.vocab_size
    )
    batch = placement.place_batch(batch)
    state, metrics = jax.block_until_ready(compiled(state, metrics, batch))
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, metrics, batch))
        seconds.append(time.perf_counter() - start)
    return seconds


def runner_overhead(config: ml_collections.ConfigDict, compiled, placement, rounds: int = 4) -> dict[str, float]:
    """The runner's step time against a bare loop's around the same compiled step.

    Alternating rounds (bare, runner, bare, runner, ...) of a quarter of the timed steps each, so that a
    change of load on a shared machine shifts both alike; the overhead is the median over rounds of
    (runner median / bare median) - 1.
    """
    quiet = ml_collections.ConfigDict(config.to_dict())
    steps = max(2, config.train.steps // rounds)
    quiet.train.update(steps=steps, warmup_steps=0)
    quiet.profile.steps = 0
    bare, runner, ratios = [], [], []
    for _ in range(rounds):
        bare_round = bare_step_seconds(config, compiled, placement, steps)
        row: dict = {"name": "overhead", "tokens_per_step": tokens_per_step(config)}
        with tempfile.TemporaryDirectory() as scratch:  # the runner writes its scalars into the run directory
            run.execute(quiet, compiled, placement, pathlib.Path(scratch), row, progress=False)
        bare += bare_round
        runner += row["step_s_all"]
        ratios.append(np.median(row["step_s_all"]) / np.median(bare_round))
    return {
        "bare_step_s_median": float(np.median(bare)),
        "runner_step_s_median": float(np.median(runner)),
        "runner_overhead": float(np.median(ratios)) - 1,
    }


def measure_variant(config: ml_collections.ConfigDict, trace_dir: pathlib.Path) -> dict:
    """One variant as jaxscale.run measures it (timed + profiled steps, MFU, trace columns), then the
    runner's overhead against a bare loop around the same compiled step."""
    with compile_cache.watch() as cache:
        compiled, placement, _, compile_s = run.compile_step(config)
    row = run.base_row(config, trace_dir.name, trace_dir)
    row["compile_s"] = compile_s
    row.update(cache.columns())
    row.update(memory.compiled_memory(compiled))
    row.update(columns.after_compile(config, compiled, row))
    row.update(run.local_prediction(config, compiled))
    run.execute(config, compiled, placement, trace_dir, row, progress=False)
    row.update(columns.after_run(config, compiled, row))
    row["predicted_over_measured"] = predict.over_measured(row)
    row.update(runner_overhead(config, compiled, placement))
    return row


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return _pct(numerator / denominator) if numerator and denominator else "n/a"


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value / scale, spec)


# (header, cell) of each column of the variants' table; `roof` maps a dtype to its best roofline (FLOP/s).
COLUMNS = (
    ("variant", lambda r, roof: r["config.name"]),
    ("step s (median)", lambda r, roof: _num(r["step_s_median"], ".4f")),
    ("runner step s", lambda r, roof: _num(r["runner_step_s_median"], ".4f")),
    ("bare step s", lambda r, roof: _num(r["bare_step_s_median"], ".4f")),
    ("runner overhead", lambda r, roof: f"{r['runner_overhead']:+.1%}"),
    ("tokens/s", lambda r, roof: f"{r['tokens_per_s']:,.0f}"),
    ("model GFLOP/step", lambda r, roof: _num(r["analytic_model_flops_per_step"], ".2f", 1e9)),
    ("model GFLOP/s", lambda r, roof: _num(r["achieved_model_flops_per_s"], ".1f", 1e9)),
    ("MFU (own dtype)", lambda r, roof: _pct(r["mfu"])),
    ("of fp32 roofline", lambda r, roof: _ratio(r["achieved_model_flops_per_s"], roof["float32"])),
    ("adjacent fp32 roofline GFLOP/s", lambda r, roof: _num(r["adjacent_fp32_roofline_flops_per_s"], ".1f", 1e9)),
    (
        "of adjacent roofline",
        lambda r, roof: _pct(r["achieved_model_flops_per_s"] / r["adjacent_fp32_roofline_flops_per_s"]),
    ),
    ("predicted step s", lambda r, roof: _num(r.get("predicted_step_s"), ".4f")),
    ("predicted / measured", lambda r, roof: _num(r.get("predicted_over_measured"), ".2f")),
    ("trace step s", lambda r, roof: _num(r.get("trace_step_s"), ".4f")),
    ("matmul", lambda r, roof: _pct(r.get("trace_matmul_share"))),
    ("fusion", lambda r, roof: _pct(r.get("trace_fusion_share"))),
    ("dyn-update-slice", lambda r, roof: _pct(r.get("trace_dus_share"))),
    ("copy", lambda r, roof: _pct(r.get("trace_copy_share"))),
    ("control flow", lambda r, roof: _pct(r.get("trace_control_flow_share"))),
    ("remat", lambda r, roof: _pct(r.get("trace_remat_share"))),
    ("compiled/analytic memory", lambda r, roof: _num(r.get("compiled_to_analytic_peak_ratio"), ".2f")),
)


def markdown(rooflines: dict[str, tuple[float, str]], rows: list[dict], header: dict[str, str]) -> str:
    """The benchmark as markdown: context, roofline table, one row per variant."""
    roof = {dtype: value for dtype, (value, _) in rooflines.items()}
    fp32 = roof["float32"]
    lines = [f"# jaxscale bench: preset `{header['preset']}`", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| matmul roofline | GFLOP/s | source |", "|---|---|---|"]
    lines += [f"| {dtype} | {value / 1e9:.1f} | {source} |" for dtype, (value, source) in rooflines.items()]
    lines += ["", "| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, roof) for _, cell in COLUMNS) + " |" for r in rows]
    best = max(rows, key=lambda r: r["achieved_model_flops_per_s"] or 0.0)
    lines += [
        "",
        f"Best: `{best['config.name']}`, {best['achieved_model_flops_per_s'] / fp32:.1%} of the best fp32 matmul "
        f"roofline, {best['achieved_model_flops_per_s'] / best['adjacent_fp32_roofline_flops_per_s']:.1%} of the "
        "one measured around it.",
        "MFU (own dtype) divides the analytic model FLOP/s (6N + 12·L·H·Q·T per token, full attention) by the",
        "best measured roofline of the run's compute dtype (above); the saved rows' `mfu` is the same figure.",
        "Runner overhead: median over alternating",
        "rounds of the runner's median step over a bare loop's; 'step s' is the run's own median. The fp32",
        "roofline is measured around every variant too (adjacent: the better of before and after), because on a",
        "shared machine the load changes within minutes; the table's roofline is the best of all of them.",
    ]
    return "\n".join(lines) + "\n"


def bench(fv: flags.FlagValues) -> tuple[str, list[dict]]:
    """Runs the benchmark described by the flags; returns its markdown and the variants' result rows.

    The float32 roofline is measured again right before and after each variant; the variant's "adjacent"
    roofline is the better of the two (on a shared machine, load changes within minutes), and the table's
    float32 roofline is the best of all measurements, so "of fp32 roofline" is the stricter figure.
    """
    configs = [load_variant(fv.configs_dir, name, fv.preset, fv.steps, fv.set) for name in fv.variants]
    header = {
        "preset": fv.preset,
        "overrides": ", ".join(fv.set) or "none",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, malloc {memory.host_allocator()}",
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    best = {dtype: peaks.measure_matmul_flops(dtype, fv.matmul_size) for dtype in ("float32", "bfloat16")}
    for dtype, value in best.items():  # a cached roofline slower than this session's is stale: replaced
        _note_stale(peaks.record_matmul(dtype, fv.matmul_size, value), header)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    rows = []
    for config in configs:
        print(f"jaxscale bench: {config.name}:{fv.preset} ...", file=sys.stderr, flush=True)
        before = peaks.measure_matmul_flops("float32", fv.matmul_size)
        row = measure_variant(config, pathlib.Path(fv.trace_root) / f"{config.name}_{fv.preset}_{stamp}")
        row["adjacent_fp32_roofline_flops_per_s"] = max(before, peaks.measure_matmul_flops("float32", fv.matmul_size))
        best["float32"] = max(best["float32"], row["adjacent_fp32_roofline_flops_per_s"])
        rows.append(row)
    best["bfloat16"] = max(best["bfloat16"], peaks.measure_matmul_flops("bfloat16", fv.matmul_size))
    header["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    rooflines = {}
    for dtype, value in best.items():  # file the best in the cache, so later runs' MFU uses it if faster
        _note_stale(peaks.record_matmul(dtype, fv.matmul_size, value), header)
        rooflines[dtype] = (value, peaks.matmul_source(dtype, fv.matmul_size, f"this session, on {peaks.cpu_name()}"))
    for row in rows:
        row.update(utilization(row, rooflines))
    return markdown(rooflines, rows, header), rows


def _note_stale(note: str | None, header: dict[str, str]) -> None:
    """Says on stderr and in the table's header when this session found the cached roofline stale."""
    if note:
        print(f"jaxscale bench: {note}", file=sys.stderr, flush=True)
        header["roofline cache"] = "; ".join(filter(None, (header.get("roofline cache"), note)))


def utilization(row: dict, rooflines: dict[str, tuple[float, str]]) -> dict[str, object]:
    """A row's MFU and HFU against the session's best roofline of its compute dtype, as the table has them.

    One definition for the saved rows and the markdown: MFU = analytic model FLOP/s / the best matmul
    roofline of the run's dtype measured in this session (float16 runs: none is measured, so null).
    """
    value, source = rooflines.get(row["config.model.dtype"], (None, "no roofline measured for this dtype"))
    step_s, hardware = row.get("step_s_median"), row.get("analytic_hardware_flops_per_step")
    achieved = row.get("achieved_model_flops_per_s")
    return {
        "peak_flops_per_s": value,
        "peak_flops_source": f"best of this bench session: {source}" if value else source,
        "mfu": achieved / value if achieved and value else None,
        "hfu": hardware / step_s / value if hardware and step_s and value else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        parse_flags(fv, argv)
        if fv.preset not in PRESETS:
            raise ConfigError(f"--preset: unknown {fv.preset!r}; allowed: {', '.join(PRESETS)}")
        if fv.matmul_size <= 0 or (fv.steps is not None and fv.steps <= 0):
            raise ConfigError("--matmul_size and --steps: must be positive integers")
        compile_cache.set_enabled(fv.compilation_cache)
        compile_cache.configure()
        text, rows = bench(fv)
    except (UsageError, ConfigError) as error:
        return fail(str(error))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    output = pathlib.Path(fv.output or f"experiments/results/bench/bench_{fv.preset}_{stamp}.md")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    output.with_suffix(".jsonl").write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    print(text)
    print(f"saved: {output} (rows: {output.with_suffix('.jsonl')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fit planner: `python -m jaxscale.fit --config <file>:<preset> [--target h100] [--memory 20GiB]`.

For each remat choice, the largest per-device minibatch whose compiled plan fits, found by compilation alone
(jaxscale.plan.fit_search); a table, a recommendation, and rows in experiments/results/<fit name>/results.jsonl with
the sweep's conventions (resumable, failures as rows, read by `load_results` and `python -m jaxscale.report`).
Each probe's plan is kept in probes/results.jsonl beside it, so a killed or repeated fit reuses them.
`--measure` then runs each fitting choice at its largest minibatch on this machine's device (in its own
process, as a sweep variant) and recommends the fastest measured tokens/s.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from jaxscale.cli import (
    Usage,
    UsageError,
    check_cost_flags,
    define_config_flag,
    define_cost_flags,
    fail,
    parse_bytes,
    parse_config_flags,
    print_help,
    wants_help,
)
from jaxscale.config import ConfigError, flatten, mesh_shape, mesh_text
from jaxscale.measure import params
from jaxscale.plan import budget as budget_lib
from jaxscale.plan import cost, fit_levers, fit_recommend, fit_search, frontier, gpu_plan, targets
from jaxscale.plan.probe_cache import ProbeCache
from jaxscale.plan.probe_cache import plain as _plain
from jaxscale.sweep import runner
from jaxscale.sweep.results import ResultsFile
from jaxscale.sweep.sweep_file import Sweep, Variant

GIB = 2**30
_MEASURED = ("step_s_median", "step_s_p90", "tokens_per_s", "device_peak_bytes", "mfu", "run_dir", "trace_dir")


def _flag_values(argv: Sequence[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    define_config_flag(fv, argv, help_text="Config file and preset: configs/bf16_remat.py:seed (or :llama3.2-1b).")
    flags.DEFINE_string(
        "target", None, f"Plan for this GPU, no GPU needed ({', '.join(targets.TARGETS)} or a .txtpb); needs the "
        "gpu-plan extra. Without it the local compiler plans (on a CPU only a proxy for a GPU's plan).", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "devices", None, "With --target: plan for this many target GPUs (8 per host); the config's mesh must use "
        "them all (e.g. --config.mesh.fsdp=8). The minibatch and the budget are per device.", lower_bound=1,
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_enum(
        "rank", None, ("predicted", "tokens"), "How the recommendation ranks the fitting choices: predicted "
        "(the predicted tokens/s of the target's compiled program; the default with --target) or tokens (most "
        "tokens per step; the default without). --measure ranks by measured tokens/s.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_string(
        "memory", None, "Memory budget per device for the program's buffers (20GiB); default: with --target, "
        "what JAX's allocator gets of the target's memory (--mem_fraction), else the local device's limit.",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_float(
        "mem_fraction", None, "With --target: the fraction of the GPU's memory JAX's allocator takes (what "
        "XLA_CLIENT_MEM_FRACTION sets on the GPU; default: that variable here, else JAX's 0.75). The answer prints "
        "the setting it needs.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_float("headroom", 0.0, "Fraction of the budget kept free (0.1 = plan within 90%).", flag_values=fv)
    flags.DEFINE_list(
        "remat", list(fit_search.REMAT_CHOICES), "Remat choices to compare, or `frontier`: walk the per-activation "
        "policies as MaxText's estimator does (jaxscale/plan/frontier.py, docs/fit.md).", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "frontier_compiles", frontier.DEFAULT_MAX_COMPILES, "With --remat frontier: probes of the whole walk (each "
        "a compile unless kept from an earlier fit); the answer says when this bound cut the walk.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_list(
        "frontier_places", list(frontier.DEFAULT_PLACES), "With --remat frontier: the places activations move to, "
        "in turn (offload,device as MaxText; device alone skips offloading).", flag_values=fv,
    )  # fmt: skip
    methods = ", ".join(fit_search.FINETUNE_CHOICES)
    flags.DEFINE_list(
        "finetune", [], f"Fine-tuning methods to compare, each with every --remat choice ({methods}; "
        "docs/finetune.md); default: the config as given.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_list(
        "precision", [], f"Matmul precisions to compare side by side, each with every --remat choice "
        f"({', '.join(fit_search.PRECISION_CHOICES)}; fp8 needs a target with FP8 tensor cores: docs/fp8.md); "
        "default: the config as given.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_enum("gemm", "both", gpu_plan.GEMM_CHOICES, "With --target: GEMM modes planned.", flag_values=fv)
    flags.DEFINE_enum(
        "xla_limit", "respect", ("respect", "ignore"), "respect: a plan with XLA's 'Can't reduce memory use "
        "below' warning does not fit (conservative); ignore: the plan's peak alone decides.", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer("max_minibatch", fit_search.DEFAULT_LIMIT, "Largest minibatch tried.", flag_values=fv)
    flags.DEFINE_integer("max_compiles", fit_search.DEFAULT_MAX_COMPILES, "Compiles per remat choice.", flag_values=fv)
    flags.DEFINE_bool(
        "measure", False, "Run each fitting choice at its largest minibatch here, time it.", flag_values=fv
    )
    define_cost_flags(fv)
    flags.DEFINE_bool(
        "rerun", False, "Search again even where a current row exists, compiling every plan again.", flag_values=fv
    )
    flags.DEFINE_string("output_root", ".", "Root of experiments/results/ and traces/.", flag_values=fv)
    flags.DEFINE_string("name", None, "Fit name (default fit_<config>_<preset>_<target or backend>).", flag_values=fv)
    flags.DEFINE_bool("quiet", False, "No line per remat choice; the table is printed.", flag_values=fv)
    flags.DEFINE_bool(
        "what_would_fit", True, "When nothing fits, compile the levers (jaxscale/plan/fit_levers.py) cheapest first "
        "and name the first that fits (a compile each); --nowhat_would_fit skips them.", flag_values=fv,
    )  # fmt: skip
    return fv


def budget(target: str | None, memory: str | None, mem_fraction: float | None = None) -> budget_lib.Budget:
    """The budget per device and its parts: with a target, what its runtime gives the program's buffers
    (jaxscale.plan.budget); else --memory or the local device's bytes_limit (JAX's pool there).

    Raises:
      UsageError: no budget can be known (the CPU backend without --memory), or --mem_fraction without a target.
      gpu_plan.PlanFlagError: a fraction or --memory the target cannot give.
    """
    size = None if memory is None else parse_bytes(memory, "--memory")
    if target is not None:
        spec = targets.get_target(target)
        return budget_lib.for_target(spec.name, spec.device_memory_size, mem_fraction, size)
    if mem_fraction is not None:
        raise UsageError("--mem_fraction: sets the share of a --target's memory JAX's allocator takes; add --target, "
                         "or give the budget with --memory")  # fmt: skip
    if size is not None:
        return budget_lib.Budget(size, "--memory")
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise UsageError(
            f"--memory: required without --target on the {jax.default_backend()} backend, which has no device "
            "memory to fit (e.g. --memory 24GiB), or plan for a GPU with --target a5000"
        )
    return budget_lib.Budget(int(stats["bytes_limit"]), f"bytes_limit of local {jax.devices()[0].device_kind}")


def _question(config: ml_collections.ConfigDict, settings: dict[str, Any]) -> str:
    """What a row answers, as stable text: the base config and the fit settings (a changed one reruns)."""
    base = {k: v for k, v in flatten(config).items() if k not in ("config.name", "config.preset_source")}
    return json.dumps({"config": base, **settings}, sort_keys=True, default=str)


def fit_choice(config, choice: str, plan: fit_search.Planner, cache: ProbeCache, settings: dict, limits: dict) -> dict:
    """Searches one remat choice (starting at the analytic model's answer) and returns its row."""
    start_time, reused_before = time.perf_counter(), cache.reused
    usable = settings["fit_usable_bytes"]
    # A GPU plan fits only below XLA's own limit, which starts from 80% of the device's memory (XLA's
    # GPU compiler's base limit): aim the analytic start there; the row keeps the analytic answer for `usable`.
    xla = settings["fit_target"] is not None and settings["fit_xla_limit"] == "respect"
    aim = min(usable, int(0.8 * settings["fit_target_memory_bytes"])) if xla else usable
    start = max(1, fit_search.analytic_largest_minibatch(config, choice, aim, limits["limit"]))
    respect = settings["fit_xla_limit"] == "respect"
    search = fit_search.search_largest(
        lambda m: cache.measure(plan, config, choice, usable, m, respect),
        usable,
        start,
        limits["limit"],
        limits["max_compiles"],
        fit_search.minibatch_step(config),  # a pipeline's minibatches are multiples of its microbatches
    )
    row = fit_search.fit_row(config, choice, search, settings)
    row.update(fit_probes_reused=cache.reused - reused_before, fit_wall_s=time.perf_counter() - start_time)
    return row


def measure_rows(rows: list[dict], fv: flags.FlagValues, name: str, output_root: pathlib.Path) -> None:
    """Runs each fitting choice at its largest minibatch in its own `python -m jaxscale.run` process, in place."""
    path, _, preset = config_flags.get_config_filename(fv["config"]).partition(":")
    overrides = dict(config_flags.get_override_values(fv["config"]))
    for row in rows:
        if row.get("status") != "ok" or row.get("tokens_per_s") is not None:
            continue
        _, remat, policy = fit_search.remat_choice(row["fit_choice"])
        method = row.get("fit_finetune")  # what a --finetune method set, read back from its row
        method = {f: row[f"config.{f}"] for f in fit_search.finetune_fields(method)} if method else {}
        precision = fit_search.PRECISION_CHOICES.get(row.get("fit_precision"), ("", {}))[1]
        changes = {**overrides, **method, **precision, "model.remat": remat, "model.remat_policy": policy}
        changes["data.batch_size"] = row["config.data.batch_size"]
        variant = Variant(row["variant"].replace(":", "_"), changes, ml_collections.ConfigDict())
        sweep = Sweep(f"{name}_measure", pathlib.Path(path), preset, variant.name, (variant,))
        measured = runner.run_variant(sweep, variant, output_root, [], timeout_s=runner.DEFAULT_TIMEOUT_S)
        row["measure_status"], row["measure_error"] = measured.get("status"), measured.get("error")
        row.update({k: measured.get(k) for k in _MEASURED})


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.3g}"


def _label(row: dict) -> str:
    """The row's remat choice, after its fine-tuning method and precision where --finetune / --precision chose."""
    remat = row.get("fit_remat", row.get("variant"))
    method, precision = row.get("fit_finetune"), row.get("fit_precision")
    parts = [fit_search.FINETUNE_CHOICES[method][0]] if method in fit_search.FINETUNE_CHOICES else []
    parts += [precision] if precision in fit_search.PRECISION_CHOICES else []
    return "; ".join([*parts, remat])


def format_table(rows: list[dict]) -> str:
    """One line per remat choice: largest minibatch, tokens/step, the plan and the analytic estimate there."""
    head = ("choice", "largest minibatch", "tokens/step", "plan GiB", "analytic GiB", "analytic says", "compiles",
            "s", "tokens/s (predicted)", "tokens/s (measured)")  # fmt: skip
    lines = [head]
    for r in rows:
        largest = r.get("fit_largest_minibatch")
        shown = f"{largest}" + ("" if r.get("fit_search_complete", True) else "+ (search cut short)")
        lines.append((
            _label(r), shown if largest else f"none ({r.get('status')})",
            f"{r['tokens_per_step']:,}" if largest else "-", _gib(r.get("compiled_peak_bytes")),
            _gib(r.get("analytic_peak_bytes")), str(r.get("analytic_largest_minibatch")),
            f"{r.get('fit_compiles')} ({r.get('fit_probes_reused', 0)} reused)", f"{r.get('fit_wall_s', 0):.0f}",
            "-" if not largest or r.get("predicted_tokens_per_s") is None else f"{r['predicted_tokens_per_s']:,.0f}",
            "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}",
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _header(config, settings: dict) -> str:
    source = settings["fit_plan_source"]
    if settings.get("fit_devices", 1) > 1:
        mesh = f"mesh {settings['fit_mesh']} ({mesh_shape(config).axes_text})"
        source += f" x{settings['fit_devices']}, {mesh}; per device"
    text = (
        f"fit {config.name}:{config.preset}, seq {config.data.seq_len}, {config.train.num_minibatches} minibatch(es) "
        f"per step: {source}; budget {_gib(settings['fit_budget_bytes'])} GiB ({settings['fit_budget_source']}), "
        f"usable {_gib(settings['fit_usable_bytes'])} GiB (headroom {settings['fit_headroom']:.0%})"
    )
    if settings["fit_target"] is not None:
        text += f"; XLA's own limit: {settings['fit_xla_limit']}\n  {run_settings(settings)}"
    if settings["fit_target"] is None and jax.default_backend() == "cpu":
        text += "\n  note: a CPU plan is only a proxy for a GPU's (1.3-3x off in bf16); use --target to plan for a GPU"
    return "\n".join([text, *(f"  shape warning: {w}" for w in params.shape_warnings(config.model))])


def run_settings(settings: dict) -> str:
    """What an answer for a GPU target needs to run as planned: JAX's default allocator, or the setting."""
    reserve = settings.get("fit_context_reserve_bytes")
    kept = f"; {_gib(reserve)} GiB outside it assumed enough for the CUDA context, docs/fit.md" if reserve else ""
    if settings.get("fit_run_env"):
        return f"to run as planned: set {settings['fit_run_env']} (JAX's allocator fraction{kept})"
    default = f"{budget_lib.DEFAULT_MEM_FRACTION:.0%}"
    return f"to run as planned: JAX's default allocator settings (it takes {default} of the memory{kept})"


def _known_remat_choice(choice: str) -> bool:
    try:
        fit_search.remat_choice(choice)
    except KeyError:
        return False
    return True


def run_fit(fv: flags.FlagValues, config: ml_collections.ConfigDict) -> tuple[list[dict], pathlib.Path, dict]:
    """Searches every selected remat choice that has no current row; returns all rows, the results path, and what
    the answer needs to try levers (the questions' configs, the planner, the budget)."""
    walking = frontier.NAME in fv.remat
    unknown = [c for c in fv.remat if not _known_remat_choice(c) and c != frontier.NAME]
    if unknown:
        raise UsageError(f"--remat: unknown {', '.join(unknown)}; allowed: {', '.join(fit_search.REMAT_CHOICES)}, "
                         "or per_activation:<activation>=<device|offload|remat>+... (docs/fit.md), or "
                         f"{frontier.NAME} alone")  # fmt: skip
    if walking:
        frontier.check_flags(fv.remat, fv.frontier_places, fv.frontier_compiles)
    unknown = [m for m in fv.finetune if m not in fit_search.FINETUNE_CHOICES]
    if unknown:
        raise UsageError(f"--finetune: unknown {', '.join(unknown)}; allowed: "
                         f"{', '.join(fit_search.FINETUNE_CHOICES)}")  # fmt: skip
    unknown = [p for p in fv.precision if p not in fit_search.PRECISION_CHOICES]
    if unknown:
        raise UsageError(f"--precision: unknown {', '.join(unknown)}; allowed: "
                         f"{', '.join(fit_search.PRECISION_CHOICES)}")  # fmt: skip
    methods: dict[tuple[str | None, str | None], ml_collections.ConfigDict] = {(None, None): config}
    try:
        if fv.finetune:
            methods = {(m, None): fit_search.with_finetune(config, m) for m in fv.finetune}
        if fv.precision:
            methods = {(m, p): fit_search.with_precision(c, p) for (m, _), c in methods.items() for p in fv.precision}
    except ConfigError as error:
        raise UsageError(f"--finetune / --precision: {error}") from None
    if not 0 <= fv.headroom < 1:
        raise UsageError(f"--headroom: must be in [0, 1), got {fv.headroom:g}")
    if fv.max_minibatch < 1 or fv.max_compiles < 1:
        raise UsageError("--max_minibatch and --max_compiles: must be >= 1")
    gpu_plan.check_target_flag(fv.target, plan=True, gemm=fv.gemm, attention=config.model.attention)
    gpu_plan.check_flash_blocks(config, fv.target)
    for method_config in methods.values():  # the config as given, or each method's and precision's
        gpu_plan.check_fp8(method_config, fv.target)
    check_cost_flags(fv)
    if fv.devices is not None or mesh_shape(config).devices > 1:
        if fv.target is None:
            raise UsageError(
                f"--devices / mesh {mesh_text(config)}: the fit planner plans a mesh for a GPU target only; add "
                "--target (e.g. --target h100 --devices 8), or use a 1x1x1 mesh for this machine's compiler"
            )
        if mesh_shape(config).devices != (fv.devices or 1):  # a 1x1x1 mesh would plan one of the N GPUs
            raise UsageError(
                f"mesh: {mesh_shape(config).axes_text} = {mesh_text(config)} plans {mesh_shape(config).devices} "
                f"GPU(s), "
                f"but --devices is {fv.devices or 1}; choose sizes whose product is {fv.devices or 1} "
                f"(e.g. --config.mesh.fsdp={fv.devices or 1})"
            )
        gpu_plan.check_devices_flag(config, fv.target, fv.devices)
    if fv.rank == "predicted" and fv.target is None:
        raise UsageError("--rank predicted: needs --target (step times are predicted for a GPU); or --rank tokens")
    devices = fv.devices or 1
    given = budget(fv.target, fv.memory, fv.mem_fraction)
    total = given.bytes
    spec = targets.get_target(fv.target) if fv.target else None
    settings = {
        "fit_target": spec.name if spec else None, "fit_gemm": fv.gemm if spec else None,
        "fit_target_memory_bytes": spec.device_memory_size if spec else None,
        **given.columns(), "fit_headroom": fv.headroom,
        "fit_xla_limit": fv.xla_limit, "fit_devices": devices, "fit_mesh": mesh_text(config),
        "fit_rank": fv.rank or ("predicted" if spec else "tokens"),
        "fit_usable_bytes": int(total * (1 - fv.headroom)),
    }  # fmt: skip
    local = f"the local {jax.default_backend()} compiler's plan"
    settings["fit_plan_source"] = f"XLA's deviceless plan for {spec.name}" if spec else local
    if fv.measure:
        _check_measurable(spec)
    limits = {"limit": fv.max_minibatch, "max_compiles": fv.max_compiles}
    if walking:  # what a frontier row answers includes the walk's bound and steps
        limits.update(frontier_compiles=fv.frontier_compiles, frontier_places=list(fv.frontier_places))
    where = pathlib.Path(spec.name).stem if spec else jax.default_backend()  # a .txtpb target: its file's stem
    name = fv.name or f"fit_{config.name}_{config.preset}_{where}" + ("_frontier" if walking else "")
    name += f"_x{devices}" if devices > 1 and not fv.name else ""
    output_root = pathlib.Path(fv.output_root)
    store = ResultsFile(output_root / "experiments" / "results" / name)
    # What a row answers: the config (its mesh included, which --devices must match) and the search's settings;
    # how the recommendation ranks does not change an answer.
    asked = {k: v for k, v in settings.items() if k not in ("fit_rank", "fit_devices", "fit_mesh")}
    plan_keys = ("fit_target", "fit_gemm", "fit_plan_source")
    respect = fv.xla_limit == "respect"
    usable = settings["fit_usable_bytes"]
    plan = fit_search.target_planner(spec.name, fv.gemm, usable, respect, devices) if spec else fit_search.local_planner
    if not fv.quiet:
        print(_header(config, settings))
    wanted: dict[str, str] = {}  # variant -> the question it answers
    with store.locked():
        for (method, precision), method_config in methods.items():
            question = _question(method_config, {**asked, **limits})
            plan_question = _question(method_config, {k: settings[k] for k in plan_keys})
            cache = ProbeCache(ResultsFile(store.directory / "probes"), plan_question, fresh=fv.rerun)
            recorded = {r.get("variant"): r for r in store.rows() if r.get("fit_question") == question}

            def answer(choice, choice_limits, method=method, precision=precision, config=method_config,
                       question=question, recorded=recorded, cache=cache) -> dict:  # fmt: skip
                """One choice's row: recorded for this question, else searched within choice_limits and recorded."""
                variant = ":".join(part for part in (method, precision, choice) if part)
                wanted[variant] = question
                if variant in recorded and not fv.rerun:
                    if not fv.quiet:
                        print(f"  {variant}: already answered (--rerun to search again)")
                    return recorded[variant]
                chosen = {**settings, "fit_finetune": method, "fit_precision": precision}
                row = fit_choice(config, choice, plan, cache, chosen, choice_limits)
                row.update(sweep=name, variant=variant, baseline=next(iter(wanted)), fit_question=question,
                           plan_only=True)  # fmt: skip
                store.record(json.loads(json.dumps(row, default=_plain)))
                if not fv.quiet:
                    print(f"  {variant}: largest minibatch {row['fit_largest_minibatch']} ({row['fit_compiles']} "
                          f"compiles, {row['fit_wall_s']:.0f} s)", flush=True)  # fmt: skip
                return row

            if walking:
                walked = frontier.walk_config(method_config, answer, fv.frontier_places, limits)
                for row in walked:
                    store.record(json.loads(json.dumps(row, default=_plain)))
            else:
                for choice in fv.remat:
                    answer(choice, limits)
        rows = [r for r in store.rows() if wanted.get(r.get("variant")) == r.get("fit_question")]
        if fv.measure:
            measure_rows(rows, fv, name, output_root)
        for row in rows:  # at the largest minibatch: measured speed where --measure ran it, else predicted
            row.update(cost.cost_columns(row, fv.train_tokens, fv.gpu_hour_usd) if row.get("status") == "ok" else {})
        if fv.measure or fv.train_tokens is not None:
            for row in rows:
                store.record(row)
        store.write_csv()
    order = {v: i for i, v in enumerate(wanted)}
    fraction = settings.get("fit_mem_fraction")
    at = (lambda f: int(budget(fv.target, None, f).bytes * (1 - fv.headroom))) if spec and fv.memory is None else None
    context = {"configs": methods, "plan": plan, "usable": usable, "budget_at": at, "fraction": fraction,
               "respect": respect, "walking": walking}  # fmt: skip
    return sorted(rows, key=lambda r: order[r["variant"]]), store.path, context


def _what_would_fit(rows: list[dict], config: ml_collections.ConfigDict, context: dict) -> str:
    """The cheapest lever that makes the smallest of these choices fit at minibatch 1 (jaxscale.plan.fit_levers)."""
    planned = [r for r in rows if r.get("compiled_peak_bytes")]
    if not planned:
        return "what would fit: not tried (no plan compiled)"
    smallest = min(planned, key=lambda r: r["compiled_peak_bytes"])
    found = fit_levers.what_would_fit(config, smallest["fit_choice"], context["plan"], context["usable"],
                                      context["budget_at"], context["fraction"], context["respect"])  # fmt: skip
    if found is None:
        shared = context["budget_at"] is not None and context["fraction"] is not None
        names = ", ".join(lever.name for lever in fit_levers.applicable(config, shared, context["fraction"]))
        smallest = fit_search.minibatch_step(config)  # 1, or a pipeline's microbatches
        return f"what would fit: none of the levers ({names}), alone or together, at minibatch {smallest}"
    return fit_levers.answer(*found)


def _frontier_text(rows: list[dict], path: pathlib.Path) -> str:
    """The frontier's table and notes per fine-tuning method and precision; its figure written beside the rows."""
    from jaxscale.report import frontier_report  # matplotlib: only when a frontier is drawn

    texts = []
    for group in dict.fromkeys((r.get("fit_finetune"), r.get("fit_precision")) for r in rows):
        chosen = [r for r in rows if (r.get("fit_finetune"), r.get("fit_precision")) == group]
        named = [fit_search.FINETUNE_CHOICES[group[0]][0]] if group[0] else []
        named += [fit_search.PRECISION_CHOICES[group[1]][0]] if group[1] else []
        head = [f"frontier for {', '.join(named)}:"] if named else []
        texts += [*head, frontier.format_table(chosen), *(f"  {line}" for line in frontier.notes(chosen))]
    figure = frontier_report.write_figure(rows, path.parent / "frontier.png")
    return "\n".join([*texts, f"figure: {figure}"])


def _check_measurable(spec: targets.GpuTarget | None) -> None:
    kind = jax.devices()[0].device_kind
    if spec is not None and kind != spec.device_kind:
        raise UsageError(
            f"--measure: runs on this machine's device ({kind}), not on target {spec.name} ({spec.device_kind}); "
            "measure on a machine that has that GPU, or drop --measure for the plan alone"
        )


USAGE = Usage(
    command="python -m jaxscale.fit --config CONFIG.py:PRESET [--target GPU] [--memory SIZE] [flags]",
    summary="For each remat choice, the largest per-device minibatch whose compiled plan fits the memory budget, "
    "found by compilation alone (no GPU needed with --target); prints a table and a recommendation and keeps the "
    "rows (resumable) in experiments/results/<fit name>/; --measure then times each fitting choice here.",
    examples=(
        "python -m jaxscale.fit --config configs/bf16_remat.py:seed --target a5000",
        "python -m jaxscale.fit --config configs/bf16_remat.py:llama3.2-1b --target l4 "
        "--config.optimizer.name=adafactor --memory 20GiB --headroom 0.05",
        "python -m jaxscale.fit --config configs/bf16_remat.py:tiny --memory 4MiB",
        "python -m jaxscale.fit --config configs/bf16_remat.py:llama3.2-1b --target a5000 --remat frontier "
        "--config.model.attention=flash --mem_fraction 0.95",
        "python -m jaxscale.fit --config configs/bf16_remat.py:llama3.1-8b --config.data.seq_len=8192 "
        "--config.mesh.fsdp=8 --target h100 --devices 8",
    ),
    notes=(
        "Without --target the local compiler plans (on a CPU only a proxy for a GPU's plan) and --memory is "
        "required on a CPU. Rows: <output_root>/experiments/results/<fit name>/results.jsonl (python -m "
        "jaxscale.report reads them); each probe's plan in probes/ beside it. See docs/fit.md.",
        "Config fields: every field, with what it means, is in jaxscale/config/defaults.py (base_config); python -m "
        "jaxscale.run --config CONFIG.py:PRESET --show_config lists them with their values. Override any field "
        "as --config.GROUP.FIELD=VALUE, e.g. --config.optimizer.name=adafactor.",
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: the fit table and recommendation; exit 0, or 2 for bad input."""
    argv = list(sys.argv if argv is None else argv)
    fv = _flag_values(argv)
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        config = parse_config_flags(fv, argv)
        rows, path, context = run_fit(fv, config)
    except (UsageError, gpu_plan.PlanFlagError) as error:
        return fail(str(error))
    except KeyboardInterrupt:
        print("jaxscale: interrupted; finished rows and probes are kept, run the same command to resume")
        return 130
    print(_frontier_text(rows, path) if context["walking"] else format_table(rows))
    for row in rows:
        if cost.cost_text(row):
            print(f"  {_label(row)}: {cost.cost_text(row)}")
    rank = fv.rank or ("predicted" if fv.target else "tokens")
    groups = dict.fromkeys((row.get("fit_finetune"), row.get("fit_precision")) for row in rows)
    for method, precision in groups:  # one answer per fine-tuning method and precision
        chosen = [r for r in rows if (r.get("fit_finetune"), r.get("fit_precision")) == (method, precision)]
        best, why = fit_recommend.recommend(chosen, fv.measure, rank)
        named = [fit_search.FINETUNE_CHOICES[method][0]] if method else []
        named += [fit_search.PRECISION_CHOICES[precision][0]] if precision else []
        which = f"recommendation for {', '.join(named)}" if named else "recommendation"
        if best is None:
            print(f"{which}: none: {why}; see the rows' error (the smallest plan) for what it needs")
            if fv.what_would_fit:
                print(f"  {_what_would_fit(chosen, context['configs'][(method, precision)], context)}", flush=True)
        else:
            run_env = f"; run it with {best['fit_run_env']} set" if best.get("fit_run_env") else ""
            print(f"{which}: {best['fit_remat']} at minibatch {best['fit_largest_minibatch']}: {why}{run_env}")
    print(f"results: {path} (probes in {path.parent / 'probes'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The docs' tables from the committed rows: `python -m jaxscale.report.docs_tables [--check]`.

A table in a doc sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; TABLES says, for each NAME, the
doc, the committed rows (and sweep files) it is written from, and the function that writes it. The command
rewrites every table from its rows; with --check it only compares, and names each table that differs.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable, Sequence

from absl import flags

from jaxscale.cli import Usage, UsageError, fail, no_arguments, print_help, wants_help
from jaxscale.report import (
    gpu_tables,
    measurements_tables,
    mesh_tables,
    models_tables,
    moe_tables,
    pipeline_tables,
    predict_tables,
    published_memory,
)
from jaxscale.sweep.results import read_rows

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = "experiments/results"
EXIT_STALE = 1


@dataclasses.dataclass(frozen=True)
class DocTable:
    """One generated table: where it lives and what it is written from.

    Attributes:
      name: the NAME of its markers.
      doc: the doc holding it, relative to the repository.
      sources: relative paths its function is called with, in order: committed rows (a results.jsonl), or a
        sweep file with its preset (`experiments/mesh.py:cpu`).
      render: (the sources' absolute paths) -> the markdown table.
    """

    name: str
    doc: str
    sources: tuple[str, ...]
    render: Callable[..., str]


def _published(rows: pathlib.Path, runs: pathlib.Path) -> str:
    """The runs' table as `python -m jaxscale.published` writes it: in the runs file's order, its runs only."""
    from jaxscale import published  # imports JAX: only when this table is written

    order = {run["id"]: n for n, run in enumerate(published.load_runs(runs))}
    found = sorted((row for row in read_rows(rows) if row.get("variant") in order), key=lambda r: order[r["variant"]])
    return published.format_table(found, published.load_runs(runs))


def _frontier(rows: pathlib.Path) -> str:
    """A remat frontier's table (`fit --remat frontier`), as jaxscale.report.frontier_report writes it."""
    from jaxscale.report import frontier_report  # imports matplotlib: only when this table is written

    return frontier_report.frontier_table(rows)


def _sweep(name: str, experiment: str) -> tuple[str, str]:
    return f"{RESULTS}/{name}/results.jsonl", experiment


_LAYOUTS_8 = _sweep("layouts_llama3.1-8b_plan_h100_triton_x8", "experiments/layouts.py:llama3.1-8b")
_LAYOUTS_64 = _sweep("layouts_x64_llama3.1-8b_plan_h100_triton_x64", "experiments/layouts_x64.py:llama3.1-8b")
_PUBLISHED = (f"{RESULTS}/published/results.jsonl", "experiments/published_runs.json")
_LONG = _sweep("long_context_llama3.1-8b_plan_h100_triton_x8", "experiments/long_context.py:llama3.1-8b")
_PIPELINE = {gpus: _sweep(f"pipeline_{preset}_plan_h100_cublas_x{gpus}", f"experiments/pipeline.py:{preset}")
             for preset, gpus in (("llama3.1-8b", 8), ("llama3.1-70b", 64), ("llama3.1-405b", 512))}  # fmt: skip


def _fits(*names: str) -> tuple[str, ...]:
    return tuple(f"{RESULTS}/fit_bf16_remat_{name}/results.jsonl" for name in names)


_LLAMA1B = _fits("llama3.2-1b_a5000", "llama3.2-1b_l4", "llama3.2-1b_adafactor_a5000", "llama3.2-1b_adafactor_l4",
                 "llama3.2-1b_a5000_xla_ignore", "llama3.2-1b_l4_xla_ignore",
                 "llama3.2-1b_adafactor_a5000_xla_ignore")  # fmt: skip
_LLAMA1B_FLASH = _fits("llama3.2-1b_adafactor_flash_a5000", "llama3.2-1b_adafactor_flash_l4",
                       "llama3.2-1b_adafactor_a5000", "llama3.2-1b_adafactor_l4")  # fmt: skip
_MODELS = "docs/models.md"
_PREDICT = "docs/predict.md"


def _cpu(name: str, file: str = "results.jsonl") -> str:
    return f"{RESULTS}/seed_table_cpu_{name}/{file}"


_CALIBRATE = (_cpu("calibrate"), _cpu("calibrate", "calibration.jsonl"))
_QUIET_A = _cpu("calibrate_a", "calibration_cell.jsonl")
_SEED_A5000 = f"{RESULTS}/seed_table_seed_plan_a5000/results.jsonl"
_TCMALLOC_D = _cpu("tcmalloc_d", "calibration_cell.jsonl")

TABLES: tuple[DocTable, ...] = (
    DocTable("layouts-8xh100", "docs/mesh.md", _LAYOUTS_8, mesh_tables.layouts_table),
    DocTable("layouts-64xh100", "docs/mesh.md", _LAYOUTS_64, mesh_tables.layouts_table),
    DocTable("layout-answers", "docs/mesh.md", (*_LAYOUTS_8, *_LAYOUTS_64), mesh_tables.layout_answers_table),
    DocTable("long-context", "docs/mesh.md", _LONG, mesh_tables.long_context_table),
    DocTable("long-context-answers", "docs/mesh.md", _LONG, mesh_tables.long_context_answers_table),
    *(DocTable(f"pipeline-{gpus}xh100", "docs/mesh.md", sources, pipeline_tables.pipeline_table)
      for gpus, sources in _PIPELINE.items()),  # fmt: skip
    DocTable("pipeline-schedules-64xh100", "docs/mesh.md", _PIPELINE[64], pipeline_tables.schedules_table),
    DocTable("mesh-cpu", "docs/mesh.md", _sweep("mesh_cpu", "experiments/mesh.py:cpu"), mesh_tables.cpu_mesh_table),
    DocTable("mesh-a5000", "docs/mesh.md", _sweep("mesh_seed_plan_a5000_x8", "experiments/mesh.py:seed"),
             mesh_tables.gpu_mesh_table),  # fmt: skip
    DocTable("mesh-h100", "docs/mesh.md", _sweep("mesh_seed_plan_h100_x8", "experiments/mesh.py:seed"),
             mesh_tables.gpu_mesh_table),  # fmt: skip
    DocTable("published", "docs/published.md", _PUBLISHED, _published),
    DocTable("published-memory", "docs/published.md", _PUBLISHED, published_memory.published_memory_table),
    DocTable("fp8-h200", "docs/fp8.md", tuple(f"{RESULTS}/fp8_{model}_{kind}h200/results.jsonl"
                                              for model in ("seed", "llama3.2-1b") for kind in ("plan_", "")),
             gpu_tables.fp8_table),  # fmt: skip
    DocTable("fit-fp8-llama3.1-8b-h100", "docs/fp8.md",
             (f"{RESULTS}/fit_precision_llama3.1-8b_flash_h100_x8/results.jsonl",), gpu_tables.precision_fit_table),
    *(DocTable(f"fit-levers-llama3.1-8b-{gpu}", "docs/finetune.md",
               (f"{RESULTS}/finetune_levers_llama3.1-8b_{gpu}_mem95/results.jsonl",), gpu_tables.precision_fit_table)
      for gpu in ("h100", "rtx4090")),  # fmt: skip
    *(DocTable(f"fit-bf16-weights-llama3.1-8b-{gpu}", "docs/finetune.md",
               (f"{RESULTS}/finetune_bf16_llama3.1-8b_{gpu}_mem95/results.jsonl",), gpu_tables.precision_fit_table)
      for gpu in ("h100", "rtx4090")),  # fmt: skip
    *(DocTable(f"fit-in-backward-llama3.1-8b-{gpu}", "docs/finetune.md",
               (f"{RESULTS}/finetune_in_backward_llama3.1-8b_{gpu}_mem95/results.jsonl",),
               gpu_tables.precision_fit_table)
      for gpu in ("h100", "rtx4090")),  # fmt: skip
    DocTable("fit-paged-llama3.1-8b-rtx4090", "docs/finetune.md",
             (f"{RESULTS}/finetune_paged_llama3.1-8b_rtx4090_mem95/results.jsonl",), gpu_tables.precision_fit_table),
    DocTable("fit-fp8-llama3.2-1b-rtx4090", "docs/fp8.md",
             (f"{RESULTS}/fit_precision_llama3.2-1b_flash_rtx4090/results.jsonl",), gpu_tables.precision_fit_table),
    DocTable("moe-dispatch-h200", _MODELS, (f"{RESULTS}/moe_dispatch_olmoe-1b-7b_plan_h200/results.jsonl",
                                            f"{RESULTS}/moe_dispatch_olmoe-1b-7b_h200/results.jsonl"),
             gpu_tables.plan_then_measured_table),  # fmt: skip
    *(DocTable(f"moe-layouts-{preset}-h100", _MODELS, (f"{RESULTS}/moe_layouts_{preset}_plan_h100_x8/results.jsonl",),
               moe_tables.layouts_table) for preset in ("mixtral-8x7b", "qwen3-30b-a3b")),  # fmt: skip
    DocTable("fit-olmoe-1b-7b-rtx4090", _MODELS, (f"{RESULTS}/finetune_olmoe-1b-7b_rtx4090_mem95/results.jsonl",),
             gpu_tables.precision_fit_table),  # fmt: skip
    DocTable("seed-h200", "docs/gpu.md", (f"{RESULTS}/seed_table_seed_h200/results.jsonl",
                                          f"{RESULTS}/seed_table_seed_plan_h200/results.jsonl"),
             gpu_tables.seed_on_gpu_table),  # fmt: skip
    DocTable("fit-llama3.2-1b", _MODELS, _LLAMA1B, models_tables.optimizers_by_gpu_table),
    DocTable("fit-llama3.2-1b-flash", _MODELS, _LLAMA1B_FLASH, models_tables.two_gpu_table),
    DocTable("fit-gpt2", _MODELS, _fits("gpt2_rtx4090", "gpt2_rtx4090_xla_ignore"), models_tables.reference_fit_table),
    DocTable("fit-gpt2-flash", _MODELS, _fits("gpt2_flash_rtx4090", "gpt2_rtx4090"),
             models_tables.flash_beside_reference_table),  # fmt: skip
    DocTable("fit-gpt2-chunked-loss", _MODELS, _fits("gpt2_flash_chunked_loss_rtx4090", "gpt2_flash_rtx4090"),
             models_tables.chunked_loss_table),  # fmt: skip
    DocTable("fit-llama3.1-8b-flash", _MODELS, _fits("llama3.1-8b_flash_h100_x8"), models_tables.sharded_fit_table),
    DocTable("fit-llama3.1-8b-flash-step", _MODELS, _fits("llama3.1-8b_flash_h100_x8"),
             models_tables.sharded_fit_step_table),  # fmt: skip
    DocTable("fit-llama3.1-8b-cudnn", _MODELS, _fits("llama3.1-8b_cudnn_h100_x8", "llama3.1-8b_flash_h100_x8"),
             models_tables.attention_pair_table),  # fmt: skip
    DocTable("frontier-llama3.2-1b-a5000", "docs/fit.md",
             (f"{RESULTS}/fit_frontier_llama3.2-1b_flash_a5000_mem95/results.jsonl",), _frontier),  # fmt: skip
    DocTable("frontier-llama3.2-1b-adafactor-a5000", "docs/fit.md",
             (f"{RESULTS}/fit_frontier_llama3.2-1b_adafactor_flash_a5000/results.jsonl",), _frontier),  # fmt: skip
    DocTable("notebook-a5000", _PREDICT, (_SEED_A5000,), predict_tables.notebook_check_table),
    DocTable("seed-plan-h100", _PREDICT, (f"{RESULTS}/seed_table_seed_plan_h100/results.jsonl", _SEED_A5000),
             predict_tables.h100_plan_table),  # fmt: skip
    DocTable("calibration-cpu", _PREDICT, _CALIBRATE, predict_tables.calibration_table),
    DocTable("calibration-cpu-again", _PREDICT, (*_CALIBRATE, _cpu("calibrated_bf16_scan")),
             predict_tables.measured_again_table),  # fmt: skip
    DocTable("calibration-a-leave-one-in", _PREDICT,
             (_cpu("calibrate_a"), _cpu("calibrate_a", "calibration_group.jsonl"), _QUIET_A),
             predict_tables.leave_one_in_table),  # fmt: skip
    DocTable("calibration-a-out-of-sample", _PREDICT,
             (_QUIET_A, _cpu("calibrate_a"), _cpu("calibrate_b"), _cpu("calibrated_bf16_remat_batch64")),
             predict_tables.out_of_sample_table),  # fmt: skip
    DocTable("calibration-sweep-c", _PREDICT, (_cpu("calibrated_bf16_remat_batch64"),), predict_tables.sweep_c_table),
    DocTable("calibration-d-tcmalloc", _PREDICT,
             (_TCMALLOC_D, *(_cpu(name) for name in ("tcmalloc_d", "tcmalloc_e", "tcmalloc_f",
                                                      "calibrated_bf16_scan_remat_mlp_attn"))),
             predict_tables.four_sweeps_table),  # fmt: skip
    DocTable("calibration-sweep-g", _PREDICT, (_cpu("calibrated_bf16_scan_remat_mlp_attn"),),
             predict_tables.sweep_g_table),  # fmt: skip
    DocTable("layer-bytes-h100", "docs/measurements.md",
             tuple(f"{RESULTS}/layer_bytes_{preset}_plan_h100_cublas/results.jsonl"
                   for preset in ("llama3.1-8b", "gpt2", "olmoe-1b-7b")),
             measurements_tables.layer_bytes_table),  # fmt: skip
    DocTable("accumulation-h100", "docs/measurements.md",
             (f"{RESULTS}/accumulation_memory_llama3.1-8b_plan_h100_cublas_x8/results.jsonl",),
             measurements_tables.accumulation_table),  # fmt: skip
    DocTable("cpu-allocator", "docs/measurements.md",
             tuple(_cpu(name) for name in ("calibrate_a", "calibrate_b", "calibrated_bf16_remat_batch64", "tcmalloc_d",
                                           "tcmalloc_e", "tcmalloc_f", "calibrated_bf16_scan_remat_mlp_attn")),
             measurements_tables.allocator_table),  # fmt: skip
)


def _resolve(root: pathlib.Path, source: str) -> str | pathlib.Path:
    path, colon, preset = source.partition(":")
    if not (root / path).is_file():
        raise UsageError(f"{source}: no such file under {root} (a docs table is written from it)")
    return f"{root / path}:{preset}" if colon else root / path


def render(table: DocTable, root: pathlib.Path = REPO) -> str:
    """The table as its function writes it from the rows under root.

    Raises:
      UsageError: a source file is missing, or holds no rows.
    """
    sources = [_resolve(root, source) for source in table.sources]
    for source in sources:
        if isinstance(source, pathlib.Path) and source.suffix == ".jsonl" and not read_rows(source):
            raise UsageError(f"{source}: holds no rows (the docs table {table.name} is written from it)")
    return table.render(*sources)


def _markers(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(.*?)(<!-- /table:{re.escape(name)} -->)", re.DOTALL)


def replace_table(text: str, table: DocTable, written: str) -> str:
    """The doc's text with the table between its markers replaced by `written`.

    Raises:
      UsageError: the doc does not hold the markers exactly once.
    """
    found = _markers(table.name).findall(text)
    if len(found) != 1:
        raise UsageError(f"{table.doc}: holds {len(found)} '<!-- table:{table.name} -->' ... "
                         f"'<!-- /table:{table.name} -->' blocks; it needs exactly one")  # fmt: skip
    return _markers(table.name).sub(lambda m: f"{m.group(1)}{written}\n{m.group(3)}", text)


def updated_docs(root: pathlib.Path = REPO) -> tuple[dict[str, str], list[str]]:
    """Every doc with its tables written from the rows, and the names of the tables that changed.

    Args:
      root: the repository whose docs and rows are read.

    Returns:
      ({doc: its new text}, [names of the tables whose text differs from the doc's]).
    """
    texts: dict[str, str] = {}
    stale = []
    for table in TABLES:
        if table.doc not in texts and not (root / table.doc).is_file():
            raise UsageError(f"--root: {root} has no {table.doc} (the doc of table {table.name})")
        text = texts[table.doc] if table.doc in texts else (root / table.doc).read_text()
        texts[table.doc] = replace_table(text, table, render(table, root))
        if texts[table.doc] != text:
            stale.append(table.name)
    return texts, stale


USAGE = Usage(
    command="python -m jaxscale.report.docs_tables [--check]",
    summary="Writes every table of the docs that sits between <!-- table:NAME --> and <!-- /table:NAME --> markers "
    "from the committed rows it is built from (jaxscale/report/docs_tables.py, TABLES); --check only compares, "
    "and exits 1 naming each table that differs.",
    examples=("python -m jaxscale.report.docs_tables", "python -m jaxscale.report.docs_tables --check"),
    notes=("Run it after committing new rows (a replanned sweep); tests/report/test_docs_tables.py fails while a "
           "table is stale. See docs/architecture.md, Docs tables.",),  # fmt: skip
)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_bool("check", False, "Only compare the docs with the rows: exit 1 naming each stale table.",
                      flag_values=fv)  # fmt: skip
    flags.DEFINE_string("root", str(REPO), "The repository whose docs and committed rows are read.", flag_values=fv)
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: exit 0 (tables written, or --check found none stale), 1 (--check: stale), 2 (bad input)."""
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        no_arguments(fv, argv, "the command takes flags only: --check, --root")
        root = pathlib.Path(fv.root)
        texts, stale = updated_docs(root)
    except UsageError as error:
        return fail(str(error))
    docs = {table.doc for table in TABLES if table.name in stale}
    if fv.check:
        for table in TABLES:
            if table.name in stale:
                print(f"{table.doc}: table {table.name} is stale (differs from its rows); "
                      "run python -m jaxscale.report.docs_tables")  # fmt: skip
        return EXIT_STALE if stale else 0
    for doc in sorted(docs):
        (root / doc).write_text(texts[doc])
    print(f"docs tables: {len(TABLES)} tables, {len(stale)} rewritten" + (f" ({', '.join(stale)})" if stale else ""))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())

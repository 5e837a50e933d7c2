"""Reading a sweep: the figures, `python -m jaxscale.report` and the notebook, on a tiny sweep run here."""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

import matplotlib
import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from jaxscale.report import markdown as report
from jaxscale.report.plots import ANALYTIC_PARTS, ANALYTIC_PEAK, WALL_STEP, WALL_THROUGHPUT, pareto_front
from jaxscale.sweep.runner import load_results, run_sweep

matplotlib.use("Agg")

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "experiments" / "compare_sweeps.ipynb"
FIGURES = ("time_vs_memory", "tokens_per_s", "memory_breakdown", "op_shares", "vs_baseline")

# Two variants that run (no trace captured, to stay fast) and one whose config its run process rejects.
MINI_SWEEP = """
from jaxscale.config import base_config

BASELINE = "fp32"


def get_config(preset=None):
    config = base_config(preset, name="mini")
    config.model.num_layers = 1
    config.train.steps, config.train.warmup_steps, config.profile.steps = 2, 1, 0
    return config


def get_variants(config):
    return [
        {"name": "fp32", "model.dtype": "float32"},
        {"name": "bf16_remat", "model.dtype": "bfloat16", "model.remat": ("Block",)},
        {"name": "broken", "data.seq_len": 2 * config.model.max_seq_len},
    ]
"""


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("report")
    sweep_file = root / "mini.py"
    sweep_file.write_text(textwrap.dedent(MINI_SWEEP))
    outcome = run_sweep(f"{sweep_file}:tiny", output_root=root, progress=False)
    assert outcome.failed() == ["broken"], outcome.table()
    return outcome.results_path.parent


def axes_texts(figure) -> str:
    """Every title, label, tick label and text drawn in the figure, as one string."""
    parts = [figure.get_suptitle()] if hasattr(figure, "get_suptitle") else []
    for ax in figure.axes:
        parts += [ax.get_title(loc) for loc in ("left", "center", "right")]
        parts += [ax.get_xlabel(), ax.get_ylabel(), *(t.get_text() for t in ax.texts)]
        parts += [t.get_text() for t in (*ax.get_xticklabels(), *ax.get_yticklabels())]
        legend = ax.get_legend()
        parts += [t.get_text() for t in legend.get_texts()] if legend else []
    return "\n".join(parts)


def test_report_command_writes_figures_and_markdown(results_dir, capsys):
    assert report.main(["jaxscale.report", str(results_dir)]) == 0
    assert "report.md" in capsys.readouterr().out
    for name in FIGURES:
        png = (results_dir / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
        assert f"![{name}]({name}.png)" in (results_dir / "report.md").read_text()
    text = (results_dir / "report.md").read_text()
    assert "| variant | status |" in text and "| fp32 | ok |" in text and "| bf16_remat | ok |" in text
    assert "| broken | error |" in text and "data.seq_len" in text  # the failure's one-line error
    assert "baseline" in text and ("x faster" in text or "x slower" in text) and "x memory" in text
    assert "compiled plan (cpu)" in text  # the peak's source, as no CPU device peak exists


def test_report_command_rejects_missing_or_empty_results(tmp_path, capsys):
    assert report.main(["jaxscale.report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxscale: error:") and "results.jsonl" in err
    (tmp_path / "results.jsonl").write_text("")
    assert report.main(["jaxscale.report", str(tmp_path)]) == 2
    assert "no result rows" in capsys.readouterr().err


def test_figures_label_sources_and_failures(results_dir):
    frame = load_results(results_dir)
    texts = axes_texts(report.plot_time_vs_memory(frame))
    assert "compiled plan (cpu)" in texts and "fp32" in texts and "bf16_remat" in texts
    assert "not plotted: broken (error)" in texts
    assert "error" in axes_texts(report.plot_tokens_per_s(frame))  # the failure shows its status, not a bar
    ratios = axes_texts(report.plot_vs_baseline(frame))
    assert "fp32 (baseline)" in ratios and "1.00" in ratios


def test_missing_measurement_columns_are_named_not_fatal(results_dir):
    frame = load_results(results_dir)
    frame = frame.drop(columns=[c for c in frame if c.startswith("analytic_") or c.endswith("_share")])
    memory = axes_texts(report.plot_memory_breakdown(frame))
    assert "not in these results: analytic_params_bytes" in memory and "compiled plan: temp" in memory
    assert "no trace_*_share columns" in axes_texts(report.plot_op_shares(frame))
    # Once the rows carry them they are drawn. These values are stand-ins made from the row's own compiled plan,
    # only to exercise the drawing; they are not an analytic model or a trace measurement.
    for (column, _), fraction in zip(ANALYTIC_PARTS, (0.1, 0.1, 0.2, 0.4), strict=True):
        frame[column] = frame["compiled_peak_bytes"] * fraction
    frame[ANALYTIC_PEAK] = frame["compiled_peak_bytes"] * 0.8
    frame["trace_matmul_share"] = [0.5, 0.25, None]
    memory = axes_texts(report.plot_memory_breakdown(frame))
    assert "analytic: activations" in memory and "not in these results" not in memory
    shares = axes_texts(report.plot_op_shares(frame))
    assert "matmul" in shares and "50%" in shares and "25%" in shares
    assert "analytic peak MiB" in report.summary_table(frame).columns


def test_pareto_front_keeps_only_undominated_points():
    step_s = pd.Series([1.0, 2.0, 3.0, 3.0, 2.5])
    peak_bytes = pd.Series([30.0, 20.0, 10.0, 30.0, 20.0])
    assert pareto_front(step_s, peak_bytes).tolist() == [True, True, True, False, False]


def test_notebook_runs_headless_on_the_sweep(results_dir, monkeypatch):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "committed with outputs"
    parameters = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    parameters.source = f"RESULTS = [{str(results_dir)!r}]"
    notebook.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the kernel imports this checkout's jaxscale
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    client.execute()  # raises CellExecutionError on any cell error
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert outputs[-1]["text"].strip() == sys.prefix  # the kernel ran this interpreter
    images = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(images) == len(FIGURES)
    tables = [output["data"]["text/markdown"] for output in outputs if "text/markdown" in output.get("data", {})]
    assert any("| bf16_remat | ok |" in table and "| broken | error |" in table for table in tables)


# An input-pipeline sweep written by hand (the shape of experiments/results/input_pipeline_cpu): 4096 tokens per
# step; (variant, data source, median step s, median input wait s, wait share). The slow synchronous run's step
# is as fast as the baseline's, but it waits 3 s for each batch.
TOKENS = 4096
INPUT_ROWS = [
    ("synthetic", "synthetic", 1.79, 0.0, 0.0),
    ("slow_sync", "text", 1.85, 3.00, 0.62),
    ("slow_prefetch2", "text", 1.78, 1.14, 0.39),
    ("slow_workers4", "text", 1.36, 0.0, 0.0),
]


@pytest.fixture
def input_frame(tmp_path) -> pd.DataFrame:
    rows = []
    for variant, source, step, wait, share in INPUT_ROWS:
        rows.append({
            "name": variant, "sweep": "pipeline", "variant": variant, "baseline": "synthetic", "status": "ok",
            "error": None, "config.data.source": source, "tokens_per_step": TOKENS, "compile_s": 1.0,
            "step_s_median": step, "tokens_per_s": TOKENS / step, "input_wait_s_median": wait,
            "step_with_input_wait_s_median": step + wait, "tokens_per_s_with_input_wait": TOKENS / (step + wait),
            "input_wait_fraction": share, "compiled_backend": "cpu", "compiled_peak_bytes": 2**20,
        })  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_results(tmp_path)


def bar_widths(ax) -> dict[str, float]:
    """Each bar's length by its variant's tick label, read off the drawn axes (first variant on top)."""
    ticks = {
        round(tick.get_position()[1]): tick.get_text().removesuffix(" (baseline)") for tick in ax.get_yticklabels()
    }
    return {ticks[round(bar.get_y() + bar.get_height() / 2)]: bar.get_width() for bar in ax.patches}


def test_a_sweep_with_input_waits_is_drawn_and_tabled_in_wall_time(input_frame):
    """The input-bound run must show below the baseline: its wall time per step is 1.85 + 3.00 s against 1.79 s.
    The expected ratios are the step times' inverse ratios, by hand; tokens_per_s alone would say 0.97."""
    assert report.reads_input(input_frame)
    wall = {variant: step + wait for variant, _, step, wait, _ in INPUT_ROWS}
    tokens_ax = report.plot_tokens_per_s(input_frame).axes[0]
    drawn = bar_widths(tokens_ax)
    assert drawn["slow_sync"] == pytest.approx(TOKENS / 4.85) and drawn["slow_sync"] < drawn["synthetic"]
    assert "wall time" in tokens_ax.get_xlabel() and "input wait" in tokens_ax.get_xlabel()
    speed_ax = report.plot_vs_baseline(input_frame).axes[0]
    ratios = bar_widths(speed_ax)
    for variant in wall:
        assert ratios[variant] == pytest.approx(wall["synthetic"] / wall[variant]), variant
    assert ratios["slow_sync"] < ratios["slow_prefetch2"] < 1 < ratios["slow_workers4"]  # the experiment's story
    assert "input wait included" in speed_ax.get_xlabel()
    time_ax = report.plot_time_vs_memory(input_frame).axes[0]
    assert "input wait" in time_ax.get_ylabel() and max(time_ax.collections[0].get_offsets()[:, 1]) == 4.85

    table = report.summary_table(input_frame).set_index("variant")
    assert "tokens/s" not in table  # the compiled step's throughput is not what this table ranks by
    assert table.at["slow_sync", report.WALL_TOKENS] == pytest.approx(TOKENS / 4.85)
    assert table.at["slow_sync", "vs baseline"].startswith(f"{4.85 / 1.79:.2f}x slower")
    assert table.at["slow_workers4", "vs baseline"].startswith(f"{1.79 / 1.36:.2f}x faster")
    assert any("wall time" in note for note in report.notes(input_frame))


def test_the_input_wait_figure_stacks_the_wait_after_the_step(input_frame):
    figure = report.figures(input_frame)["input_wait"]
    ax = figure.axes[0]
    bars = [(round(bar.get_x(), 6), round(bar.get_width(), 6)) for bar in ax.patches if bar.get_width() > 0]
    assert (1.85, 3.00) in bars and (0, 1.85) in bars  # slow_sync: the step, then its wait
    assert "62% of wall time waiting" in axes_texts(figure)


def test_without_input_the_figures_keep_the_compiled_steps_throughput(input_frame):
    synthetic = input_frame.assign(**{"config.data.source": "synthetic"})
    assert not report.reads_input(synthetic) and "input_wait" not in report.figures(synthetic)
    drawn = bar_widths(report.plot_tokens_per_s(synthetic).axes[0])
    assert drawn["slow_sync"] == pytest.approx(TOKENS / 1.85)
    assert "tokens/s" in report.summary_table(synthetic)
    assert report.captions(synthetic)["tokens_per_s"] == report.CAPTIONS["tokens_per_s"]


def test_report_of_an_input_sweep_says_wall_time(input_frame, tmp_path):
    path = report.write_report(tmp_path)
    text = path.read_text()
    assert "![input_wait](input_wait.png)" in text and "tokens_per_s_with_input_wait" in text
    assert (tmp_path / "input_wait.png").read_bytes().startswith(b"\x89PNG")


def test_older_synthetic_rows_without_the_wall_time_keep_their_step(input_frame):
    """A synthetic row made before the wall-time columns existed: its batch is made on the device, nothing to wait
    for, so its step stands for its wall time; a host-fed row without them stays missing (never guessed)."""
    older = input_frame.copy()
    older.loc[older["variant"].isin(["synthetic", "slow_workers4"]), [WALL_STEP, WALL_THROUGHPUT]] = None
    drawn = bar_widths(report.plot_tokens_per_s(older).axes[0])
    assert drawn["synthetic"] == pytest.approx(TOKENS / 1.79) and "slow_workers4" not in drawn


# A plan for an H100 written by hand (the shape of experiments/results/seq_len_llama3.2-1b_plan_h100): nothing
# ran; (variant, predicted step s, planned peak GiB, plan_fits). 8192 tokens per step, so the predicted tokens/s
# are 16384, 32768 and 4096. The target's memory is a round 80 GiB: JAX's allocator gives the program 75% of it,
# 60 GiB, whatever fraction the environment of whoever draws the report sets.
PLAN_TOKENS = 8192
PLAN_MEMORY_GIB = 80
PLAN_BUDGET_GIB = 60
H100 = "NVIDIA H100 80GB HBM3"
PLAN_ROWS = [("base", 0.5, 20, True), ("fast", 0.25, 30, True), ("big", 2.0, 70, False)]


def planned_row(variant: str, step: float | None, peak_gib: float, fits: bool, **extra) -> dict:
    return {
        "name": variant, "sweep": "plan", "variant": variant, "baseline": "base", "status": "ok", "error": None,
        "plan_only": True, "device_kind": "cpu", "backend": "cpu", "compiled_backend": "cuda:h100",
        "plan_target": "h100", "plan_target_device_kind": H100, "plan_target_memory_bytes": PLAN_MEMORY_GIB * 2**30,
        "plan_fits": fits, "tokens_per_step": PLAN_TOKENS, "compile_s": 1.0, "step_s_median": None,
        "tokens_per_s": None, "device_peak_bytes": None, "compiled_peak_bytes": peak_gib * 2**30,
        "predicted_step_s": step, "predicted_tokens_per_s": None if step is None else PLAN_TOKENS / step, **extra,
    }  # fmt: skip


def frame_of(tmp_path: pathlib.Path, rows: list[dict]) -> pd.DataFrame:
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_results(tmp_path)


@pytest.fixture
def plan_frame(tmp_path, monkeypatch) -> pd.DataFrame:
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")  # the reader's environment, not the target's budget
    return frame_of(tmp_path, [planned_row(*row) for row in PLAN_ROWS])


def budget_lines(ax) -> list[float]:
    """The x of each budget line drawn (labelled 'budget ...')."""
    return [line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("budget")]


def test_a_plan_draws_its_predicted_throughput_for_the_target_not_the_planning_machine(plan_frame):
    ax = report.plot_tokens_per_s(plan_frame).axes[0]
    assert bar_widths(ax) == {"base": 16384, "fast": 32768, "big (does not fit)": 4096}
    assert f"predicted for {H100} (plan, not measured)" in ax.get_xlabel()
    texts = axes_texts(ax.figure)
    assert "cpu" not in texts and "ok" not in texts.split()  # no planning machine, no status beside the bars


def test_a_plan_draws_predicted_step_against_planned_peak_with_the_targets_budget(plan_frame):
    ax = report.plot_time_vs_memory(plan_frame).axes[0]
    points = {tuple(point) for point in ax.collections[0].get_offsets().tolist()}
    assert points == {(20.0, 0.5), (30.0, 0.25), (70.0, 2.0)}  # (GiB, predicted s)
    assert ax.get_ylabel().startswith("predicted step time")
    assert f"predicted for {H100} (plan, not measured)" in ax.figure.get_suptitle()
    assert budget_lines(ax) == [PLAN_BUDGET_GIB]
    memory = report.plot_memory_breakdown(plan_frame)
    assert budget_lines(memory.axes[0]) == [PLAN_BUDGET_GIB]
    assert "big\n(ok, does not fit)" in axes_texts(memory) and f"planned for {H100}" in axes_texts(memory)


def test_a_plan_compares_predicted_throughput_with_the_baseline(plan_frame):
    ax = report.plot_vs_baseline(plan_frame).axes[0]
    assert bar_widths(ax) == {"base": 1.0, "fast": 2.0, "big (does not fit)": 0.25}  # 0.5 s over 0.5, 0.25, 2 s
    assert ax.get_xlabel().startswith("predicted throughput")
    table = report.summary_table(plan_frame).set_index("variant")
    assert "step s (median)" not in table and table["fits"].tolist() == ["yes", "yes", "no"]
    assert table.at["fast", "vs baseline"].startswith("2.00x faster (predicted)")
    assert table.at["big", "predicted tokens/s"] == 4096
    assert "trace" in axes_texts(report.plot_op_shares(plan_frame)) and "plan runs no step" in axes_texts(
        report.plot_op_shares(plan_frame))  # fmt: skip


def test_report_of_a_plan_says_so_and_names_the_budget(plan_frame, tmp_path):
    text = report.write_report(tmp_path).read_text()
    assert "Plan, not measured" in text and H100 in text and "predicted tokens/s" in text
    assert f"Memory budget per device: {PLAN_BUDGET_GIB:.2f} GiB" in text
    assert "Predicted tokens per second on the target GPU" in text


@pytest.mark.parametrize(
    "columns, budget_gib",
    [({"fit_budget_bytes": 50 * 2**30, "fit_budget_source": "--memory"}, 50),  # the fit planner's
     ({"device_memory_budget_bytes": 40 * 2**30}, 40)],  # the run's own (a smaller accelerator's stand-in)
)  # fmt: skip
def test_a_budget_the_rows_name_is_the_one_drawn(tmp_path, columns, budget_gib):
    frame = frame_of(tmp_path, [planned_row(*row, **columns) for row in PLAN_ROWS])
    assert budget_lines(report.plot_memory_breakdown(frame).axes[0]) == [budget_gib]


def test_rows_planned_for_two_gpus_hold_each_bar_to_its_own_budget(tmp_path):
    """An A5000 (24 GiB here, so 18 GiB for the program) beside the H100: each budget drawn across its own rows."""
    a5000 = {
        "plan_target": "a5000",
        "plan_target_device_kind": "NVIDIA RTX A5000",
        "plan_target_memory_bytes": 24 * 2**30,
    }
    frame = frame_of(tmp_path, [planned_row("base", 0.5, 20, True), planned_row("small", 1.0, 10, True, **a5000)])
    ax = report.plot_memory_breakdown(frame).axes[0]
    ys = {
        line.get_xdata()[0]: tuple(line.get_ydata()) for line in ax.get_lines() if line.get_label().startswith("budget")
    }
    assert set(ys) == {PLAN_BUDGET_GIB, 18}
    assert min(ys[PLAN_BUDGET_GIB]) > max(ys[18])  # the first variant's (H100) rows are drawn above the A5000's
    assert "NVIDIA RTX A5000" in report.plot_tokens_per_s(frame).axes[0].get_xlabel()


def test_measured_rows_with_a_prediction_show_both_labelled(input_frame):
    """The input sweep's synthetic rows, measured on a CPU, with a prediction of twice their step beside it."""
    rows = input_frame[input_frame["config.data.source"] == "synthetic"].copy()
    rows["device_kind"], rows["predicted_step_s"] = "cpu", rows["step_s_median"] * 2
    rows["predicted_tokens_per_s"] = TOKENS / rows["predicted_step_s"]
    ax = report.plot_tokens_per_s(rows).axes[0]
    widths = sorted(round(bar.get_width(), 3) for bar in ax.patches)
    assert widths == sorted([round(TOKENS / 1.79, 3), round(TOKENS / 3.58, 3)])  # measured, and predicted (2x step)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "measured on cpu", "predicted for cpu (jaxscale.plan.predict)"]  # fmt: skip
    time_ax = report.plot_time_vs_memory(rows).axes[0]
    measured, predicted = (c.get_offsets()[:, 1].tolist() for c in time_ax.collections[:2])
    assert measured == [1.79] and predicted == [3.58]
    assert time_ax.get_ylabel() == "step time, median (s)"


def test_a_measured_sweep_keeps_its_measured_figures(input_frame):
    """No prediction, no plan, no budget in the rows: nothing predicted is drawn and no budget line either."""
    synthetic = input_frame.assign(**{"config.data.source": "synthetic"})
    figures = report.figures(synthetic)
    assert not any("predicted" in axes_texts(figure) or "budget" in axes_texts(figure) for figure in figures.values())
    ax = figures["tokens_per_s"].axes[0]
    assert ax.get_legend() is None and len(ax.patches) == len(INPUT_ROWS)


def test_the_committed_h100_plan_of_the_seq_len_sweep_is_drawn_as_predicted():
    """The committed rows: each bar is the row's tokens per step over its predicted step; the budget is 75% of
    the H100's memory (0.75 x 79.14 GiB, JAX's default pool)."""
    frame = load_results(REPO / "experiments" / "results" / "seq_len_llama3.2-1b_plan_h100")
    ax = report.plot_tokens_per_s(frame).axes[0]
    expected = dict(zip(frame["variant"], frame["tokens_per_step"] / frame["predicted_step_s"], strict=True))
    assert bar_widths(ax) == pytest.approx({
        variant + (" (does not fit)" if fits is False else ""): value
        for (variant, value), fits in zip(expected.items(), frame["plan_fits"], strict=True)})  # fmt: skip
    assert "NVIDIA H100 80GB HBM3 (plan, not measured)" in ax.get_xlabel() and "cpu" not in ax.get_xlabel()
    memory_ax = report.plot_memory_breakdown(frame).axes[0]
    assert budget_lines(memory_ax) == [pytest.approx(0.75 * 84978434048 / 2**30)]

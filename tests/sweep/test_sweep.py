"""Sweeps end to end on a tiny model: every variant in its own process, failures as rows, kill -9 and resume."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

from jaxscale.cli import UsageError, parse_bytes
from jaxscale.config import base_config, validate
from jaxscale.run import RunError, check_memory_budget
from jaxscale.sweep.results import COLUMNS, ResultsFile, best_peak, format_table, load_results, read_rows
from jaxscale.sweep.runner import _on_device, _one_gpu_args, load_sweep, run_sweep, select_variants
from jaxscale.sweep.runner import main as sweep_main
from jaxscale.sweep.sweep_file import Variant, plan_suffix

REPO = pathlib.Path(__file__).resolve().parents[2]

# Three variants of a one-layer model; "broken" asks for sequences longer than the model allows, so its run
# process rejects the config (exit 2) and the sweep must record it as a row and go on. "plain" has a peak
# measured elsewhere (made up here), which the sweep joins into its row.
MINI_SWEEP = """
from jaxscale.config import base_config

BASELINE = "plain"
NOTEBOOK_PEAK_GIB = {"tiny": {"plain": 0.001}}


def get_config(preset=None):
    config = base_config(preset, name="mini")
    config.model.num_layers = 1
    config.model.scan_layers = True
    config.train.steps, config.train.warmup_steps, config.profile.steps = 2, 1, 1
    return config


def get_variants(config):
    return [
        {"name": "plain"},
        {"name": "remat", "model.remat": ("Block",)},
        {"name": "broken", "data.seq_len": 2 * config.model.max_seq_len},
    ]
"""


def write_sweep(directory: pathlib.Path, text: str = MINI_SWEEP) -> pathlib.Path:
    path = directory / "mini.py"
    path.write_text(textwrap.dedent(text))
    return path


def sweep_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxscale.sweep", *args]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run(sweep_command(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def results_path(root: pathlib.Path) -> pathlib.Path:
    return root / "experiments" / "results" / "mini_tiny" / "results.jsonl"


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """The mini sweep run once, uninterrupted, from the command line (with a budget every variant fits)."""
    root = tmp_path_factory.mktemp("sweep")
    spec = f"{write_sweep(root)}:tiny"
    completed = run_cli("--config", spec, "--output_root", str(root), "--device-memory", "1GiB")
    return root, spec, completed


def main_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`python -m jaxscale.sweep ARGS` without a new interpreter: (exit code, stdout, stderr)."""
    code = sweep_main(["jaxscale.sweep", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_variant_runs_and_a_failing_one_is_a_row(finished_sweep):
    root, _, completed = finished_sweep
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = {row["variant"]: row for row in read_rows(results_path(root))}
    assert list(rows) == ["plain", "remat", "broken"]
    assert rows["plain"]["status"] == rows["remat"]["status"] == "ok"
    assert rows["plain"]["step_s_median"] > 0 and rows["remat"]["config.model.remat"] == ["Block"]
    assert rows["broken"]["status"] == "error"
    assert "data.seq_len" in rows["broken"]["error"] and "\n" not in rows["broken"]["error"]
    assert all(row["sweep"] == "mini_tiny" and row["baseline"] == "plain" for row in rows.values())
    assert rows["plain"]["device_memory_budget_bytes"] == 2**30  # --device-memory reached the run
    assert rows["plain"]["run_args"] == [f"--device_memory={2**30}"]
    # NOTEBOOK_PEAK_GIB joined into the row it names, with the plan's ratio to it; not into the others.
    notebook = rows["plain"]["notebook_peak_bytes"]
    assert notebook == round(0.001 * 2**30)
    assert rows["plain"]["planned_over_notebook"] == pytest.approx(rows["plain"]["compiled_peak_bytes"] / notebook)
    assert "notebook_peak_bytes" not in rows["remat"]
    # Each variant's trace and result lie under traces/<sweep>/<variant>/.
    assert list((root / "traces" / "mini_tiny" / "plain").glob("plugins/profile/*/*.xplane.pb"))
    assert json.loads((root / "traces" / "mini_tiny" / "remat" / "result.json").read_text())["variant"] == "remat"
    # The printed table: every variant, the baseline named, a ratio against it, the failure's error.
    table = completed.stdout[completed.stdout.index("variant") :]
    assert "vs plain" in table and "baseline" in table
    assert ("x faster" in table or "x slower" in table) and "x memory" in table
    assert "broken: error: data.seq_len" in table
    assert "notebook GiB" in table and "plan / notebook" in table and "fits" not in table  # no GPU target
    csv = (results_path(root).parent / "results.csv").read_text().splitlines()
    assert len(csv) == 4 and csv[0].startswith("sweep,variant,baseline,status")


def test_resume_skips_finished_and_rerun_replaces_only_its_row(finished_sweep, capsys):
    root, spec, _ = finished_sweep
    before = results_path(root).read_text()
    options = ("--config", spec, "--output_root", str(root), "--device-memory", "1GiB")
    code, out, _ = main_in_process(capsys, *options, "--strict")
    assert code == 1  # --strict: "broken" is not ok
    assert "3 already finished" in out and "0 to run" in out
    assert results_path(root).read_text() == before
    code, _, err = main_in_process(capsys, *options, "--rerun", "--only", "brok*", "--quiet")
    assert code == 0, err[-2000:]
    rows = read_rows(results_path(root))
    assert [row["variant"] for row in rows] == ["plain", "remat", "broken"]
    assert results_path(root).read_text().count("\n") == 3
    assert rows[:2] == [json.loads(line) for line in before.splitlines()[:2]]
    # The same sweep with one variant's definition changed: only that variant runs again on resume.
    changed = root / "changed"
    changed.mkdir()
    edited = write_sweep(changed, MINI_SWEEP.replace("2 * config.model.max_seq_len", "3 * config.model.max_seq_len"))
    code, out, _ = main_in_process(capsys, *options[:1], f"{edited}:tiny", *options[2:])
    assert code == 0 and "1 to run" in out and "rerunning broken" in out
    rows = read_rows(results_path(root))
    assert [row["variant"] for row in rows] == ["plain", "remat", "broken"] and rows[2]["config.data.seq_len"] == 96


def test_load_results_has_the_documented_columns(finished_sweep):
    root, _, _ = finished_sweep
    frame = load_results(results_path(root).parent)
    assert list(frame.columns[: len(COLUMNS)]) == list(COLUMNS)
    assert sorted(frame["variant"]) == ["broken", "plain", "remat"]
    by_variant = frame.set_index("variant")
    assert by_variant.loc["plain", "throughput_vs_baseline"] == pytest.approx(1.0)
    assert by_variant.loc["plain", "best_peak_source"] == "compiled plan (cpu)"
    assert by_variant.loc["remat", "peak_vs_baseline"] > 0
    assert pd.isna(by_variant.loc["broken", "throughput_vs_baseline"])
    assert "config.model.remat" in frame.columns and "compiled_temp_bytes" in frame.columns


def test_kill_9_after_the_first_row_then_resume_loses_and_duplicates_nothing(tmp_path):
    spec = f"{write_sweep(tmp_path)}:tiny"
    args = ("--config", spec, "--output_root", str(tmp_path), "--skip", "remat", "--quiet")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    sweep = subprocess.Popen(sweep_command(*args), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not results_path(tmp_path).exists() or not results_path(tmp_path).read_text().count("\n"):
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.kill(sweep.pid, signal.SIGKILL)  # while the second variant ("broken") is starting or running
    sweep.wait()
    first = results_path(tmp_path).read_text()
    assert [json.loads(line)["variant"] for line in first.splitlines()] == ["plain"]
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    text = results_path(tmp_path).read_text()
    assert text.startswith(first)  # the finished row is kept as it was
    assert [json.loads(line)["variant"] for line in text.splitlines()] == ["plain", "broken"]


def test_a_torn_last_line_is_dropped_when_the_file_is_opened(tmp_path):
    store = ResultsFile(tmp_path)
    store.path.write_text('{"variant": "a", "status": "ok"}\n{"variant": "b", "sta')
    with store.locked():
        assert [row["variant"] for row in store.rows()] == ["a"]
    assert store.path.read_text() == '{"variant": "a", "status": "ok"}\n'


def test_a_variant_past_its_timeout_is_a_timeout_row(tmp_path):
    spec = f"{write_sweep(tmp_path)}:tiny"
    outcome = run_sweep(spec, only=["plain"], timeout_s=0.5, output_root=tmp_path, progress=False)
    [row] = read_rows(outcome.results_path)
    assert row["status"] == "timeout" and "0.5 s" in row["error"]
    assert outcome.failed() == ["plain"]


def test_a_compiled_plan_over_the_device_memory_budget_is_oom():
    row = {"compiled_peak_bytes": 3 * 2**30, "compiled_backend": "cpu"}
    check_memory_budget(row, 4 * 2**30)  # fits: nothing happens
    check_memory_budget(row, None)  # no budget
    expected = r"3,221,225,472 bytes \(3.00 GiB\) exceeds the device-memory budget of 2,147,483,648 bytes"
    with pytest.raises(RunError, match=expected) as raised:
        check_memory_budget(row, 2 * 2**30)
    assert raised.value.status == "oom"
    assert "source: compiled plan, the CPU compiler's plan, a proxy for a GPU's" in str(raised.value)


def test_a_plan_that_does_not_fit_is_ok_but_the_table_says_no():
    """Without --device-memory a target plan that does not fit stays `ok`; the table shows fits NO and why."""
    gib = 2**30
    plan = {"sweep": "s", "baseline": "small", "status": "ok", "plan_only": True, "compiled_backend": "cuda:a5000",
            "plan_target": "a5000", "compiled_remat_limit_bytes": None, "notebook_peak_bytes": 4 * gib}  # fmt: skip
    rows = [
        {**plan, "variant": "small", "compiled_peak_bytes": 3 * gib, "plan_fits": True,
         "compiled_triton_peak_bytes": 3 * gib, "compiled_cublas_peak_bytes": 2 * gib, "planned_over_notebook": 0.75},
        {**plan, "variant": "big", "compiled_peak_bytes": 30 * gib, "plan_fits": False,
         "compiled_triton_peak_bytes": 30 * gib, "compiled_cublas_peak_bytes": None,
         "plan_fits_reason": "planned peak 32212254720 bytes > device memory 25757220864 bytes"},
    ]  # fmt: skip
    lines = format_table(rows, order=["small", "big"]).splitlines()
    headers = ["variant", "status", "compile s", "peak GiB", "peak source", "triton / cublas GiB", "fits",
               "notebook GiB", "plan / notebook", "vs small"]  # fmt: skip
    assert [h.strip() for h in lines[0].split("  ") if h.strip()] == headers  # no step time: nothing ran
    assert lines[1].split()[-3:] == ["4.0", "0.75", "baseline"] and "3.000 / 2.000" in lines[1]
    assert lines[2].split()[:2] == ["big", "ok"] and " NO " in lines[2] and "30.000 / -" in lines[2]
    assert lines[3] == "  big: does NOT fit on a5000: planned peak 32212254720 bytes > device memory 25757220864 bytes"


def test_only_and_skip_filters():
    names = ["fp32_scan", "bf16_scan", "bf16_noscan", "bf16_remat"]
    assert select_variants(names) == names
    assert select_variants(names, only=["bf16_*"], skip=["*noscan"]) == ["bf16_scan", "bf16_remat"]
    assert select_variants(names, skip=["fp32_scan", "bf16_remat"]) == ["bf16_scan", "bf16_noscan"]
    with pytest.raises(UsageError, match="--only: 'tpu' matches no variant; variants: fp32_scan"):
        select_variants(names, only=["tpu"])
    with pytest.raises(UsageError, match="no variant left"):
        select_variants(names, only=["fp32_scan"], skip=["fp32*"])


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    spec = f"{write_sweep(tmp_path)}:tiny"
    for args, message in [
        (("--config", spec, "--only", "nope"), "--only: 'nope' matches no variant"),
        (("--config", spec[: -len(":tiny")]), "add a preset after the colon"),
        (("--config", spec, "--device-memory", "lots"), "--device-memory: 'lots' is not a positive memory size"),
        (("--config", spec, "--config.model.dtype=float32"), "config changes belong in the sweep's variants"),
        (("--config", spec, "--run_arg=--run_dir=elsewhere"), "--run_arg: '--run_dir=elsewhere' is set by the sweep"),
        (("--config", spec, "--run_arg=--target=a5000"), "use the sweep's own --target flag"),
        (("--config", spec, "--target", "a5000"), "--target a5000: only plans (the GPU is not here); add --plan"),
        (("--config", spec, "--plan", "--gemm", "triton"), "--gemm triton: picks the GEMMs of a GPU target's plan"),
        (("--config", spec, "--plan", "--target", "rtx3090"),
         "--target: unknown 'rtx3090'; known: a5000, a6000, a100-40gb"),
    ]:
        code, out, err = main_in_process(capsys, *args, "--output_root", str(tmp_path))
        assert code == 2 and out == ""
        assert err.startswith("jaxscale: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "experiments").exists()  # nothing was run or written


def test_notebook_peaks_must_name_variants(tmp_path):
    text = MINI_SWEEP.replace('{"plain": 0.001}', '{"plane": 0.001}')
    with pytest.raises(UsageError, match=r"NOTEBOOK_PEAK_GIB\['tiny'\]: 'plane' is not a variant at tiny"):
        load_sweep(f"{write_sweep(tmp_path, text)}:tiny")
    assert load_sweep(f"{write_sweep(tmp_path)}:cpu").notebook_peak_bytes == {}  # none given for :cpu


def test_notebook_step_times_need_the_device_they_were_measured_on(tmp_path):
    text = MINI_SWEEP.replace(
        'NOTEBOOK_PEAK_GIB = {"tiny": {"plain": 0.001}}', 'NOTEBOOK_STEP_S = {"tiny": {"plain": 0.5}}'
    )
    with pytest.raises(UsageError, match=r"NOTEBOOK_STEP_S needs NOTEBOOK_DEVICE.*a5000.*got None"):
        load_sweep(f"{write_sweep(tmp_path, text)}:tiny")
    with_device = text + 'NOTEBOOK_DEVICE = "a5000"\n'
    sweep = load_sweep(f"{write_sweep(tmp_path, with_device)}:tiny")
    assert sweep.notebook_step_s == {"plain": 0.5} and sweep.notebook_device == "a5000"


def test_the_notebooks_step_times_join_only_rows_for_its_gpu():
    assert _on_device({"plan_target": "a5000"}, "a5000")
    assert _on_device({"device_kind": "NVIDIA RTX A5000", "plan_target": None}, "a5000")  # a run on one
    assert not _on_device({"plan_target": "h100"}, "a5000")  # an H100 plan is not the notebook's GPU
    assert not _on_device({"device_kind": "cpu"}, "a5000") and not _on_device({"plan_target": "a5000"}, None)


def test_a_sweeps_1x1x1_baseline_is_planned_on_one_gpu_and_labelled_so():
    """With --devices 8 the run refuses a 1x1x1 mesh (it would plan one GPU under an 8-GPU name); a sweep's
    1x1x1 variant (its baseline, usually) is planned on one GPU instead, and its row says so."""
    args = ["--plan", "--target=h100", "--devices=8", "--quiet"]
    one = base_config("tiny", name="mini")
    meshed = base_config("tiny", name="mini")
    meshed.mesh.fsdp = 8
    assert _one_gpu_args(Variant("meshed", {"mesh.fsdp": 8}, meshed), args) == (args, None)
    kept, note = _one_gpu_args(Variant("baseline", {}, one), args)
    assert kept == ["--plan", "--target=h100", "--quiet"]
    assert note.startswith("planned on one GPU: the mesh is 1x1x1 (the sweep's --devices 8")
    assert _one_gpu_args(Variant("baseline", {}, one), ["--plan"]) == (["--plan"], None)  # no --devices: as is


def test_the_sweep_name_says_plan_and_target():
    assert plan_suffix(False, None) == ""
    assert plan_suffix(True, None) == "_plan"
    assert plan_suffix(True, "a5000") == "_plan_a5000"
    assert plan_suffix(True, "gpus/my_gpu.txtpb", "triton") == "_plan_my_gpu_triton"


def test_a_variant_naming_an_unknown_field_is_refused(tmp_path):
    text = MINI_SWEEP.replace('"model.remat": ("Block",)', '"model.rematt": ("Block",)')
    with pytest.raises(UsageError, match=r"variant remat: model.rematt: no field 'rematt' in model; allowed: .*remat"):
        load_sweep(f"{write_sweep(tmp_path, text)}:tiny")


def test_the_seq_len_experiment_measures_two_kernels_on_cpu_and_plans_four_for_a_gpu():
    """experiments/seq_len.py: reference and chunked from 512 to 4096 tokens at :cpu widths (measured);
    reference, xla, chunked and flash from 1k to 32k at llama3.2-1b (planned); one sequence per step."""
    cpu = load_sweep(REPO / "experiments" / "seq_len.py", "cpu")
    gpu = load_sweep(REPO / "experiments" / "seq_len.py", "llama3.2-1b")
    for sweep, kernels, seqs in ((cpu, {"reference", "chunked"}, {512, 4096}), (gpu, {"reference", "xla", "chunked",
                                  "flash"}, {1024, 32768})):  # fmt: skip
        configs = [v.config for v in sweep.variants]
        for config in configs:
            validate(config)
            assert config.data.batch_size == 1 and config.model.family == "llama" and config.model.remat == ("Block",)
        assert {c.model.attention for c in configs} == kernels
        assert {min(c.data.seq_len for c in configs), max(c.data.seq_len for c in configs)} == seqs
        assert (
            len(configs) == len(kernels) * len({c.data.seq_len for c in configs})
            and sweep.baseline in sweep.variant_names
        )
    assert gpu.variants[0].config.model.hidden_size == 2048  # the model preset's width, not the CPU's


def _committed_rows(name: str) -> dict[str, dict]:
    path = REPO / "experiments" / "results" / name / "results.jsonl"
    return {row["variant"]: row for row in read_rows(path)}


def test_the_committed_seq_len_rows_hold_what_docs_attention_says():
    """docs/attention.md, from the committed rows: on the CPU the reference's compiled temp memory grows more
    than 3.5x from 2k to 4k tokens and chunked's less than 2.1x; on an H100 the reference and xla stop
    fitting at 16k, chunked at 32k, flash fits 32k; the analytic estimate for flash is within 12% of the
    plan from 8k up."""
    cpu = _committed_rows("seq_len_cpu")
    temp = {name: row["compiled_temp_bytes"] for name, row in cpu.items()}
    assert temp["reference_4k"] / temp["reference_2k"] > 3.5 and temp["chunked_4k"] / temp["chunked_2k"] < 2.1
    gpu = _committed_rows("seq_len_llama3.2-1b_plan_h100")
    fits = {name: row["plan_fits"] for name, row in gpu.items()}
    assert fits["reference_8k"] and fits["xla_8k"] and not fits["reference_16k"] and not fits["xla_16k"]
    assert fits["chunked_16k"] and not fits["chunked_32k"] and fits["flash_32k"]
    for seq in ("8k", "16k", "32k"):
        assert abs(gpu[f"flash_{seq}"]["compiled_to_analytic_peak_ratio"] - 1) <= 0.12, seq


def test_seed_table_defines_the_notebook_rows_at_every_preset():
    for preset in ("tiny", "cpu", "seed"):
        sweep = load_sweep(REPO / "experiments" / "seed_table.py", preset)
        assert sweep.name == f"seed_table_{preset}" and sweep.baseline == "fp32_scan"
        assert len(sweep.variants) == 7
        for variant in sweep.variants:
            validate(variant.config)
        configs = {v.name: v.config for v in sweep.variants}
        assert configs["fp32_scan"].model.dtype == "float32" and not configs["bf16_noscan"].model.scan_layers
        assert configs["bf16_scan_remat_block"].model.remat == ("Block",)
        assert configs["bf16_remat_1minibatch"].train.num_minibatches == 1
    assert "bf16_remat_batch256" in sweep.variant_names  # :seed is the notebook's batch 256
    assert set(sweep.notebook_peak_bytes) == set(sweep.variant_names)  # the notebook's peaks, at :seed only
    assert set(sweep.notebook_step_s) == set(sweep.variant_names) - {"bf16_remat_batch256"}  # not timed
    assert sweep.notebook_device == "a5000"


def test_parse_bytes():
    assert parse_bytes("24GiB", "--x") == 24 * 2**30
    assert parse_bytes("24GB", "--x") == 24 * 10**9
    assert parse_bytes("1.5 mib", "--x") == 3 * 2**19
    assert parse_bytes("4096", "--x") == 4096
    with pytest.raises(UsageError, match="--x: '24 parsecs'"):
        parse_bytes("24 parsecs", "--x")


def test_a_plan_rows_peak_is_the_plan_never_an_idle_allocators():
    """A --plan row from a GPU host could carry the idle allocator's near-zero peak (older rows did): the table
    shows XLA's plan for it; a row whose steps ran shows the device peak."""
    plan = {"plan_only": True, "device_peak_bytes": 1_024, "compiled_peak_bytes": 4_000_000_000,
            "compiled_backend": "cuda:a5000"}  # fmt: skip
    assert best_peak(plan) == (4_000_000_000, "compiled plan (cuda:a5000)")
    assert best_peak({**plan, "plan_only": False}) == (1_024, "device")


def test_on_this_device_names_the_sweep_after_the_gpu_without_opening_it(tmp_path):
    """`--on_this_device` on a GPU machine: experiments/results/seed_table_seed_h100/. Here the child's answer
    is replaced by an H100's; the sweep process itself never initialises a JAX backend (the variants'
    processes need the GPU's memory)."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    script = textwrap.dedent(f"""
        from jax._src import xla_bridge
        from jaxscale.sweep import runner, variant_process
        variant_process.device_kind_in_child = lambda: "NVIDIA H100 80GB HBM3"
        outcome = runner.run_sweep({str(repo / "experiments" / "seed_table.py")!r}, "tiny",
                                   only=["bf16_scan_remat_block"], on_this_device=True,
                                   output_root={str(tmp_path)!r}, progress=False)
        print(outcome.sweep.name, outcome.results_path.parent.name, xla_bridge.backends_are_initialized())
    """)
    env = dict(os.environ, PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["seed_table_tiny_h100", "seed_table_tiny_h100", "False"]
    rows = read_rows(tmp_path / "experiments" / "results" / "seed_table_tiny_h100" / "results.jsonl")
    assert [row["status"] for row in rows] == ["ok"]


def test_on_this_device_without_an_accelerator_is_refused(capsys):
    spec = f"{pathlib.Path(__file__).resolve().parents[2] / 'experiments' / 'seed_table.py'}:tiny"
    assert sweep_main(["sweep", "--config", spec, "--on_this_device"]) == 2
    assert "JAX finds no accelerator here" in capsys.readouterr().err
    assert sweep_main(["sweep", "--config", spec, "--on_this_device", "--plan"]) == 2

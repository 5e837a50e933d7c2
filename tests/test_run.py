"""`python -m jaxscale.run`: a measured run end to end, --plan, and one-line errors for bad input."""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import REPO, run_cli

from jaxscale import run, run_row

ROW_KEYS = {
    "name",
    "status",
    "error",
    "backend",
    "device_kind",
    "jax_version",
    "params",
    "tokens_per_step",
    "compile_s",
    "step_s_median",
    "step_s_p90",
    "tokens_per_s",
    "loss",
    "accuracy",
    "compiled_argument_bytes",
    "compiled_output_bytes",
    "compiled_temp_bytes",
    "compiled_alias_bytes",
    "compiled_peak_bytes",
    "device_peak_bytes",
    "host_peak_rss_bytes",
    "trace_dir",
}


def _result(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("result: ")][-1]
    return json.loads(pathlib.Path(line.removeprefix("result: ")).read_text())


def test_tiny_run_writes_a_result_row_and_a_trace(tmp_path):
    proc = run_cli(
        "jaxscale.run",
        "--config",
        "configs/bf16_remat.py:tiny",
        "--output_root",
        str(tmp_path),
        "--name",
        "tiny_run",
        "--config.train.steps=4",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = _result(proc.stdout)
    assert ROW_KEYS <= set(row)
    assert row["status"] == "ok" and row["error"] is None
    assert row["params"] > 0 and row["tokens_per_step"] == 8 * 32
    assert len(row["step_s_all"]) == 4
    assert 0 < row["step_s_median"] <= row["step_s_p90"]
    assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s_median"])
    peak = row["compiled_argument_bytes"] + row["compiled_output_bytes"] - row["compiled_alias_bytes"]
    assert row["compiled_peak_bytes"] == peak + row["compiled_temp_bytes"]
    assert row["config.model.remat"] == ["MLP", "Attn"] and row["config.train.steps"] == 4
    assert row["backend"] == "cpu" and row["device_peak_bytes"] is None and "not available" in row["device_peak_note"]
    assert row["host_peak_rss_bytes"] > 0
    run_dir = tmp_path / "traces" / "tiny_run"
    assert pathlib.Path(row["trace_dir"]) == run_dir
    assert list(run_dir.glob("plugins/profile/*/*.xplane.pb"))  # TensorBoard's layout
    assert "run tiny_run: ok" in proc.stdout and "loss" in proc.stdout
    # :tiny's head_dim 16 is off the tensor-core tile: said once, in the summary and the row
    assert proc.stdout.count("shape warning:") == 1 and "model.head_dim = 16 is not a multiple of 64" in proc.stdout
    assert row["shape_warnings"] == ["model.head_dim = 16 is not a multiple of 64 (tensor-core tiles)"]


@pytest.mark.parametrize(
    "optimizer", [pytest.param("adam", marks=pytest.mark.slow), "adafactor"]
)  # adam: test_tiny_run
def test_tiny_llama_runs_and_learns(tmp_path, optimizer):
    from jaxscale.config import base_config

    config = base_config("tiny-llama", "llama_run")
    config.model.update(scan_layers=True, remat=("Block",))
    config.optimizer.update(name=optimizer, warmup_steps=0)
    config.train.update(steps=6)
    config.profile.steps = 0
    row = run.run(config, tmp_path / "llama", "llama_run", progress=False)
    assert row["status"] == "ok", row["error"]
    assert row["params"] == 106_816 and row["loss"] < row["loss_first"]
    assert row["shape_warnings"] == ["model.head_dim = 16 is not a multiple of 64 (tensor-core tiles)"]
    assert 0.5 < row["compiled_to_analytic_peak_ratio"] < 3.0


def test_reference_plan_on_cpu_reports_the_reference_param_count(tmp_path, capsys):
    # in this process (the command's own main): a real process's start is test_bad_input_from_a_real_process's and
    # test_tiny_run_writes_a_result_row_and_a_trace's to check
    code = run.main(["jaxscale.run", "--config", str(REPO / "configs/bf16_remat.py:seed"), "--plan", "--output_root",
                     str(tmp_path), "--quiet"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    row = _result(out)
    assert row["params"] == 155_877_376 and row["tokens_per_step"] == 64 * 512
    assert row["plan_only"] and row["status"] == "ok" and row["trace_dir"] is None
    # a dense model, scanned, every parameter trained, 4 minibatches: the layers' gradients go into the accumulator
    assert row["grad_accumulation"] == "in_backward" and row["config.train.grad_accumulation"] == "auto"
    assert row["compiled_temp_bytes"] > 0 and row["compiled_peak_bytes"] > row["compiled_temp_bytes"]
    assert "step_s_median" not in row  # nothing ran, so nothing was timed


def test_nan_loss_stops_the_run_with_status_nan(tmp_path):
    proc = run_cli(
        "jaxscale.run",
        "--config",
        "configs/bf16.py:tiny",
        "--output_root",
        str(tmp_path),
        "--quiet",
        "--config.optimizer.learning_rate=1e38",
        "--config.optimizer.warmup_steps=0",
        "--config.train.steps=6",
    )
    assert proc.returncode == 1
    row = _result(proc.stdout)
    assert row["status"] == "nan" and "loss became" in row["error"]


def test_runs_never_overwrite_each_other(tmp_path, capsys):
    result = tmp_path / "traces" / "same" / "result.json"
    result.parent.mkdir(parents=True)
    result.write_text('{"name": "same"}')
    code = run.main(
        [
            "jaxscale.run",
            "--config",
            str(REPO / "configs/bf16.py:tiny"),
            "--output_root",
            str(tmp_path),
            "--name",
            "same",
        ]
    )
    assert code == 2 and "already holds a result" in capsys.readouterr().err
    assert result.read_text() == '{"name": "same"}'


BAD_INPUTS = [
    (["--config", "configs/nope.py"], "--config: config file 'configs/nope.py' not found"),
    (["--config", "configs/bf16.py:huge"], "preset: unknown 'huge'; allowed: seed, cpu, tiny"),
    (["--config", "configs/bf16.py:tiny", "--config.model.colour=3"], "--config.model.colour: no field 'colour'"),
    (["--config", "configs/bf16.py:tiny", "--config.modl.dtype=float32"], "no field 'modl'"),
    (["--config", "configs/bf16.py:tiny", "--config.model.remat=Everything"], "model.remat: unknown 'Everything'"),
    (["--config", "configs/bf16.py:tiny", "--config.model.dtype=float8"], "model.dtype: unknown 'float8'"),
    (["--config", "configs/bf16.py:tiny", "--config.model.hidden_size=100"], "model.hidden_size: 100 is not divisible"),
    (["--config", "configs/bf16.py:tiny", "--config.data.batch_size=7"], "data.batch_size: 7 is not divisible"),
    (["--config", "configs/bf16.py:tiny", "--config.data.seq_len=64"], "data.seq_len: 64 exceeds"),
    (["--config", "configs/bf16.py:tiny", "--config.model.num_layers=0"], "model.num_layers: must be a positive"),
    (["--config", "configs/bf16.py:tiny", "--config.data.seq_len=-1"], "data.seq_len: must be a positive"),
    (["--config", "configs/bf16.py:tiny", "--config.model.num_layers=abc"], "--config.model.num_layers=abc"),
    (["--config", "configs/bf16.py:tiny", "--bogus"], "bogus"),
    (
        ["--config", "configs/bf16.py:tiny", "--config.mesh.data=2"],
        "mesh: data x fsdp x tensor = 2x1x1 = 2 devices, but this run (cpu) has 1; use 1x1x1; simulate CPU devices "
        "with --host_devices=2",
    ),
    (["--config", "configs/bf16.py:tiny", "--config.mesh.tensor=3"], "mesh.tensor: 3 does not divide the 4 attention"),
    (["--config", "configs/bf16.py:tiny", "--devices=8"], "--devices 8: sets how many target GPUs to plan for"),
    (["--config", "configs/bf16.py:tiny", "--host_devices=0"], "--host_devices"),
    (["--config", "configs/bf16.py:tiny", "--host_devices=8"], "--host_devices: must be set before JAX starts"),
    (["--config", "configs/bf16.py:tiny", "--num_processes=2"], "--coordinator_address, --process_id: give all three"),
    (
        ["--config", "configs/bf16.py:tiny", "--coordinator_address=h:1", "--num_processes=2", "--process_id=2"],
        "--process_id: 2 is not below --num_processes=2",
    ),
    ([], "--config is required"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[m[:30] for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_with_exit_2(args, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    code = run.main(["jaxscale.run", *args, "--output_root", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("jaxscale: error: ") and "\n" not in err and "Traceback" not in err
    assert message in err
    assert not (tmp_path / "traces").exists()  # nothing written


def test_bad_input_from_a_real_process_exits_2_without_traceback(tmp_path):
    proc = run_cli(
        "jaxscale.run",
        "--config",
        "configs/bf16.py:tiny",
        '--config.model.remat=("Foo",)',
        "--output_root",
        str(tmp_path),
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "jaxscale: error: model.remat: unknown 'Foo'; allowed: MLP, Attn, Block" in proc.stderr


def test_a_long_run_is_announced_with_an_estimate():
    from conftest import load_config

    assert run._estimate_message(load_config("bf16", "tiny"), "cpu") is None
    message = run._estimate_message(load_config("fp32", "seed"), "cpu")  # 15 steps of ~33 TFLOP on a CPU
    assert message is not None and "estimate" in message and "TFLOP" in message and "--plan" in message


def test_a_plan_only_row_has_no_device_peak_even_where_the_allocator_has_one(monkeypatch, tmp_path):
    """On a GPU host the allocator reports a peak even when no step ran (an idle device's): a plan row has none."""
    from conftest import load_config

    monkeypatch.setattr(run_row.memory, "device_peak_bytes", lambda device=None: (12_345, None))  # as a GPU would
    row = run.run(load_config("bf16_remat"), tmp_path / "plan", "plan", plan_only=True, progress=False)
    assert row["status"] == "ok" and row["plan_only"] is True
    assert row["device_peak_bytes"] is None and row["device_peak_note"] == "plan only: no step ran on the device"


def test_the_summary_names_a_pipelines_schedule_and_its_compiled_bubble():
    """A row with 4 stages, 8 microbatches in flight and the compiled loop's 11 iterations: 3 of 11 idle (hand count);
    circular with 2 visits and 19 iterations: 3 of 19; no line without a pipeline."""
    from jaxscale.run_summary import pipeline_line

    row = {"config.mesh.stage": 4, "config.mesh.pipeline_microbatches": 8, "config.mesh.pipeline_repeats": 1,
           "compiled_pipeline_iterations": 11}  # fmt: skip
    assert pipeline_line(row) == ("  pipeline: 4 stages, GPipe, 8 microbatches in flight: 11 loop iterations in the "
                                  "compiled program, bubble 27.3% of the stages' layer work")  # fmt: skip
    circular = {**row, "config.mesh.pipeline_repeats": 2, "compiled_pipeline_iterations": 19}
    assert "circular, 2 visits a stage" in pipeline_line(circular) and f"bubble {3 / 19:.1%}" in pipeline_line(circular)
    assert pipeline_line({"config.mesh.stage": 1}) is None

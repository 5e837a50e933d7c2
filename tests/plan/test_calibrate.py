"""jaxscale.plan.calibrate: efficiencies fitted to a measured trace, checked against hand-built traces whose true
efficiencies are known, and the --calibrate flag of the main job and the sweep."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import platform
import statistics

import jax
import pytest
from conftest import REPO

from jaxscale import run
from jaxscale.measure import kernels, peaks
from jaxscale.plan import calibrate, calibration_io, predict
from jaxscale.report import docs_tables
from jaxscale.sweep import runner

# A device whose numbers make the hand arithmetic plain: 1 GFLOP/s for everything, 1 GB/s of memory.
ROOF = predict.Roofline(
    name="hand", matmul_flops_per_s={"bf16": 1e9, "f16": 1e9, "tf32": 1e9, "f32": 1e9}, vector_flops_per_s=1e9,
    memory_bytes_per_s=1e9, link_bytes_per_s=1e9, link_devices=1, host_bytes_per_s=1e9, network_bytes_per_s=1e9,
    devices_per_host=1, cores=None, gemm_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
    launch_s=0.0, source="by hand",
)  # fmt: skip


def _kernel(name: str, category: str, flops: float = 0.0, bytes_read: int = 0, times: int = 1) -> kernels.Kernel:
    return kernels.Kernel(name=name, category=category, detail="test", trips=(), times=times, flops=flops,
                          flop_dtype="f32" if category == "matmul" else "vector", bytes_read=bytes_read,
                          bytes_written=0)  # fmt: skip


def _op(name: str, seconds: float) -> dict:
    return {"op": name, "self_s_per_step": seconds}


# The calibration run: two GEMMs (1 s, and 3 s launched twice: 7 s on the roofline), a fusion (0.5 s of bytes)
# and a copy (0.25 s). Measured per step: the GEMMs at exactly twice their roofline time (2 s + 12 s), the
# fusion at 4x (2 s), the copy at its roofline (0.25 s).
CALIBRATION_KERNELS = [
    _kernel("dot.1", "matmul", flops=1e9),
    _kernel("dot.2", "matmul", flops=3e9, times=2),
    _kernel("fusion.1", "fusion", bytes_read=500_000_000),
    _kernel("copy.1", "copy", bytes_read=250_000_000),
]
CALIBRATION_OPS = [_op("dot.1", 2.0), _op("dot.2", 12.0), _op("fusion.1", 2.0), _op("copy.1", 0.25)]
# Sum of the ops: 16.25 s; the traced step spans 16.65 s: 0.4 s in no op, over 5 launches = 0.08 s per launch.


def test_ops_measured_at_twice_their_roofline_fit_an_efficiency_of_one_half():
    fitted = calibrate.fit(CALIBRATION_OPS, CALIBRATION_KERNELS, ROOF, trace_step_s=16.65, step_s=16.65)
    assert fitted.efficiency == pytest.approx({"matmul": 0.5, "fusion": 0.25, "copy_dus": 1.0})
    assert fitted.scale == pytest.approx(1.0)
    assert fitted.launch_s == pytest.approx(0.08)
    assert fitted.launches == 5
    # Another program on the calibrated roofline, costed by hand: a 2 GFLOP GEMM (2 s / 0.5 = 4 s), a fusion of
    # 0.1 s of bytes run 3 times (3 x 0.1 s / 0.25 = 1.2 s), a dynamic-update-slice of 0.3 s (0.3 s, the
    # copies' efficiency), 5 launches x 0.08 s = 0.4 s: 5.9 s.
    other = [_kernel("a", "matmul", flops=2e9), _kernel("b", "fusion", bytes_read=100_000_000, times=3),
             _kernel("c", "dynamic_update_slice", bytes_read=300_000_000)]  # fmt: skip
    predicted = predict.predict(other, fitted.roofline(ROOF))
    assert predicted["predicted_step_s"] == pytest.approx(5.9)
    assert predicted["predicted_matmul_s"] == pytest.approx(4.0)
    assert predicted["predicted_launch_s"] == pytest.approx(0.4)
    assert predicted["predicted_step_lower_bound_s"] == pytest.approx(2.0 + 0.3 + 0.3)  # the pure roofline


def test_a_median_step_half_the_traced_one_brings_the_split_to_its_level():
    # The profiled step ran at half the speed of the timed ones: every measured second counts as half a second.
    fitted = calibrate.fit(CALIBRATION_OPS, CALIBRATION_KERNELS, ROOF, trace_step_s=16.65, step_s=8.325)
    assert fitted.scale == pytest.approx(0.5)
    assert fitted.efficiency == pytest.approx({"matmul": 1.0, "fusion": 0.5, "copy_dus": 2.0})
    assert fitted.launch_s == pytest.approx(0.04)


def test_ops_that_overlap_beyond_the_step_leave_no_launch_cost():
    # Ops run on two threads at once: their sum (16.25 s) exceeds the traced step's span (10 s). The split is
    # theirs and the level the measured step's: s = 10 / 16.25; no time is left for launches.
    fitted = calibrate.fit(CALIBRATION_OPS, CALIBRATION_KERNELS, ROOF, trace_step_s=10.0, step_s=10.0)
    assert fitted.launch_s == 0.0
    assert fitted.efficiency["matmul"] == pytest.approx(0.5 * 16.25 / 10.0)


def test_a_kernel_without_a_measured_op_counts_as_a_launch_only_and_an_unmeasured_group_keeps_its_cost():
    found = [*CALIBRATION_KERNELS, _kernel("loop_counter.1", "fusion", bytes_read=8, times=5)]
    fitted = calibrate.fit(CALIBRATION_OPS, found, ROOF, trace_step_s=16.65, step_s=16.65)
    assert fitted.efficiency["fusion"] == pytest.approx(0.25)  # the unmeasured kernel's bytes are not in R
    assert fitted.unmatched_kernels == 5 and fitted.launches == 10
    assert fitted.launch_s == pytest.approx(0.04)  # 0.4 s over 10 launches
    # No collective was measured: a collective keeps the uncalibrated ring cost (a 1 GB all-reduce over 2 devices
    # at 1 GB/s: 2 x 1/2 x 1 s = 1 s) plus the fitted launch.
    ring = dataclasses.replace(_kernel("ar", "collective"), collective=("all-reduce", 2, 1_000_000_000))
    assert "collective" not in fitted.efficiency
    assert predict.predict([ring], fitted.roofline(ROOF))["predicted_step_s"] == pytest.approx(1.0 + 0.04)


def _fusion(name: str, nbytes: int, dtype: str = "f32", times: int = 1) -> kernels.Kernel:
    return dataclasses.replace(_kernel(name, "fusion", bytes_read=nbytes, times=times), dtype=dtype)


def test_each_cell_of_precision_and_size_keeps_its_own_efficiency_and_a_new_size_takes_the_nearest():
    # float32 fusions of 4 KiB (4^6 bytes) launched 1000 times run at their roofline (4.096 ms measured), of
    # 4 MiB (4^11) at a quarter of it (16.78 ms), a bf16 fusion of 1 MiB (4^10) at half (2.10 ms); 64-byte
    # fusions launched 10 times take 1 us each (10 us: under 1% of the 22.98 ms measured, so no cell of its own).
    found = [_fusion("small", 4**6, times=1000), _fusion("large", 4**11), _fusion("half", 4**10, "bf16"),
             _fusion("tiny", 64, times=10)]  # fmt: skip
    ops = [_op("small", 4**6 * 1000 / 1e9), _op("large", 4 * 4**11 / 1e9), _op("half", 2 * 4**10 / 1e9),
           _op("tiny", 10e-6)]  # fmt: skip
    step = sum(o["self_s_per_step"] for o in ops)
    fitted = calibrate.fit(ops, found, ROOF, trace_step_s=step, step_s=step)
    assert fitted.cells == pytest.approx({("fusion", "32", 6): 1.0, ("fusion", "32", 11): 0.25,
                                          ("fusion", "16", 10): 0.5})  # fmt: skip
    # The group's one efficiency is the ratio of its sums, by hand: roofline 4.096 + 4.194 + 1.049 + 0.00064 ms
    # over the measured 22.98 ms.
    roofline_ms = 4**6 * 1000 / 1e6 + 4**11 / 1e6 + 4**10 / 1e6 + 640 / 1e6
    assert fitted.efficiency["fusion"] == pytest.approx(roofline_ms / (step * 1e3))
    # Another program: f32 fusions of 16 MiB (4^12: nearest cell 4^11, 0.25) and 16 KiB (4^7: nearest 4^6, 1.0),
    # a bf16 one of 256 KiB (the only bf16 cell, 0.5), a 64-byte one (4^3: nearest 4^6, 1.0); a matmul, whose
    # group has no cell, takes its group's efficiency: none was fitted, so the published formula (1 s).
    other = [_fusion("a", 4**12), _fusion("b", 4**7), _fusion("c", 4**9, "bf16"), _fusion("d", 64),
             _kernel("e", "matmul", flops=1e9)]  # fmt: skip
    by_hand = 4**12 / 1e9 / 0.25 + 4**7 / 1e9 + 4**9 / 1e9 / 0.5 + 64 / 1e9 + 1.0
    assert predict.predict(other, fitted.roofline(ROOF))["predicted_step_s"] == pytest.approx(by_hand)
    # Fitted by group only, every fusion takes the group's efficiency.
    grouped = calibrate.fit(ops, found, ROOF, trace_step_s=step, step_s=step, by="group")
    assert grouped.cells == {} and grouped.efficiency == pytest.approx(fitted.efficiency)
    by_group = sum(k.bytes for k in other) / 1e9 / fitted.efficiency["fusion"] + 1.0
    assert predict.predict(other, grouped.roofline(ROOF))["predicted_step_s"] == pytest.approx(by_group)


def test_by_group_the_calibration_run_predicts_its_own_step_and_by_cell_a_small_cell_borrows_a_neighbour():
    """calibrate.py and docs/predict.md: fitted by group, the run's own program comes back at S; fitted by cell, a
    kernel in a cell under MIN_CELL_SHARE takes the nearest fitted cell's efficiency, so it does not."""
    # The fitting run of the cell test below: 64-byte fusions launched 10 times measured 10 us (under 1%), costed by
    # hand at the nearest cell's (4^6 bytes, efficiency 1.0): 10 x 64 bytes at 1 GB/s = 0.64 us.
    found = [_fusion("small", 4**6, times=1000), _fusion("large", 4**11), _fusion("half", 4**10, "bf16"),
             _fusion("tiny", 64, times=10)]  # fmt: skip
    ops = [_op("small", 4**6 * 1000 / 1e9), _op("large", 4 * 4**11 / 1e9), _op("half", 2 * 4**10 / 1e9),
           _op("tiny", 10e-6)]  # fmt: skip
    step = sum(o["self_s_per_step"] for o in ops)
    grouped = calibrate.fit(ops, found, ROOF, trace_step_s=step, step_s=step, by="group")
    assert predict.predict(found, grouped.roofline(ROOF))["predicted_step_s"] == pytest.approx(step, rel=1e-12)
    by_cell = calibrate.fit(ops, found, ROOF, trace_step_s=step, step_s=step)
    own = predict.predict(found, by_cell.roofline(ROOF))["predicted_step_s"]
    assert own == pytest.approx(step - 10e-6 + 0.64e-6, rel=1e-12) and own != pytest.approx(step, rel=1e-4)
    # The published run's kernels, with a launch cost: by group still exactly S (16.65 s, the trace's span).
    fitted = calibrate.fit(CALIBRATION_OPS, CALIBRATION_KERNELS, ROOF, trace_step_s=16.65, step_s=16.65, by="group")
    assert predict.predict(CALIBRATION_KERNELS, fitted.roofline(ROOF))["predicted_step_s"] == pytest.approx(16.65)


def test_a_calibrated_prediction_says_how_much_of_its_roofline_time_lies_beyond_the_sizes_it_fitted():
    # Cells fitted: float32 fusions of 4^6 and 4^11 bytes, bf16 fusions of 4^10 (as in the test above); the
    # matmul group by group only.
    roof = dataclasses.replace(ROOF, fitted_efficiency={"fusion": 0.5, "matmul": 0.8},
                               fitted_cells={("fusion", "32", 6): 1.0, ("fusion", "32", 11): 0.25,
                                             ("fusion", "16", 10): 0.5})  # fmt: skip
    # Pure-roofline seconds, by hand (1 GB/s, 1 GFLOP/s): own cell 4^11 bytes x 2 launches; float32 above the
    # largest fitted size (4^12, 4^13); bf16 below its only cell (4^9: unseen, not above); a matmul of 1 GFLOP
    # (its group has no cell: unseen, not above); a copy, whose group was not fitted (left out).
    found = [_fusion("own", 4**11, times=2), _fusion("up", 4**12), _fusion("way_up", 4**13),
             _fusion("down", 4**9, "bf16"), _kernel("gemm", "matmul", flops=1e9),
             _kernel("copy", "copy", bytes_read=10**9)]  # fmt: skip
    own, up, down, gemm = 2 * 4**11 / 1e9, (4**12 + 4**13) / 1e9, 4**9 / 1e9, 1.0
    total = own + up + down + gemm
    assert predict.calibration_reach(found, roof) == pytest.approx(
        {"calibration_unseen_share": (up + down + gemm) / total, "calibration_above_share": up / total}
    )
    # Uncalibrated, or calibrated by group only: nothing to say.
    nothing = {"calibration_unseen_share": None, "calibration_above_share": None}
    assert predict.calibration_reach(found, ROOF) == nothing
    assert predict.calibration_reach(found, dataclasses.replace(ROOF, fitted_efficiency={"fusion": 0.5})) == nothing
    line = predict.summary_line(
        {
            "predicted_step_s": 1.0,
            "predicted_step_lower_bound_s": 0.5,
            "calibration_above_share": up / total,
            "prediction_calibrated_on": "runs/a",
        }
    )
    assert f"; {up / total:.0%} of its roofline time in kernels larger than any its calibration run measured" in line


def test_settled_pairs_are_those_every_measurement_orders_alike_and_a_remeasure_rejudges_the_same_predictions():
    first, again = {"x": 1.0, "y": 2.0, "z": 3.0}, {"x": 1.1, "y": 3.2, "z": 3.0}  # y and z swap, x stays first
    assert calibrate.settled_pairs(first, again) == {frozenset("xy"), frozenset("xz")}
    rows = [{"calibrated_on": "x", "variant": v, "step_s_median": first[v], "predicted_step_s": p,
             "predicted_over_measured": p / first[v]} for v, p in (("y", 2.0), ("z", 4.0))]  # fmt: skip
    judged = calibrate.remeasured(rows, again)
    assert [r["predicted_over_measured"] for r in judged] == pytest.approx([2.0 / 3.2, 4.0 / 3.0])
    (row,) = calibrate.summary(judged)  # y predicted faster than z, measured slower: one pair the other way
    assert (row["discordant_pairs"], row["pairs"], row["max_abs_error"]) == (1, 1, pytest.approx(1 - 2.0 / 3.2))
    (row,) = calibrate.summary(judged, calibrate.settled_pairs(first, again))
    assert (row["discordant_pairs"], row["pairs"]) == (0, 0)  # that pair is not settled


def test_a_trace_that_names_none_of_the_programs_kernels_is_refused():
    with pytest.raises(calibrate.CalibrationError, match="--calibrate: .*none of the trace's ops"):
        calibrate.fit([_op("other.1", 1.0)], CALIBRATION_KERNELS, ROOF, trace_step_s=1.0, step_s=1.0, run="r")


def test_an_uncalibrated_roofline_is_the_published_formula():
    # The published formula on a GPU-like roofline: a memory-bound kernel at 85% of the bandwidth.
    gpu = dataclasses.replace(ROOF, memory_efficiency=0.85, gemm_efficiency=0.8)
    assert predict.kernel_seconds(_kernel("f", "fusion", bytes_read=850_000_000), gpu) == pytest.approx((1.0, 0.85))
    assert predict.kernel_seconds(_kernel("d", "matmul", flops=8e8), gpu) == pytest.approx((1.0, 0.8))


def _write_row(directory, row: dict) -> None:
    directory.mkdir()
    (directory / "result.json").write_text(json.dumps(row))


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "is not a directory"),
        (lambda d: d.mkdir(), "holds no result.json"),
        (lambda d: _write_row(d, {"status": "ok", "plan_only": True}), "has no measured step \\(a plan"),
        (lambda d: _write_row(d, {"status": "oom"}), "has no measured step \\(its status is 'oom'\\)"),
        (lambda d: _write_row(d, {"status": "ok", "step_s_median": 1.0}), "has no trace"),
    ],
    ids=["missing", "no_row", "plan", "not_ok", "no_trace"],
)
def test_a_run_that_cannot_calibrate_is_one_line_naming_the_flag(tmp_path, setup, message):
    setup(tmp_path / "run")
    with pytest.raises(calibrate.CalibrationError, match=f"^--calibrate: .*{message}.*give a run directory"):
        calibrate.read_run(tmp_path / "run")


def test_a_run_from_another_device_is_refused():
    device = jax.devices()[0]
    here = {"backend": device.platform, "device_kind": device.device_kind, "hostname": platform.node()}
    calibrate.check_device(here, "r", device)
    with pytest.raises(calibrate.CalibrationError, match="measured with backend 'gpu', this run's is 'cpu'"):
        calibrate.check_device({**here, "backend": "gpu"}, "r", device)
    with pytest.raises(calibrate.CalibrationError, match="measured with hostname 'elsewhere'"):
        calibrate.check_device({**here, "hostname": "elsewhere"}, "r", device)


def test_a_cpu_run_measured_with_another_malloc_is_refused(monkeypatch):
    device = jax.devices()[0]
    here = {"backend": device.platform, "device_kind": device.device_kind, "hostname": platform.node()}
    monkeypatch.setattr(calibration_io.memory, "host_allocator", lambda: "glibc")
    calibrate.check_device({**here, "host_allocator": "glibc"}, "r", device)
    calibrate.check_device(here, "r", device)  # a row from before the column: not checked
    with pytest.raises(calibrate.CalibrationError, match="measured with host_allocator 'tcmalloc', this run's is"):
        calibrate.check_device({**here, "host_allocator": "tcmalloc"}, "r", device)


def test_an_unreadable_trace_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(peaks, "measured_peak", lambda dtype, *a, **k: (1e10, "test peak"))
    monkeypatch.setattr(peaks, "measured_bandwidth", lambda *a, **k: (1e10, "test bandwidth"))
    device = jax.devices()[0]
    run_dir = tmp_path / "run"
    _write_row(run_dir, {"status": "ok", "step_s_median": 1.0, "backend": device.platform,
                         "device_kind": device.device_kind, "hostname": platform.node()})  # fmt: skip
    (run_dir / "plugins" / "profile" / "x").mkdir(parents=True)
    (run_dir / "plugins" / "profile" / "x" / "host.xplane.pb").write_bytes(b"not a trace")
    (run_dir / "step.hlo.txt.gz").write_bytes(gzip.compress(b"HloModule m"))
    with pytest.raises(calibrate.CalibrationError, match="^--calibrate: .*its trace is unreadable"):
        calibrate.calibration(run_dir)
    (run_dir / "step.hlo.txt.gz").write_bytes(b"not gzip")
    with pytest.raises(calibrate.CalibrationError, match="^--calibrate: .*step.hlo.txt.gz is unreadable"):
        calibrate.calibration(run_dir)


def test_bad_calibrate_input_is_one_line_and_exit_2(tmp_path, capsys):
    config = f"--config={REPO / 'configs' / 'bf16_remat.py'}:tiny"
    assert run.main(["run", config, f"--calibrate={tmp_path / 'nowhere'}", f"--output_root={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().startswith("jaxscale: error: --calibrate: ")
    assert run.main(["run", config, "--plan", "--target=a5000", f"--calibrate={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--calibrate: fits the predictor of this machine's device" in err
    sweep = f"--config={REPO / 'experiments' / 'seed_table.py'}:tiny"
    assert runner.main(["sweep", sweep, f"--calibrate={tmp_path}", f"--output_root={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("jaxscale: error: --calibrate: ") and "holds no result.json" in err
    assert runner.main(["sweep", sweep, "--run_arg=--calibrate=x", f"--output_root={tmp_path}"]) == 2
    assert "use the sweep's own --calibrate flag" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text('{"variant": "v", "status": "error"}\n')
    for against, says in ((tmp_path / "missing.jsonl", "is not a readable results.jsonl"),
                          (tmp_path / "empty.jsonl", "has no measured rows")):  # fmt: skip
        assert calibrate.main(["calibrate", "r1", "r2", f"--against={against}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("jaxscale: error: --against: ") and says in err


def test_a_tiny_run_calibrates_the_next_runs_prediction(tmp_path, capsys, monkeypatch):
    """End to end at :tiny: a run with a trace, then a compile-only run of another config with --calibrate on it;
    its row says so. The CPU rooflines are fixed (measuring them takes longer than the runs)."""
    monkeypatch.setattr(peaks, "measured_peak", lambda dtype, *a, **k: (1e10, "test peak"))
    monkeypatch.setattr(peaks, "measured_bandwidth", lambda *a, **k: (1e10, "test bandwidth"))
    config = f"--config={REPO / 'configs' / 'bf16_remat.py'}:tiny"
    first = tmp_path / "first"
    assert run.main(["run", config, f"--run_dir={first}", "--quiet"]) == 0
    assert (first / "step.hlo.txt.gz").exists() and list(first.glob("plugins/profile/*/*.xplane.pb"))
    second = tmp_path / "second"
    assert run.main(["run", config, "--config.model.dtype=float32", f"--run_dir={second}", "--plan",
                     f"--calibrate={first}"]) == 0  # fmt: skip
    row = json.loads((second / "result.json").read_text())
    assert row["prediction_calibrated_on"] == str(first)
    assert row["calibrated_matmul_efficiency"] > 0 and row["calibrated_fusion_efficiency"] > 0
    assert row["calibrated_launch_s"] >= 0 and row["calibrated_attention_efficiency"] is None
    assert row["predicted_uncalibrated_step_s"] > 0 and row["predicted_step_s"] != row["predicted_uncalibrated_step_s"]
    assert 0 <= row["calibration_above_share"] <= row["calibration_unseen_share"] <= 1
    assert f"calibrated on {first}" in row["predicted_roofline_source"]
    assert f"predicted step (cpu, calibrated on {first})" in capsys.readouterr().out
    uncalibrated = json.loads((first / "result.json").read_text())
    assert "prediction_calibrated_on" not in uncalibrated  # the default stays uncalibrated


CALIBRATE = REPO / "experiments" / "results" / "seed_table_cpu_calibrate"
CALIBRATED_SWEEP = REPO / "experiments" / "results" / "seed_table_cpu_calibrated_bf16_scan"


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _table(name: str) -> list[list[str]]:
    """The body cells of docs/predict.md's generated table `name`, as docs_tables writes it from the committed
    rows (tests/report/test_docs_tables.py holds the doc to it; here its cells are redone by hand)."""
    (table,) = [table for table in docs_tables.TABLES if table.name == name]
    lines = docs_tables.render(table).splitlines()[2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_committed_calibration_rows_redo_by_hand_and_hold_docs_predict_md():
    """experiments/results/seed_table_cpu_calibrate: every calibrated prediction redone by hand from the committed
    sums (the formula of docs/predict.md, 'Calibration'), never on its own run; the docs' tables from the rows."""
    rows = _jsonl(CALIBRATE / "calibration.jsonl")
    measured = {r["variant"]: r for r in _jsonl(CALIBRATE / "results.jsonl")}
    assert len(measured) == 7 and len(rows) == 7 * 6
    for r in rows:
        assert r["calibrated_on"] != r["variant"] and r["step_s_median"] == measured[r["variant"]]["step_s_median"]
        assert r["predicted_uncalibrated_step_s"] == pytest.approx(measured[r["variant"]]["predicted_step_s"])
        fitted_r = {g: r[f"calibration_roofline_{g}_s"] for g in calibrate.GROUPS}
        fitted_m = {g: r[f"calibration_measured_{g}_s"] for g in calibrate.GROUPS}
        level = r["calibration_step_s"] / max(r["calibration_trace_step_s"], sum(fitted_m.values()))
        efficiency = {g: fitted_r[g] / (level * fitted_m[g]) for g in fitted_r if fitted_r[g] and fitted_m[g]}
        launch = level * max(0.0, r["calibration_trace_step_s"] - sum(fitted_m.values())) / r["calibration_launches"]
        assert r["roofline_attention_s"] == r["roofline_collective_s"] == 0.0  # none on this CPU
        by_hand = sum(r[f"roofline_{g}_s"] / efficiency[g] for g in ("matmul", "fusion", "copy_dus"))
        by_hand += launch * r["predicted_kernel_launches"]
        assert r["predicted_step_s"] == pytest.approx(by_hand, rel=1e-9)
        assert r["calibrated_launch_s"] == pytest.approx(launch, abs=1e-15)
        for group in ("matmul", "fusion", "copy_dus"):
            assert r[f"calibrated_{group}_efficiency"] == pytest.approx(efficiency[group])
    runs = list(dict.fromkeys(r["calibrated_on"] for r in rows))
    errors = {on: [abs(r["predicted_step_s"] / r["step_s_median"] - 1) for r in rows if r["calibrated_on"] == on]
              for on in runs}  # fmt: skip
    table = _table("calibration-cpu")
    assert [row[0] for row in table] == [*runs, "uncalibrated"]
    for row in table[:-1]:
        first = next(r for r in rows if r["calibrated_on"] == row[0])
        assert row[1] == f"{max(errors[row[0]]):.0%}" and row[2] == f"{sum(errors[row[0]]) / 6:.0%}"
        assert row[5:8] == [f"{first[f'calibrated_{g}_efficiency']:.2f}" for g in ("matmul", "fusion", "copy_dus")]
        assert row[8] == f"{first['calibrated_launch_s'] * 1e6:.0f}"
        mine = [r for r in rows if r["calibrated_on"] == row[0]]
        flipped = sum((a["step_s_median"] - b["step_s_median"]) * (a["predicted_step_s"] - b["predicted_step_s"]) < 0
                      for i, a in enumerate(mine) for b in mine[i + 1 :])  # fmt: skip
        assert row[3] == ("yes" if flipped == 0 else "no") and row[4] == f"{flipped} of 15"
    uncalibrated = [abs(r["predicted_step_s"] / r["step_s_median"] - 1) for r in measured.values()]
    assert table[-1][1:3] == [f"{max(uncalibrated):.0%}", f"{sum(uncalibrated) / 7:.0%}"]
    assert all("no efficiency factors, no launch cost" in r["predicted_roofline_source"] for r in measured.values())
    assert table[-1][5:] == ["1.00", "1.00", "1.00", "0"]  # uncalibrated: the roofline itself, no launch cost
    best = min(runs, key=lambda on: max(errors[on]))
    assert best == "bf16_scan"  # the docs' choice: the smallest largest error
    again = {r["variant"]: r for r in _jsonl(CALIBRATED_SWEEP / "results.jsonl")}
    for row in _table("calibration-cpu-again"):
        name, r = row[0], measured[row[0]]
        assert row[1:3] == [f"{r['step_s_median']:.2f}", f"{r['predicted_step_s']:.2f}"]
        if name == best:
            assert row[3:5] == ["(calibration run)", "-"]
        else:
            mine = next(x for x in rows if x["calibrated_on"] == best and x["variant"] == name)
            assert row[3:5] == [f"{mine['predicted_step_s']:.2f}", f"{mine['predicted_over_measured']:.2f}"]
        # The sweep calibrated on the best run measured every variant again; its rows say so.
        other = again[name]
        assert other["prediction_calibrated_on"] == f"traces/seed_table_cpu_calibrate/{best}"
        fit = next(x for x in rows if x["calibrated_on"] == best)
        for column in ("calibrated_matmul_efficiency", "calibrated_fusion_efficiency", "calibrated_launch_s"):
            assert other[column] == pytest.approx(fit[column])
        if name != best:  # the same program: the sweep predicts what the cross check does
            mine = next(x for x in rows if x["calibrated_on"] == best and x["variant"] == name)
            assert other["predicted_step_s"] == pytest.approx(mine["predicted_step_s"], rel=1e-6)
        again_ratio = other["predicted_step_s"] / other["step_s_median"]
        assert row[5:7] == [f"{other['step_s_median']:.2f}", f"{again_ratio:.2f}"]


def test_the_docs_sentences_on_the_second_sweep_and_the_noise_hold_the_committed_rows():
    """docs/predict.md, 'Calibration': the second sweep's errors and pairs, and how far the medians moved."""
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    first = {r["variant"]: r for r in _jsonl(CALIBRATE / "results.jsonl")}
    again = {r["variant"]: r for r in _jsonl(CALIBRATED_SWEEP / "results.jsonl")}
    six = [name for name in again if name != "bf16_scan"]
    errors = [again[n]["predicted_step_s"] / again[n]["step_s_median"] - 1 for n in six]
    flipped = sum((again[a]["step_s_median"] - again[b]["step_s_median"])
                  * (again[a]["predicted_step_s"] - again[b]["predicted_step_s"]) < 0
                  for i, a in enumerate(six) for b in six[i + 1 :])  # fmt: skip
    mean = sum(abs(e) for e in errors) / len(errors)
    assert f"within {min(errors):.0%} to {max(errors):.0%} of the other six (mean {mean:.0%})" in text
    assert f"orders {flipped} of 15 pairs wrongly" in text
    moved = [again[n]["step_s_median"] / first[n]["step_s_median"] - 1 for n in first]
    assert f"moved by {min(moved):.0%} to {max(moved):+.0%} between the two sweeps" in text
    assert sum(abs(e) > 0.15 for e in errors) == 3  # "it still misses ±15% for three of them"


def test_the_docs_reasons_hold_the_committed_calibration_rows():
    """docs/predict.md, 'Calibration': the figures behind 'does not transfer' and the launch cost, from the rows."""
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    rows = _jsonl(CALIBRATE / "calibration.jsonl")
    four = ("bf16_scan", "bf16_noscan", "bf16_scan_remat_mlp_attn", "bf16_scan_remat_block")
    one = ("bf16_remat_1minibatch", "bf16_remat_batch64")

    def ratios(on: tuple[str, ...], of: tuple[str, ...]) -> list[float]:
        return [r["predicted_over_measured"] for r in rows if r["calibrated_on"] in on and r["variant"] in of]

    def span(values: list[float], spec: str = ".2f") -> str:
        return f"{min(values):{spec}}-{max(values):{spec}}"

    assert f"predict the one-minibatch ones at {span(ratios(four, one))} of their measured step" in text
    assert f"these predict those at {span(ratios(one, four))}" in text
    fast = [1 - x for x in ratios(("fp32_scan",), (*four, *one))]
    slow = [x - 1 for x in ratios((*four, *one), ("fp32_scan",))]
    assert f"predicts the bf16 runs {span(fast, '.0%').replace('%-', '-')} fast" in text
    assert f"predict fp32 {span(slow, '.0%').replace('%-', '-')} slow" in text
    fits = {r["calibrated_on"]: r for r in rows}

    def efficiencies(group: str, runs: tuple[str, ...]) -> str:
        return span([fits[on][f"calibrated_{group}_efficiency"] for on in runs])

    assert f"fusions reach {efficiencies('fusion', one)} of the roofline against {efficiencies('fusion', four)}" in text
    assert f"GEMMs {efficiencies('matmul', one)} against {efficiencies('matmul', four)}" in text
    copies = [f["calibration_measured_copy_dus_s"] / sum(f[f"calibration_measured_{g}_s"] for g in calibrate.GROUPS)
              for f in fits.values()]  # fmt: skip
    assert f"they are {span(copies, '.0%').replace('%-', '-')} of the measured op time" in text
    unmatched = [f["calibration_unmatched_launches"] / f["calibration_launches"] for f in fits.values()]
    assert f"inline: {span(unmatched, '.0%').replace('%-', '-')} of the launches" in text
    fp32 = fits["fp32_scan"]
    uncovered = fp32["calibration_trace_step_s"] - sum(fp32[f"calibration_measured_{g}_s"] for g in calibrate.GROUPS)
    assert [on for on, f in fits.items() if f["calibrated_launch_s"] > 0] == ["fp32_scan"]
    assert (f"leaves {uncovered:.1f} s of its traced {fp32['calibration_trace_step_s']:.2f} s step uncovered "
            f"({fp32['calibrated_launch_s'] * 1e6:.0f} µs per launch)") in text  # fmt: skip
    assert f"also {fp32['calibration_trace_step_s'] / fp32['calibration_step_s'] - 1:.0%} longer" in text
    noscan = fits["bf16_noscan"]
    assert f"({noscan['calibration_trace_step_s']:.2f} s) was " \
           f"{1 - noscan['calibration_trace_step_s'] / noscan['calibration_step_s']:.0%} shorter" in text  # fmt: skip
    assert f"runs {span([x - 1 for x in ratios(('bf16_noscan',), four)], '.0%').replace('%-', '-')} slow" in text


QUIET = {name: REPO / "experiments" / "results" / f"seed_table_cpu_{name}"
         for name in ("calibrate_a", "calibrate_b", "calibrated_bf16_remat_batch64")}  # fmt: skip


def _steps(directory) -> dict[str, float]:
    return {r["variant"]: r["step_s_median"] for r in _jsonl(directory / "results.jsonl")}


def test_each_committed_calibration_predicts_its_own_run_as_docs_predict_md_says():
    """docs/predict.md, 'Calibration': the row of the calibration variant in each sweep calibrated on it, over that
    run's measured step S (its own sweep's results.jsonl and the cross check's calibration_step_s): by group to
    1e-4, by cell within 1%, and the doc's figures."""
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    results = REPO / "experiments" / "results"
    assert "predict their own runs within 1% of `S`" in text
    for calibrated, source, cross_check, by_cell, said in (
        ("calibrated_bf16_scan", "calibrate", "calibration.jsonl", False, "`bf16_scan` of `seed_table_cpu_calibrate`"),
        ("calibrated_bf16_remat_batch64", "calibrate_a", "calibration_cell.jsonl", True, "A's `bf16_remat_batch64`"),
        ("calibrated_bf16_scan_remat_mlp_attn", "tcmalloc_d", "calibration_cell.jsonl", True,
         "D's `bf16_scan_remat_mlp_attn`"),
    ):
        rows = _jsonl(results / f"seed_table_cpu_{calibrated}" / "results.jsonl")
        on = rows[0]["prediction_calibrated_on"]
        assert on.startswith(f"traces/seed_table_cpu_{source}/")
        variant = on.rsplit("/", 1)[1]
        (own,) = [r for r in rows if r["variant"] == variant]
        assert bool(own.get("calibrated_cells")) == by_cell
        step = _steps(results / f"seed_table_cpu_{source}")[variant]
        fits = {r["calibration_step_s"] for r in _jsonl(results / f"seed_table_cpu_{source}" / cross_check)
                if r["calibrated_on"] == variant}  # fmt: skip
        assert fits == {step}  # the calibration's S is that run's measured step
        ratio = own["predicted_step_s"] / step
        assert ratio == pytest.approx(1.0, abs=0.01 if by_cell else 1e-4)
        assert f"{said} at {ratio:.4f}" in text


def _cell_efficiency(fitted: dict, group: str, precision: str, size: int, group_efficiency: float | None):
    """The documented lookup, by hand: the cell's own, else the nearest size (the larger on a tie) of the group
    and precision, else the group's."""
    sizes = [c[2] for c in fitted if c[0] == group and c[1] == precision]
    if sizes:
        return fitted[(group, precision, min(sizes, key=lambda x: (abs(x - size), -x)))]
    return group_efficiency


def _redo_cell_predictions_by_hand(cells: list[dict]) -> None:
    """Every cell-calibrated prediction of a cross check redone from the committed sums (the fit's ratio per
    cell, the documented lookup, the launches)."""
    for r in cells:
        measured = sum(r[f"calibration_measured_{g}_s"] for g in calibrate.GROUPS)
        level = r["calibration_step_s"] / max(r["calibration_trace_step_s"], measured)
        fitted = {}
        for group, precision, size, efficiency, roofline_s, measured_s in r["calibrated_cells"]:
            assert efficiency == pytest.approx(roofline_s / (level * measured_s))
            fitted[(group, precision, size)] = efficiency
        by_hand = sum(seconds / _cell_efficiency(fitted, g, p, size, r[f"calibrated_{g}_efficiency"])
                      for g, p, size, seconds in r["roofline_cells"] if seconds)  # fmt: skip
        by_hand += r["calibrated_launch_s"] * r["predicted_kernel_launches"]
        assert r["predicted_step_s"] == pytest.approx(by_hand, rel=1e-9)
        assert sum(x[3] for x in r["roofline_cells"]) == pytest.approx(
            sum(r[f"roofline_{g}_s"] for g in calibrate.GROUPS), rel=1e-9)  # fmt: skip


def _predictions(rows: list[dict], on: str) -> dict[str, float]:
    """variant -> predicted step of the cross-check rows calibrated on `on`."""
    return {r["variant"]: r["predicted_step_s"] for r in rows if r["calibrated_on"] == on}


def _errors(pred: dict[str, float], measured: dict[str, float]) -> list[float]:
    return [pred[v] / measured[v] - 1 for v in pred]


def _wrong(pred: dict[str, float], measured: dict[str, float], pairs: set | None = None) -> int:
    """Pairs of `pred`'s variants (of `pairs` where given) that the prediction orders against the measurement."""
    return sum((pred[x] - pred[y]) * (measured[x] - measured[y]) < 0
               for x, y in itertools.combinations(sorted(pred), 2)
               if pairs is None or frozenset((x, y)) in pairs)  # fmt: skip


def _max_mean(values: list[float]) -> str:
    return f"{max(map(abs, values)):.1%} / {statistics.mean(map(abs, values)):.1%}"


def _settled(*measurements: dict[str, float]) -> set[frozenset[str]]:
    """Pairs of variants every measurement orders alike (by hand, not calibrate.settled_pairs)."""
    first = measurements[0]
    return {frozenset((x, y)) for x, y in itertools.combinations(first, 2)
            if len({m[x] < m[y] for m in measurements}) == 1}  # fmt: skip


def test_the_cell_calibration_rows_redo_by_hand_and_hold_the_quiet_machine_tables_of_docs_predict_md():
    """docs/predict.md, 'Measured again on a machine to itself': every cell-calibrated prediction of sweep A redone
    by hand from the committed sums; the leave-one-in, out-of-sample and sweep-C tables, the settled pairs and
    the README's sentence, recomputed from the committed predictions and measured steps."""
    cells = _jsonl(QUIET["calibrate_a"] / "calibration_cell.jsonl")
    groups = _jsonl(QUIET["calibrate_a"] / "calibration_group.jsonl")
    a, b, c = (_steps(QUIET[name]) for name in QUIET)
    assert len(cells) == len(groups) == 42 and len(a) == len(b) == len(c) == 7
    _redo_cell_predictions_by_hand(cells)

    settled = _settled(a, b, c)
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    assert f"all three sweeps order the same way ({len(settled)} of the 21)" in text
    peak = {
        r["peak_flops_per_s"] for r in _jsonl(QUIET["calibrate_a"] / "results.jsonl") if r["variant"] == "fp32_scan"
    }
    assert f"measured then at {peak.pop() / 1e9:.0f} GFLOP/s" in text
    moved = max(abs(m[v] / a[v] - 1) for m in (b, c) for v in a)
    assert f"moved by up to {moved:.0%} from sweep A's" in text
    assert f"(`bf16_scan` {a['bf16_scan']:.3f}, {b['bf16_scan']:.3f}, {c['bf16_scan']:.3f} s)" in text
    leave_one_in = _table("calibration-a-leave-one-in")
    assert [row[0] for row in leave_one_in] == list(a)
    for row in leave_one_in:
        by_cell, by_group = _predictions(cells, row[0]), _predictions(groups, row[0])
        assert row[1:4] == [
            _max_mean(_errors(by_group, a)),
            _max_mean(_errors(by_cell, a)),
            f"{_wrong(by_cell, a)} of 15",
        ]
    out_of_sample = _table("calibration-a-out-of-sample")
    assert [row[0] for row in out_of_sample] == list(a)
    for row in out_of_sample:
        pred = _predictions(cells, row[0])
        eb, ec = _errors(pred, b), _errors(pred, c)
        spans = f"{min(eb):+.0%} to {max(eb):+.0%}; {min(ec):+.0%} to {max(ec):+.0%}"
        kept = {p for p in settled if p <= set(pred)}
        assert _wrong(pred, b, kept) == _wrong(pred, c, kept)
        assert row[1:5] == [_max_mean(eb), _max_mean(ec), spans, f"{_wrong(pred, b, kept)} of {len(kept)}"]
    sweep_c = {r["variant"]: r for r in _jsonl(QUIET["calibrated_bf16_remat_batch64"] / "results.jsonl")}
    best = _predictions(cells, "bf16_remat_batch64")
    table_c = _table("calibration-sweep-c")
    assert [row[0] for row in table_c] == [v for v in a if v != "bf16_remat_batch64"]
    for row in table_c:
        r = sweep_c[row[0]]
        assert r["prediction_calibrated_on"] == "traces/seed_table_cpu_calibrate_a/bf16_remat_batch64"
        assert r["predicted_step_s"] == pytest.approx(best[row[0]], rel=1e-6)  # the sweep predicts as the cross check
        assert row[1:5] == [f"{r['step_s_median']:.3f}", f"{r['predicted_uncalibrated_step_s']:.3f}",
                            f"{r['predicted_step_s']:.3f}", f"{r['predicted_over_measured']:.2f}"]  # fmt: skip
    uncalibrated = [r["predicted_uncalibrated_step_s"] / m[r["variant"]] for m in (b, c)
                    for r in cells if r["calibrated_on"] == "bf16_remat_batch64"]  # fmt: skip
    assert f"the same predictions are {min(uncalibrated):.2f}-{max(uncalibrated):.2f} of the measured steps" in text
    eb, ec = _errors(best, b), _errors(best, c)
    readme = " ".join((REPO / "README.md").read_text().split())
    low, high = min(eb + ec), max(eb + ec)
    assert f"within {low:.0%} to {high:+.0%} of fresh measurements" in readme


def test_a_sweep_inside_its_own_traces_is_refused(tmp_path):
    """A calibration run the sweep would replace (its traces directory is the sweep's) is refused before any run."""
    inside = tmp_path / "traces" / "mine" / "bf16_scan"
    inside.parent.mkdir(parents=True)
    _write_row(inside, {"status": "ok", "step_s_median": 1.0})
    (inside / "plugins" / "profile" / "x").mkdir(parents=True)
    (inside / "plugins" / "profile" / "x" / "host.xplane.pb").write_bytes(b"")
    (inside / "step.hlo.txt.gz").write_bytes(gzip.compress(b"HloModule m"))
    sweep = f"{REPO / 'experiments' / 'seed_table.py'}:tiny"
    with pytest.raises(runner.UsageError, match="^--calibrate: .* lies in this sweep's traces"):
        runner.run_sweep(sweep, name="mine", calibrate_on=inside, output_root=tmp_path, progress=False)
    assert runner._run_args([], None, False, None, "both", calibrate_dir="runs/a") == ["--calibrate=runs/a"]


@pytest.mark.slow
def test_a_sweep_calibrated_on_a_tiny_run_predicts_every_variant_calibrated(tmp_path):
    """End to end through the sweep: each variant's process fits the calibration and its row says so."""
    first = tmp_path / "first"
    assert run.main(["run", f"--config={REPO / 'configs' / 'bf16_remat.py'}:tiny", f"--run_dir={first}",
                     "--quiet"]) == 0  # fmt: skip
    sweep = f"--config={REPO / 'experiments' / 'seed_table.py'}:tiny"
    assert runner.main(["sweep", sweep, "--only=bf16_scan,fp32_scan", "--plan", f"--calibrate={first}",
                        f"--output_root={tmp_path}", "--quiet"]) == 0  # fmt: skip
    rows = _jsonl(tmp_path / "experiments" / "results" / "seed_table_tiny_plan_calibrated_first" / "results.jsonl")
    assert sorted(r["variant"] for r in rows) == ["bf16_scan", "fp32_scan"]
    for row in rows:
        assert row["status"] == "ok" and row["prediction_calibrated_on"] == str(first)
        assert row["run_args"] == ["--plan", f"--calibrate={first}"]
        assert row["calibrated_matmul_efficiency"] > 0 and row["predicted_uncalibrated_step_s"] > 0


def test_the_sizes_each_committed_calibration_did_not_see_hold_docs_predict_md():
    """docs/predict.md, 'What the misses have in common': each prediction's calibration_above_share redone from the
    committed cells (its program's roofline seconds per cell against the cells its calibration fitted), and the
    doc's counts, ranges and cell figures recomputed from the rows."""
    rows = _jsonl(QUIET["calibrate_a"] / "calibration_cell.jsonl")
    for r in rows:
        fitted = {(g, p): [] for g, p, *_ in r["calibrated_cells"]}
        for g, p, size, *_ in r["calibrated_cells"]:
            fitted[g, p].append(size)
        counted = [c for c in r["roofline_cells"] if r[f"calibrated_{c[0]}_efficiency"] is not None]
        above = sum(c[3] for c in counted if (c[0], c[1]) in fitted and c[2] > max(fitted[c[0], c[1]]))
        unseen = sum(c[3] for c in counted if c[2] not in fitted.get((c[0], c[1]), []))
        total = sum(c[3] for c in counted)
        assert r["calibration_above_share"] == pytest.approx(above / total, abs=1e-12)
        assert r["calibration_unseen_share"] == pytest.approx(unseen / total, abs=1e-12)
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    far = [r for r in rows if r["calibration_above_share"] >= 0.5]
    assert f"Of the {len(rows)} predictions of sweep A's leave-one-in table, {len(far)} have half or" in text
    for variant, sequences in (("bf16_remat_batch64", "64 sequences in one minibatch"), ("bf16_remat_1minibatch",
                                                                                         "16 sequences")):  # fmt: skip
        mine = [r for r in far if r["variant"] == variant]
        shares = [r["calibration_above_share"] for r in mine]
        ratios = [r["predicted_over_measured"] for r in mine]
        assert (
            f"{len(mine)} of `{variant}` ({sequences}; shares {min(shares):.2f}-{max(shares):.2f}), predicted "
            f"at {min(ratios):.2f}-{max(ratios):.2f}"
        ) in text
    missed = [r for r in rows if abs(r["predicted_over_measured"] - 1) > 0.15]
    batch64 = [r for r in missed if r["variant"] == "bf16_remat_batch64"]
    rest = max(r["calibration_above_share"] for r in missed if r["variant"] != "bf16_remat_batch64")
    assert len(batch64) * 2 == len(missed) and all(r["calibration_above_share"] >= 0.5 for r in batch64)
    assert f"Half of the {len(missed)} predictions off by more than 15%" in text
    assert f"the other half have at most {rest:.0%} of their time above" in text
    largest = {}
    for r in rows:
        cells = [c for c in r["calibrated_cells"] if c[0] == "matmul"]
        largest[r["calibrated_on"]] = max(cells, key=lambda c: c[2])
    big, small = largest["bf16_remat_batch64"], largest["bf16_remat_1minibatch"]
    assert big[2] == 13 and 4**13 / 2**20 == 64  # kernels of 64 MiB and more
    assert (
        f"measured {big[5]:.3f} s for {big[4]:.3f} s of roofline work (efficiency {big[3]:.2f}), the largest "
        f"of `bf16_remat_1minibatch` {small[5]:.3f} s for {small[4]:.3f} s ({small[3]:.2f}): "
        f"{big[5] / small[5]:.1f}x the time for {big[4] / small[4]:.1f}x the work"
    ) in text


TCMALLOC = {name: REPO / "experiments" / "results" / f"seed_table_cpu_{name}"
            for name in ("tcmalloc_d", "tcmalloc_e", "tcmalloc_f", "calibrated_bf16_scan_remat_mlp_attn")}  # fmt: skip


def test_the_tcmalloc_calibration_rows_redo_by_hand_and_hold_docs_predict_md_and_the_readme():
    """docs/predict.md, 'With a caching malloc': sweep D's cross check redone by hand; its tables, the settled
    pairs over D, E, F and G, the calibration run's choice and the doc's and README's sentences recomputed from
    the committed predictions and measured steps."""
    cells = _jsonl(TCMALLOC["tcmalloc_d"] / "calibration_cell.jsonl")
    d, e, f, g = (_steps(TCMALLOC[name]) for name in TCMALLOC)
    assert len(cells) == 42 and len(d) == len(e) == len(f) == len(g) == 7
    for name in TCMALLOC:
        assert {r["host_allocator"] for r in _jsonl(TCMALLOC[name] / "results.jsonl")} == {"tcmalloc"}
    _redo_cell_predictions_by_hand(cells)
    later = {"E": e, "F": f, "G": g}
    settled = _settled(d, e, f, g)
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    assert f"Order is judged on the pairs all four sweeps order alike ({len(settled)} of the 21)" in text

    table = _table("calibration-d-tcmalloc")
    assert [row[0] for row in table] == list(d)
    in_sample = {}
    for row in table:
        pred = _predictions(cells, row[0])
        kept = {p for p in settled if p <= set(pred)}
        counts = {_wrong(pred, m, kept) for m in later.values()}
        assert len(counts) == 1  # settled pairs: every later sweep orders them alike
        in_sample[row[0]] = max(map(abs, _errors(pred, d)))
        spans = "; ".join(f"{min(_errors(pred, m)):+.0%} to {max(_errors(pred, m)):+.0%}" for m in later.values())
        assert row[1:] == [f"{_max_mean(_errors(pred, d))}, {_wrong(pred, d)} of 15",
                           *(_max_mean(_errors(pred, m)) for m in later.values()), spans,
                           f"{counts.pop()} of {len(kept)}"]  # fmt: skip
    # The calibration run of sweep G: the smallest largest error in sweep D's own leave-one-in table.
    chosen = min(in_sample, key=in_sample.get)
    assert chosen == "bf16_scan_remat_mlp_attn"
    sweep_g = {r["variant"]: r for r in _jsonl(TCMALLOC["calibrated_bf16_scan_remat_mlp_attn"] / "results.jsonl")}
    table_g = _table("calibration-sweep-g")
    assert [row[0] for row in table_g] == list(d)
    best = _predictions(cells, chosen)
    for row in table_g:
        r = sweep_g[row[0]]
        assert r["prediction_calibrated_on"] == f"traces/seed_table_cpu_tcmalloc_d/{chosen}"
        if row[0] != chosen:
            assert r["predicted_step_s"] == pytest.approx(best[row[0]], rel=1e-6)
        assert row[1:] == [f"{r['step_s_median']:.3f}", f"{r['predicted_uncalibrated_step_s']:.3f}",
                           f"{r['predicted_step_s']:.3f}", f"{r['predicted_over_measured']:.2f}"]  # fmt: skip
    # The sentences.
    spread = [x for m in later.values() for x in _errors(best, m)]
    means = [statistics.mean(map(abs, _errors(best, m))) for m in later.values()]
    kept = {p for p in settled if p <= set(best)}
    assert (f"land within {min(spread):.0%} to {max(spread):+.0%} of three later measurements of them (E, F, G; "
            f"mean {min(means):.1%}-{max(means):.1%}) and every settled pair is in its measured order "
            f"({_wrong(best, e, kept)} of {len(kept)})") in text  # fmt: skip
    block = _predictions(cells, "bf16_scan_remat_block")
    spread_block = [x for m in later.values() for x in _errors(block, m)]
    assert f"`bf16_scan_remat_block` does the same ({min(spread_block):.0%} to {max(spread_block):+.0%}, 0 of" in text
    assert f"misses by up to {in_sample[chosen]:.1%} and orders {_wrong(best, d)} of 15 pairs wrongly" in text
    flipped = [(x, y) for x, y in itertools.combinations(sorted(best), 2)
               if (best[x] - best[y]) * (d[x] - d[y]) < 0]  # fmt: skip
    assert flipped == [("bf16_noscan", "fp32_scan")] and all((m["bf16_noscan"] < m["fp32_scan"]) for m in (e, f, g))
    under = {round(1 - best["bf16_remat_batch64"] / m["bf16_remat_batch64"], 2) for m in later.values()}
    assert {round(x, 2) for x in under} <= {0.06} and "predicted 6% under each of its later steps" in text
    above = next(r["calibration_above_share"] for r in cells
                 if r["calibrated_on"] == chosen and r["variant"] == "bf16_remat_batch64")  # fmt: skip
    assert f"({above:.0%} of its roofline time above the calibration's sizes" in text
    noscan = [x for m in later.values() for x in _errors(_predictions(cells, "bf16_noscan"), m)]
    assert f"predicts the scanned variants {min(noscan):.0%}-{max(noscan):.0%} slow" in text
    one_minibatch = [min(x for m in later.values() for x in _errors(_predictions(cells, on), m))
                     for on in ("bf16_remat_1minibatch", "bf16_remat_batch64")]  # fmt: skip
    assert f"predict the others up to {-max(one_minibatch):.0%}-{-min(one_minibatch):.0%} fast" in text
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"predicts the six others within {min(spread):.0%} to {max(spread):+.0%} of three later sweeps" in readme


def test_the_tcmalloc_cross_check_redone_after_the_scatter_fix_keeps_its_conclusions():
    """docs/predict.md: sweep D's cross check computed again after scatters were priced in place (committed beside
    the first): how far each prediction moved, and the chosen calibration's band and order against E, F, G."""
    before = _jsonl(TCMALLOC["tcmalloc_d"] / "calibration_cell.jsonl")
    after = _jsonl(TCMALLOC["tcmalloc_d"] / "calibration_cell_scatter_in_place.jsonl")
    assert [(r["calibrated_on"], r["variant"]) for r in before] == [(r["calibrated_on"], r["variant"]) for r in after]
    _redo_cell_predictions_by_hand(after)
    moved = max(abs(a["predicted_step_s"] / b["predicted_step_s"] - 1) for a, b in zip(after, before, strict=True))
    uncalibrated = max(abs(a["predicted_uncalibrated_step_s"] / b["predicted_uncalibrated_step_s"] - 1)
                       for a, b in zip(after, before, strict=True))  # fmt: skip
    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    assert (
        f"moves the calibrated predictions by at most {moved:.1%} and the uncalibrated by at most {uncalibrated:.1%}"
        in text
    )
    d, e, f, g = (_steps(TCMALLOC[name]) for name in TCMALLOC)
    pred = _predictions(after, "bf16_scan_remat_mlp_attn")
    errors = [x for m in (e, f, g) for x in _errors(pred, m)]
    kept = {p for p in _settled(d, e, f, g) if p <= set(pred)}
    wrong = {_wrong(pred, m, kept) for m in (e, f, g)}
    assert f"stay within {min(errors):.0%} to {max(errors):+.0%} of E, F and G and {wrong.pop()} of {len(kept)}" in text
    assert not wrong

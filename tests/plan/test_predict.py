"""jaxscale.plan.predict: kernel rooflines, the predicted columns of plans and runs, and the notebook check."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import REPO, load_config

from jaxscale import run
from jaxscale.measure import kernels
from jaxscale.plan import gpu_plan, predict, targets
from jaxscale.sweep.results import format_table
from jaxscale.sweep.sweep_file import load_sweep

needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
A5000 = targets.TARGETS["a5000"]


def _kernel(category: str = "fusion", **fields) -> kernels.Kernel:
    base = dict(name="k", category=category, detail="test", trips=(), times=1, flops=0.0, flop_dtype="vector",
                bytes_read=0, bytes_written=0)  # fmt: skip
    return kernels.Kernel(**{**base, **fields})


def test_a_memory_bound_kernel_moves_its_bytes_at_the_sustained_bandwidth():
    roof = predict.gpu_roofline(A5000)
    kernel = _kernel(flops=1e6, bytes_read=2**27, bytes_written=2**27)
    seconds, bound = predict.kernel_seconds(kernel, roof)
    assert seconds == pytest.approx(2**28 / (768e9 * predict.MEMORY_EFFICIENCY))
    assert bound == pytest.approx(2**28 / 768e9)


def test_a_large_bf16_gemm_runs_at_the_gemm_efficiency_of_the_tensor_peak():
    roof = predict.gpu_roofline(A5000)
    m, n, k = 8192, 4096, 1024  # 64 x 32 tiles of 128x128: exactly 32 waves on 64 SMs
    gemm = _kernel("matmul", flops=2.0 * m * n * k, flop_dtype="bf16", gemm=(1, m, n, k),
                   bytes_read=2 * (m * k + n * k), bytes_written=2 * m * n)  # fmt: skip
    assert predict.quantization(gemm.gemm, A5000.core_count) == 1.0
    seconds, bound = predict.kernel_seconds(gemm, roof)
    assert seconds == pytest.approx(gemm.flops / (111.1e12 * predict.GEMM_EFFICIENCY))
    assert bound == pytest.approx(gemm.flops / 111.1e12)
    tf32 = dataclasses.replace(gemm, flop_dtype="tf32")  # a float32 dot at DEFAULT precision: TF32, half the rate
    assert predict.kernel_seconds(tf32, roof)[0] == pytest.approx(gemm.flops / (55.6e12 * predict.GEMM_EFFICIENCY))


def test_a_gemm_one_tile_past_a_wave_pays_for_a_second_wave():
    full = (1, 128 * 8, 128 * 8, 512)  # 64 tiles: one wave on 64 SMs
    assert predict.quantization(full, 64) == 1.0
    assert predict.quantization((1, 128 * 8 + 1, 128 * 8, 512), 64) == pytest.approx((1025 * 1024) / (2 * 64 * 128**2))


def test_collectives_move_the_ring_algorithms_bytes_over_the_link():
    roof = predict.gpu_roofline(targets.TARGETS["h100"])
    all_reduce = _kernel("collective", collective=("all-reduce", 4, 10**9))
    assert predict.kernel_seconds(all_reduce, roof)[0] == pytest.approx(2 * 3 / 4 * 1e9 / 450e9)  # NVLink
    across_hosts = _kernel("collective", collective=("all-gather", 16, 10**9))
    assert predict.kernel_seconds(across_hosts, roof)[0] == pytest.approx(15 / 16 * 1e9 / 50e9)  # the network
    assert predict.collective_factor("all-reduce", 1) == 0.0


def test_the_step_is_the_sum_of_its_parts_times_their_launches():
    roof = predict.gpu_roofline(A5000)
    found = [_kernel(bytes_read=10**6, times=12, trips=(12,)), _kernel("copy", bytes_read=10**7, bytes_written=10**7)]
    columns = predict.predict(found, roof)
    parts = sum(columns[f"predicted_{name}_s"] for name in predict.BREAKDOWN)
    assert columns["predicted_step_s"] == pytest.approx(parts)
    assert columns["predicted_launch_s"] == pytest.approx(13 * predict.LAUNCH_S)
    assert columns["predicted_kernel_launches"] == 13
    assert columns["predicted_step_lower_bound_s"] < columns["predicted_step_s"]


def test_a_target_without_a_datasheet_peak_gets_no_prediction_and_says_why():
    mystery = dataclasses.replace(A5000, name="mystery", device_kind="Mystery GPU 9000")
    columns = predict.target_columns(load_config("bf16", "tiny"), mystery, {"triton": []})
    assert columns["predicted_step_s"] is None and "Mystery GPU 9000" in columns["predicted_error"]


def test_predicted_mfu_on_a_mesh_divides_by_every_gpus_peak():
    # The same per-device program on 8 GPUs: the step's model FLOPs are the mesh's, so is the peak.
    config = load_config("bf16", "tiny")
    found = [_kernel(bytes_read=10**6, times=4, trips=(4,))]
    one = predict.target_columns(config, A5000, {"cublas": found})
    eight = predict.target_columns(config, A5000, {"cublas": found}, devices=8)
    assert eight["predicted_step_s"] == one["predicted_step_s"]
    assert eight["predicted_mfu"] == pytest.approx(one["predicted_mfu"] / 8)


def test_variants_rank_by_predicted_tokens_per_s_and_plans_that_do_not_fit_drop_out():
    rows = [
        {"variant": "slow", "status": "ok", "plan_fits": True, "predicted_tokens_per_s": 1000.0},
        {"variant": "fast", "status": "ok", "plan_fits": True, "predicted_tokens_per_s": 3000.0},
        {"variant": "too_big", "status": "ok", "plan_fits": False, "predicted_tokens_per_s": 9000.0},
        {"variant": "failed", "status": "error", "predicted_tokens_per_s": None},
    ]
    ranked = predict.rank_by_predicted_throughput(rows)
    assert [(r["variant"], r["predicted_rank"]) for r in ranked] == [("fast", 1), ("slow", 2)]
    assert [r["variant"] for r in predict.rank_by_predicted_throughput(rows, fitting_only=False)][0] == "too_big"


def test_a_cpu_run_row_has_its_prediction_beside_its_measured_step(tmp_path):
    row = run.run(load_config("bf16_remat", "tiny"), tmp_path / "run", "predict_cpu", progress=False)
    assert row["status"] == "ok"
    assert row["predicted_step_s"] > 0 and row["predicted_kernel_launches"] > 0
    assert row["predicted_over_measured"] == pytest.approx(row["predicted_step_s"] / row["step_s_median"])
    assert row["predicted_roofline_source"].startswith("measured: jitted 2048x2048 float32 matmul")
    assert "in-place x*2" in row["predicted_roofline_source"]  # the measured memory bandwidth
    header = format_table([{**row, "variant": "v", "baseline": "v"}]).splitlines()[0]
    assert "predicted s" in header and "pred / meas" in header
    assert "predicted step (cpu)" in run.summary(row)


@needs_extra
def test_a_target_plan_predicts_its_step_from_both_gemm_modes():
    config = load_config("bf16_remat", "tiny")
    plan = gpu_plan.plan_for_target(config, "a5000")
    assert plan["predicted_step_s"] == min(plan["predicted_triton_step_s"], plan["predicted_cublas_step_s"])
    assert plan["predicted_step_s"] == plan[f"predicted_{plan['predicted_gemm']}_step_s"]
    assert 0 < plan["predicted_step_lower_bound_s"] < plan["predicted_step_s"]
    tokens = config.data.batch_size * config.data.seq_len
    assert plan["predicted_tokens_per_s"] == pytest.approx(tokens / plan["predicted_step_s"])
    assert plan["predicted_unknown_trip_count_kernels"] == 0
    assert "RTX A5000" in plan["predicted_roofline_source"]


@needs_extra
@pytest.mark.slow
def test_the_a5000_prediction_keeps_the_notebooks_order_and_each_variant_within_25_percent():
    """The notebook's measured A5000 step times (experiments/seed_table.py NOTEBOOK_STEP_S) against the
    prediction from each variant's target compile at :seed (12 compiles, several minutes on 2 cores)."""
    sweep = load_sweep(f"{REPO / 'experiments' / 'seed_table.py'}:seed")
    measured = sweep.notebook_step_s
    predicted = {
        v.name: gpu_plan.plan_for_target(v.config, "a5000")["predicted_step_s"]
        for v in sweep.variants
        if v.name in measured
    }
    ratios = {name: predicted[name] / measured[name] for name in measured}
    assert all(0.75 <= r <= 1.25 for r in ratios.values()), ratios
    assert sorted(measured, key=measured.get) == sorted(predicted, key=predicted.get)

"""Planning GPU memory for a target on a CPU-only machine: the plan, remat's effect, not fitting, bad input."""

import json

import pytest

from jaxscale import gpu_plan, reference, run, targets

needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")


def _tiny(config_file: str, **overrides):
    return reference.load_config(config_file, "tiny", overrides)


@pytest.fixture(scope="module")
def remat_scan_plan():
    return gpu_plan.plan_for_target(_tiny("bf16_remat.py"), "a5000", gemm="triton")


@needs_extra
def test_run_plans_a_tiny_config_for_an_a5000(tmp_path, capsys):
    argv = ["run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--target", "a5000"]
    assert run.main([*argv, "--run_dir", str(tmp_path / "plan")]) == 0
    row = json.loads((tmp_path / "plan" / "result.json").read_text())
    assert row["status"] == "ok" and row["plan_only"] is True
    assert row["compiled_backend"] == "cuda:a5000"
    assert row["plan_target_device_kind"] == "NVIDIA RTX A5000"
    assert row["plan_target_memory_bytes"] == targets.TARGETS["a5000"].device_memory_size
    parts = row["compiled_argument_bytes"] + row["compiled_output_bytes"] - row["compiled_alias_bytes"]
    assert row["compiled_peak_bytes"] == parts + row["compiled_temp_bytes"] > 0
    band = (row["compiled_triton_peak_bytes"], row["compiled_cublas_peak_bytes"])
    assert min(band) > 0 and row["compiled_peak_bytes"] == max(band)
    assert row["plan_fits"] is True and row["compiled_remat_limit_bytes"] is None
    assert row["compile_s"] > 0
    assert "target a5000 (NVIDIA RTX A5000" in capsys.readouterr().out


@needs_extra
def test_remat_with_scan_lowers_the_planned_temp_bytes(remat_scan_plan):
    scan_only = gpu_plan.plan_for_target(_tiny("bf16.py"), "a5000", gemm="triton")
    assert remat_scan_plan["compiled_temp_bytes"] < scan_only["compiled_temp_bytes"]
    assert remat_scan_plan["compiled_argument_bytes"] == scan_only["compiled_argument_bytes"]


@needs_extra
def test_a_config_far_too_large_does_not_fit_and_says_why():
    config = _tiny("bf16.py", **{"data.batch_size": 2**16, "train.num_minibatches": 1})
    plan = gpu_plan.plan_for_target(config, "a5000", gemm="triton")
    memory = targets.TARGETS["a5000"].device_memory_size
    assert plan["plan_fits"] is False
    assert "could not rematerialize below" in plan["plan_fits_reason"]
    assert plan["compiled_remat_limit_bytes"] < memory < plan["compiled_remat_reached_bytes"]
    assert plan["compiled_peak_bytes"] > memory


def test_an_unknown_target_is_one_line_listing_the_known_ones(capsys):
    argv = ["run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--target", "a6000"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxscale: error: --target")
    assert all(name in err for name in targets.TARGETS)


def test_a_target_without_plan_is_refused(capsys):
    assert run.main(["run", "--config", "configs/bf16_remat.py:tiny", "--target", "a5000"]) == 2
    assert "add --plan" in capsys.readouterr().err


def test_without_the_extra_the_error_names_it(monkeypatch, capsys):
    monkeypatch.setattr(gpu_plan, "EXTRA_MODULES", ("jax_plugins.no_such_cuda_plugin",))
    argv = ["run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--target", "a5000"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e '.[gpu-plan]'" in err


def test_a_target_file_with_zero_memory_is_bad_input(tmp_path, capsys):
    path = tmp_path / "zero.txtpb"
    text = targets.target_config_text(targets.TARGETS["a5000"])
    path.write_text(
        text.replace(f"device_memory_size: {targets.TARGETS['a5000'].device_memory_size}", "device_memory_size: 0")
    )
    argv = ["run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--target", str(path)]
    assert run.main(argv) == 2
    assert "device_memory_size must be a positive integer" in capsys.readouterr().err


@needs_extra
def test_a_target_that_kills_the_compiler_is_a_failed_row_not_a_crash(tmp_path):
    path = tmp_path / "broken.txtpb"
    path.write_text(
        targets.target_config_text(targets.TARGETS["a5000"]).replace("threads_per_warp: 32", "threads_per_warp: 0")
    )
    argv = ["run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--quiet", "--target", str(path)]
    assert run.main([*argv, "--run_dir", str(tmp_path / "plan")]) == 1
    row = json.loads((tmp_path / "plan" / "result.json").read_text())
    assert row["status"] == "error" and "SIGFPE" in row["error"]


@pytest.mark.slow
@needs_extra
def test_the_reference_table_planned_for_an_a5000_matches_the_notebook():
    """Each bf16 variant's plan comes within 10% of the notebook's peak; fp32 needs XLA's auto-remat.

    The notebook's A5000 autotuned its GEMMs (Triton or cuBLAS, per GEMM); here the step is planned with
    each, and the notebook's peak must lie within 10% of that band [min, max].
    """
    rows = {v.name: reference.plan_variant(v, "a5000") for v in reference.NOTEBOOK_VARIANTS}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["error"])
        if name.startswith("bf16"):
            band = [row[f"compiled_{m}_peak_bytes"] / row["notebook_peak_bytes"] for m in ("triton", "cublas")]
            assert min(band) <= 1.10 and max(band) >= 0.90, (name, band)
            assert row["plan_fits"] is True, name
    fp32 = rows["fp32, scan"]
    assert fp32["plan_fits"] is False and fp32["compiled_remat_limit_bytes"] is not None


def test_xlas_rematerialization_warning_is_parsed_to_bytes():
    line = (
        "W0000 hlo_rematerialization.cc:3005] Can't reduce memory use below 1.00KiB (1024 bytes) by "
        "rematerialization; only reduced to 2.00KiB (2048 bytes), down from 3.00KiB (3072 bytes) originally"
    )
    assert gpu_plan.parse_remat_warning(f"noise\n{line}\n") == {
        "compiled_remat_limit_bytes": 1024,
        "compiled_remat_reached_bytes": 2048,
        "compiled_remat_original_bytes": 3072,
    }
    assert gpu_plan.parse_remat_warning("no warning here") is None

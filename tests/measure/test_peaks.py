"""jaxscale.peaks: the datasheet table by device_kind, and the measured, cached CPU roofline."""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import pytest

from jaxscale.measure import peaks
from jaxscale.plan import targets


@pytest.mark.parametrize(
    "device_kind, dtype, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
        ("NVIDIA H100 PCIe", "bfloat16", 756.5e12),
        ("NVIDIA H200", "bfloat16", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA RTX A5000", "bfloat16", 111.1e12),
        ("NVIDIA L4", "bfloat16", 121e12),
        ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2e12),
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5", "bfloat16", 459e12),
        ("TPU v5p", "bfloat16", 459e12),
        ("TPU v6 lite", "bfloat16", 918e12),
        ("NVIDIA A100-PCIE-40GB", "float32", 156e12),  # TF32 tensor cores at XLA's default precision
    ],
)
def test_datasheet_peaks_by_device_kind(device_kind, dtype, expected):
    value, source = peaks.peak_flops(device_kind, dtype)
    assert value == expected
    assert source  # every figure names where it comes from


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_every_planning_target_has_a_peak(name):
    """One table for both: each GPU target of deviceless planning finds its peak by device_kind."""
    value, source = peaks.peak_flops(targets.TARGETS[name].device_kind, "bfloat16")
    assert value is not None, source


def test_full_precision_float32_and_unknown_devices():
    assert peaks.peak_flops("NVIDIA A100-SXM4-40GB", "float32", precision="highest")[0] == 19.5e12
    assert peaks.peak_flops("TPU v4", "float32", precision="highest")[0] is None
    value, source = peaks.peak_flops("Some Future Accelerator", "bfloat16")
    assert value is None and "no datasheet peak" in source
    for lookalike in ("NVIDIA L40", "TPU v4 lite", "NVIDIA GH200 480GB"):  # not in the table: no borrowed peak
        assert peaks.peak_flops(lookalike, "bfloat16")[0] is None, lookalike
    assert peaks.peak_flops("NVIDIA L40S", "bfloat16")[0] != peaks.peak_flops("NVIDIA L4", "bfloat16")[0]
    assert peaks.peak_flops("cpu", "float32")[0] is None  # a CPU gets a measured roofline instead


def test_measured_cpu_peak_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    value, source = peaks.measured_peak("float32", size=128)
    assert value > 0 and source.startswith("measured")
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert [entry["flops_per_s"] for entry in cached.values()] == [value]

    def must_not_measure(*args, **kwargs):
        raise AssertionError("a cached roofline must not be measured again")

    monkeypatch.setattr(peaks, "measure_matmul_flops", must_not_measure)
    assert peaks.measured_peak("float32", size=128)[0] == value


def _measurements(monkeypatch, *values: float) -> list[float]:
    """Stubs the matmul measurement to return `values` in turn; returns the list of what it returned."""
    returned, pending = [], list(values)

    def measure(dtype, size=2048, repeats=5):
        returned.append(pending.pop(0))
        return returned[-1]

    monkeypatch.setattr(peaks, "measure_matmul_flops", measure)
    return returned


def _age_cache(path, seconds: float | None) -> None:
    """Makes every entry of a cache file `seconds` old (None: drops its time, as caches before the limit had)."""
    cache = json.loads(path.read_text())
    for entry in cache.values():
        entry.pop("measured_unix")
        if seconds is not None:
            entry["measured_unix"] = time.time() - seconds
    path.write_text(json.dumps(cache))


def test_the_cached_roofline_belongs_to_one_cpu_model_and_core_count(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    measured = _measurements(monkeypatch, 1e11, 2e11)
    monkeypatch.setattr(peaks, "cpu_name", lambda: "AMD EPYC, 2 cores")
    assert peaks.measured_peak("float32", size=128)[0] == 1e11
    monkeypatch.setattr(peaks, "cpu_name", lambda: "AMD EPYC, 16 cores")  # same host name, more cores
    value, source = peaks.measured_peak("float32", size=128)
    assert value == 2e11 and "AMD EPYC, 16 cores" in source
    monkeypatch.setattr(peaks, "cpu_name", lambda: "AMD EPYC, 2 cores")
    assert peaks.measured_peak("float32", size=128)[0] == 1e11 and measured == [1e11, 2e11]  # no third measurement
    cpus = sorted(entry["cpu"] for entry in json.loads((tmp_path / "peak_flops.json").read_text()).values())
    assert cpus == ["AMD EPYC, 16 cores", "AMD EPYC, 2 cores"]


def test_the_cpu_is_named_by_its_model_and_the_cores_this_process_may_use():
    name = peaks.cpu_name()
    assert name.endswith(f", {len(os.sched_getaffinity(0))} cores")
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    models = [
        line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
    ]
    if models:
        assert name.startswith(models[0])


@pytest.mark.parametrize("age_s", [peaks.MAX_AGE_S + 60, None], ids=["older_than_the_limit", "without_a_time"])
def test_an_old_cached_roofline_is_measured_again(tmp_path, monkeypatch, age_s):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    measured = _measurements(monkeypatch, 5e10, 9e10, 1e12)
    assert peaks.measured_peak("float32", size=128)[0] == 5e10
    _age_cache(tmp_path / "peak_flops.json", 3600.0)  # an hour old: still good
    assert peaks.measured_peak("float32", size=128)[0] == 5e10
    _age_cache(tmp_path / "peak_flops.json", age_s)
    assert peaks.measured_peak("float32", size=128)[0] == 9e10
    assert measured == [5e10, 9e10]
    (entry,) = json.loads((tmp_path / "peak_flops.json").read_text()).values()
    assert entry["flops_per_s"] == 9e10 and time.time() - entry["measured_unix"] < 60


def test_a_run_that_measures_the_matmul_faster_than_the_cache_replaces_a_stale_roofline(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    _measurements(monkeypatch, 5e10)  # cached while the machine was loaded
    assert peaks.measured_peak("float32", size=128)[0] == 5e10
    assert peaks.record_matmul("float32", 128, 3e10) is None  # slower: a loaded moment, the cache stays
    assert peaks.measured_peak("float32", size=128)[0] == 5e10
    note = peaks.record_matmul("float32", 128, 8e10)  # 60% faster than the cache: it was stale
    assert "stale" in note and "50.0 GFLOP/s" in note and "80.0" in note
    assert peaks.measured_peak("float32", size=128)[0] == 8e10
    assert peaks.record_matmul("float32", 128, 8.4e10) is None  # 5% faster: noise, kept as the better, no flag
    assert peaks.measured_peak("float32", size=128)[0] == 8.4e10


def test_an_unreadable_cache_is_measured_again_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    (tmp_path / "peak_flops.json").write_text('{"half a fi')
    _measurements(monkeypatch, 4e10)
    assert peaks.measured_peak("float32", size=128)[0] == 4e10


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the measured roofline is the CPU's peak")
def test_resolve_peak_on_cpu_measures(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peaks, "measure_matmul_flops", lambda dtype, size=2048, repeats=5: 1.5e11)
    assert peaks.resolve_peak("bfloat16")[0] == 1.5e11


def test_fp8_peaks_are_twice_the_bf16_ones_and_absent_without_fp8_tensor_cores():
    """Each datasheet gives FP8 (FP32 accumulate) at twice its BF16 rate on Ada, Hopper and Blackwell: the table's
    FP8 figures, typed from the datasheets, hold that; Ampere has none (None, not a borrowed figure)."""
    with_fp8 = [t for t in targets.TARGETS.values() if t.compute_capability >= (8, 9)]
    assert {t.name for t in with_fp8} >= {"h100", "h200", "b200", "gb200", "l40s", "l4", "rtx4090"}
    for target in with_fp8:
        fp8, source = peaks.peak_flops(target.device_kind, peaks.FP8)
        bf16, _ = peaks.peak_flops(target.device_kind, "bfloat16")
        # 2% : the L40S datasheet itself gives BF16 dense 362.05 but sparse 733 (= 2 x 366.5), and FP8 dense 733
        assert fp8 == pytest.approx(2 * bf16, rel=0.02), (target.name, source)
    for target in (t for t in targets.TARGETS.values() if t.compute_capability < (8, 9)):
        assert peaks.peak_flops(target.device_kind, peaks.FP8)[0] is None, target.name

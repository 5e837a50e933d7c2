"""jaxscale.peaks: the datasheet table by device_kind, and the measured, cached CPU roofline."""

from __future__ import annotations

import json

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
    for lookalike in ("NVIDIA L40S", "TPU v4 lite", "NVIDIA GH200 480GB"):  # not in the table: no borrowed peak
        assert peaks.peak_flops(lookalike, "bfloat16")[0] is None, lookalike
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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the measured roofline is the CPU's peak")
def test_resolve_peak_on_cpu_measures(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peaks, "measure_matmul_flops", lambda dtype, size=2048, repeats=5: 1.5e11)
    assert peaks.resolve_peak("bfloat16")[0] == 1.5e11

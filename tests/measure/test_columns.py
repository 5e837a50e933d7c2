"""The run summary's measurement lines: a utilization above 100% is called out, never shown as if it could be."""

from jaxscale.measure import columns


def _row(mfu: float, hfu: float, backend: str = "cpu") -> dict:
    return {"mfu": mfu, "hfu": hfu, "backend": backend, "peak_flops_source": "measured: a jitted matmul"}


def test_a_utilization_above_100_percent_says_the_peak_is_stale():
    """Seen on this machine: MFU 169.5% against a roofline cached while other jobs loaded the cores; the summary
    says the step beat the cached peak and how to measure it again."""
    lines = columns.summary_lines(_row(1.695, 2.005))
    assert lines[0].startswith("  MFU 169.5%  HFU 200.5%")
    assert lines[1].startswith("  utilization above 100%: this step ran faster than the cached roofline")
    assert "python -m jaxscale.bench" in lines[1]
    gpu = columns.summary_lines(_row(0.9, 1.2, "gpu"))  # HFU alone above: the datasheet peak is wrong for it
    assert gpu[1] == "  utilization above 100%: this step ran faster than the peak it is divided by; that peak is wrong"


def test_a_utilization_under_100_percent_adds_nothing():
    assert columns.summary_lines(_row(0.42, 0.55)) == ["  MFU 42.0%  HFU 55.0%  (peak: measured: a jitted matmul)"]

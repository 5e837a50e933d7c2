"""jaxscale.plan.collective_rates: the published nccl-tests tables as the predictor reads them.

The tables hold each row's measured time; nccl-tests prints a bus bandwidth beside it (busbw = ring factor x size /
time), which the tests below read from the same sources as a second, independent column: the table's derived bus
bandwidth must equal the published one to its rounding."""

from __future__ import annotations

import pytest

from jaxscale.measure import kernels
from jaxscale.plan import collective_rates, predict, targets

GIB, MIB = 2**30, 2**20
# (fabric, collective, size in bytes, published busbw in GB/s), read from the sources named in collective_rates:
# waynehacking8/nccl-collectives-bench @ 8ab7496 results/quiet/*.txt (4 H100s) and stas00/ml-engineering
# network/README.md (8 A100s).
PUBLISHED_BUSBW = [
    ("nvlink4", "all-reduce", 64 * 1024, 3.86),
    ("nvlink4", "all-reduce", GIB, 355.35),
    ("nvlink4", "all-reduce", 8 * GIB, 366.18),
    ("nvlink4", "all-gather", 16 * MIB, 187.12),
    ("nvlink4", "all-gather", 8 * GIB, 343.53),
    ("nvlink4", "reduce-scatter", MIB, 30.45),
    ("nvlink4", "reduce-scatter", 128 * MIB, 290.24),
    ("nvlink3", "all-reduce", 32 * 1024, 1.31),
    ("nvlink3", "all-reduce", 16 * MIB, 106.16),
    ("nvlink3", "all-reduce", 16 * GIB, 234.89),
]


@pytest.mark.parametrize("fabric, op, size, busbw", PUBLISHED_BUSBW)
def test_each_tables_times_give_the_bus_bandwidth_nccl_tests_printed_beside_them(fabric, op, size, busbw):
    table = collective_rates.TABLES[fabric][op]
    row = table.sizes.index(size)
    assert table.bus_bytes_per_s(row) / 1e9 == pytest.approx(busbw, rel=0.01, abs=0.006)
    # at a measured size, on the table's own GPU count, the predicted time is the measured one
    assert collective_rates.seconds(table, op, table.gpus, size) == pytest.approx(table.seconds[row], rel=1e-12)


def test_between_sizes_the_bandwidth_lies_between_its_neighbours_and_beyond_them_the_end_rows_hold():
    table = collective_rates.TABLES["nvlink4"]["all-gather"]
    low, high = table.bus_bytes_per_s(8), table.bus_bytes_per_s(9)  # 16 MiB, 32 MiB
    middle = collective_rates.bus_bytes_per_s(table, 24 * MIB)
    assert low < middle < high
    # log-log: at the geometric middle the bandwidth is the geometric mean of the neighbours
    assert collective_rates.bus_bytes_per_s(table, 2**24.5) == pytest.approx((low * high) ** 0.5, rel=1e-12)
    # past the largest measured size (8 GiB: 18,753.6 us) time grows in proportion: 16 GiB takes twice as long
    assert collective_rates.seconds(table, "all-gather", 4, 16 * GIB) == pytest.approx(2 * 18753.6e-6, rel=1e-9)
    # below the smallest (64 KiB: 25.05 us) no collective is faster: the latency floor
    assert collective_rates.seconds(table, "all-gather", 4, 1024) == pytest.approx(25.05e-6, rel=1e-12)
    assert collective_rates.seconds(table, "all-gather", 8, 8) == pytest.approx(25.05e-6, rel=1e-12)


def test_another_group_size_keeps_the_bus_bandwidth_and_takes_its_own_ring_factor():
    """nccl-tests' bus bandwidth is what the ring sustains per GPU whatever the group: 8 GPUs on a 1 GiB all-gather
    move 7/8 of it (4 GPUs: 3/4) at the 327.47 GB/s published for 1 GiB."""
    table = collective_rates.TABLES["nvlink4"]["all-gather"]
    assert collective_rates.seconds(table, "all-gather", 8, GIB) == pytest.approx(7 / 8 * GIB / 327.47e9, rel=0.001)
    assert collective_rates.seconds(table, "all-gather", 2, GIB) == pytest.approx(1 / 2 * GIB / 327.47e9, rel=0.001)


def _collective(op: str, group: int, size: int) -> kernels.Kernel:
    return kernels.Kernel(name="c", category="collective", detail=op, trips=(), times=1, flops=0.0, flop_dtype="vector",
                          bytes_read=size, bytes_written=size, collective=(op, group, size))  # fmt: skip


def test_the_predictor_prices_nvlink_collectives_by_the_tables_and_keeps_the_link_rate_elsewhere():
    h100, b200 = (predict.gpu_roofline(targets.TARGETS[name]) for name in ("h100", "b200"))
    gather = _collective("all-gather", 8, GIB)
    # H100, 8 GPUs on NVSwitch: the table (327.47 GB/s at 1 GiB); the pure roofline keeps NVLink's 450 GB/s
    predicted, bound = predict.kernel_seconds(gather, h100)
    assert predicted == pytest.approx(7 / 8 * GIB / 327.47e9, rel=0.001)
    assert bound == pytest.approx(7 / 8 * GIB / 450e9, rel=1e-9)
    # a tiny all-reduce costs the latency floor, not ~0 (64 KiB on 4 H100s: 25.49 us)
    assert predict.kernel_seconds(_collective("all-reduce", 8, 4096), h100)[0] == pytest.approx(25.49e-6, rel=1e-9)
    # A100: its all-reduce table serves all-gather too (1 GiB on 8 A100s: 229.04 GB/s)
    a100 = predict.gpu_roofline(targets.TARGETS["a100-80gb"])
    assert predict.kernel_seconds(gather, a100)[0] == pytest.approx(7 / 8 * GIB / 229.04e9, rel=0.001)
    # no table: all-to-all on the H100, every collective on the B200, and a group across hosts keep the link rate
    for kernel, roof, rate in ((_collective("all-to-all", 8, GIB), h100, 450e9), (gather, b200, 900e9),
                               (_collective("all-gather", 16, GIB), h100, 400e9)):  # fmt: skip
        group = kernel.collective[1]
        assert predict.kernel_seconds(kernel, roof)[0] == pytest.approx((group - 1) / group * GIB / rate, rel=1e-9)
    assert "nccl-tests" in h100.source and "no published nccl-tests table" in b200.source


def test_docs_predict_md_quotes_the_tables_rows_as_the_module_holds_them():
    """docs/predict.md's table: each cell's time is the module's row at that size and its bus bandwidth the one the
    row's time gives (to the published rounding)."""
    import re

    from conftest import REPO

    text = (REPO / "docs" / "predict.md").read_text()
    sizes = (64 * 1024, MIB, 16 * MIB, 128 * MIB, GIB, 8 * GIB)
    rows = {"NVLink 4 (h100, h200): all-reduce": ("nvlink4", "all-reduce"),
            "NVLink 4: all-gather": ("nvlink4", "all-gather"),
            "NVLink 4: reduce-scatter": ("nvlink4", "reduce-scatter"),
            "NVLink 3 (a100-40gb, a100-80gb): all-reduce": ("nvlink3", "all-reduce")}  # fmt: skip
    for label, (fabric, op) in rows.items():
        line = next(line for line in text.splitlines() if line.startswith(f"| {label}"))
        cells = re.findall(r"([\d,]+(?:\.\d+)?) us, ([\d.]+)", line)
        assert len(cells) == len(sizes), label
        table = collective_rates.TABLES[fabric][op]
        for size, (time_us, busbw) in zip(sizes, cells, strict=True):
            row = table.sizes.index(size)
            assert float(time_us.replace(",", "")) * 1e-6 == pytest.approx(table.seconds[row], rel=1e-9)
            assert table.bus_bytes_per_s(row) / 1e9 == pytest.approx(float(busbw), rel=0.01, abs=0.006)

"""Collectives priced by message size from published nccl-tests measurements, with their latency.

A collective inside a GPU's NVLink domain takes the time a published `nccl-tests` run measured for a buffer of its
size, not its ring bytes over the datasheet's NVLink rate: NCCL reaches 0.76-0.79 of NVLink 4's 450 GB/s a direction
at 8 GiB (all-gather 343.5, reduce-scatter 350.9, all-reduce 366.2 GB/s bus bandwidth on 4 H100s), much less on
small buffers (28-59 GB/s at 1 MiB), and no collective takes less than its launch and synchronisation latency
(23.0-25.5 us on H100s at 64 KiB, the tables' smallest size; 21-23 us at 64 bytes).

`seconds(table, op, group, size)`: the table's bus bandwidth at `size` (interpolated linearly in log bus bandwidth
against log size between the measured sizes; the largest measured size's beyond it) carries the collective's ring
factor for its own group (jaxscale.measure.collectives.ring_factor: the bus bandwidth is what NCCL's ring sustains
per GPU whatever the group's size, as its tests define it), and no collective is faster than the table's smallest
size (its latency floor). `size` is the whole buffer, as nccl-tests' "size" column and
jaxscale.measure.collectives.Collective.bytes both are (an all-gather's output, a reduce-scatter's input, an
all-reduce's buffer).

What has no table keeps the datasheet rate with no latency (jaxscale.plan.predict): all-to-all and collective-permute
(no published per-size table was found), groups that leave the NVLink domain (PCIe, the network), and the targets
below without one (B200, GB200, Ada and the workstation Amperes: none found). The tables are measurements of NCCL
on real GPUs, read from the sources named in each; none is fitted to a training run.
"""

from __future__ import annotations

import dataclasses

from jaxscale.measure import collectives
from jaxscale.plan import log_grid


@dataclasses.dataclass(frozen=True)
class SizeTable:
    """One collective's measured time per buffer size on `gpus` GPUs (nccl-tests, out-of-place)."""

    gpus: int
    op: str  # the nccl-tests collective the rows are ("all-reduce", "all-gather", "reduce-scatter")
    sizes: tuple[int, ...]  # bytes, increasing
    seconds: tuple[float, ...]
    source: str

    def bus_bytes_per_s(self, index: int) -> float:
        """The bus bandwidth of row `index`, as nccl-tests computes its busbw column: ring factor x size / time."""
        return collectives.ring_factor(self.op, self.gpus) * self.sizes[index] / self.seconds[index]


_US = 1e-6
_H100_SIZES = tuple(2**k for k in range(16, 34))  # 64 KiB .. 8 GiB, every power of two the sweep ran
_H100_SOURCE = ("nccl-tests 2.18.3 with NCCL 2.29.2, {op}_perf -g 4 -n 50 (out-of-place) on 4 of the 8 H100 80GB HBM3 "
                "SXM5 GPUs of one NVSwitch host: waynehacking8/nccl-collectives-bench @ 8ab7496, "
                "results/quiet/{op}.txt")  # fmt: skip
_A100_SOURCE = ("nccl-tests all_reduce_perf -b 32k -e 16G -f 2 -g 8 -n 50 on one 8 x A100 NVLink 3 host: "
                "stas00/ml-engineering, network/README.md, 'Real network throughput'")  # fmt: skip

# fmt: off
TABLES: dict[str, dict[str, SizeTable]] = {
    "nvlink4": {
        "all-reduce": SizeTable(4, "all-reduce", _H100_SIZES, tuple(t * _US for t in (
            25.49, 26.32, 27.19, 27.88, 26.76, 30.32, 43.43, 63.07, 101.86, 175.81, 329.39, 617.74, 1186.22, 2315.40,
            4532.51, 8926.72, 17744.6, 35187.6)), _H100_SOURCE.format(op="all_reduce")),
        "all-gather": SizeTable(4, "all-gather", _H100_SIZES, tuple(t * _US for t in (
            25.05, 26.28, 27.05, 28.24, 27.87, 27.76, 38.62, 47.30, 67.25, 109.19, 194.91, 349.92, 658.88, 1270.13,
            2459.19, 4831.51, 9435.48, 18753.6)), _H100_SOURCE.format(op="all_gather")),
        "reduce-scatter": SizeTable(4, "reduce-scatter", _H100_SIZES, tuple(t * _US for t in (
            22.98, 23.96, 24.97, 25.95, 25.83, 25.69, 35.72, 42.74, 62.56, 105.94, 189.89, 346.83, 662.60, 1274.53,
            2446.11, 4782.16, 9411.22, 18360.3)), _H100_SOURCE.format(op="reduce_scatter")),
    },
    "nvlink3": {
        "all-reduce": SizeTable(8, "all-reduce", tuple(2**k for k in range(15, 35)), tuple(t * _US for t in (
            43.83, 46.80, 51.76, 61.38, 80.40, 101.9, 101.4, 101.5, 133.5, 276.6, 424.0, 684.6, 1327.6, 2420.6, 4218.4,
            8203.9, 16240, 32136, 64074, 127997)), _A100_SOURCE),
    },
}
# fmt: on
# A ring all-reduce is a reduce-scatter and then an all-gather, each at the same bus bandwidth (on the H100s above,
# at 1 GiB: all-reduce 355.4, reduce-scatter 329.2, all-gather 327.5 GB/s): on NVLink 3, where only the all-reduce
# was found, its table serves the other two.
BORROWED = {"nvlink3": {"all-gather": "all-reduce", "reduce-scatter": "all-reduce"}}
# Which fabric's tables a planning target's NVLink domain takes (jaxscale.plan.targets.TARGETS): the H200 has the
# H100's NVLink 4 and NVSwitch baseboard (no H200 table was found), as torchtitan's 96 GB H100 hosts have.
FABRIC = {"h100": "nvlink4", "h100-96gb-500w": "nvlink4", "h200": "nvlink4", "a100-40gb": "nvlink3",
          "a100-80gb": "nvlink3"}  # fmt: skip
FABRIC_SOURCE = {
    "nvlink4": "nccl-tests on 4 H100 SXM5 of an NVSwitch host, NCCL 2.29.2 (waynehacking8/nccl-collectives-bench @ "
    "8ab7496, results/quiet/{all_reduce,all_gather,reduce_scatter}.txt)",
    "nvlink3": "nccl-tests all_reduce_perf on 8 A100 NVLink 3 (stas00/ml-engineering, network/README.md), also for "
    "all-gather and reduce-scatter",
}


def tables_for(target_name: str) -> dict[str, SizeTable]:
    """The tables, by collective, that a target's NVLink-domain collectives take ({} for a target without one)."""
    fabric = FABRIC.get(target_name)
    if fabric is None:
        return {}
    own = dict(TABLES[fabric])
    for op, lender in BORROWED.get(fabric, {}).items():
        own.setdefault(op, TABLES[fabric][lender])
    return own


def bus_bytes_per_s(table: SizeTable, size: float) -> float:
    """The table's bus bandwidth at `size` bytes: linear in log-log between measured sizes, the end rows' outside."""
    return log_grid.interpolate(table.sizes, size, table.bus_bytes_per_s)


def seconds(table: SizeTable, op: str, group: int, size: float) -> float:
    """One execution of collective `op` over `group` GPUs on a buffer of `size` bytes: its ring bytes at the table's
    bus bandwidth for that size, never less than the table's smallest measured time (the latency floor)."""
    return max(table.seconds[0], collectives.ring_factor(op, group) * size / bus_bytes_per_s(table, size))


def source_text(target_name: str) -> str:
    """What a target's collective prices come from, for the roofline's source line."""
    own = tables_for(target_name)
    if not own:
        return "collectives at the datasheet link rate, no latency (no published nccl-tests table for this target)"
    floor = min(t.seconds[0] for t in own.values()) * 1e6
    return (f"collectives inside the NVLink domain ({', '.join(sorted(own))}) at the bus bandwidth published for their "
            f"size, latency floor {floor:.1f} us ({FABRIC_SOURCE[FABRIC[target_name]]}); "
            "all-to-all, permutes and groups beyond NVLink at the datasheet rate")  # fmt: skip

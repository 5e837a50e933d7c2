"""GEMM rates by shape from OpenXLA's measured H100 table, not one efficiency for every shape.

On a Hopper target (compute capability 9.x: h100, h200) a bf16/fp16 or TF32 GEMM runs at the rate XLA measured for
its shape on an H100 (jaxscale.plan.gemm_table_sm90: b in {1, 2, 4} x m, n, k in {256, ..., 4096}), interpolated
linearly in log rate against log2 of each dimension (multilinear over the four), each dimension clamped into the
grid: past 4096 a dimension takes the rate measured at 4096 (large GEMMs: 786 TFLOP/s bf16 at 4096^3, 0.79 of the
989.4 TFLOP/s dense peak), below 256 the rate at 256 (small GEMMs are memory-bound, which the roofline's memory term
prices). The rate replaces GEMM_EFFICIENCY x tile and wave quantization (jaxscale.plan.predict): the measured time
holds both. FP8, float32 at HIGHEST precision and every other architecture keep the published-efficiency formula
(no table found for them: XLA's sm_90 table has bf16 and float32 only, and no other architecture).

The H200 is the H100's GH100 at the same SM count and clock (jaxscale.plan.targets), so it takes the table too; its
faster memory shows in the roofline's memory term. Not fitted to any training run.

Where no shape table applies, a GEMM runs at a share of its dtype's dense peak times tile and wave quantization
(jaxscale.plan.predict). That share is the card's own where one was measured: the "Maximum Achievable Matmul FLOPS"
(MAMF) tables, cuBLAS through torch.matmul at the best of a brute-force search over shapes, a mean of 100 iterations
after 50 warm-up ones, BF16 and FP8 (float8_e4m3fn) inputs, per accelerator (MAMF, below). A card the tables do not
measure, and a dtype they do not (TF32, float32), keep predict.GEMM_EFFICIENCY.
"""

from __future__ import annotations

import itertools
import math

from jaxscale.plan import log_grid
from jaxscale.plan.gemm_table_sm90 import SM90

SOURCE = ("OpenXLA's measured H100 GEMM table (tensorflow/tensorflow @ 9bebee8, third_party/xla/xla/service/gpu/model/"
          "matmul_interpolator_data.h, sm_90: 375 shapes, b 1-4, m/n/k 256-4096)")  # fmt: skip
COLUMN = {"bf16": 4, "f16": 4, "tf32": 5}  # kernels.Kernel.flop_dtype -> the table's column (fp16 takes bf16's)
_BATCHES = tuple(sorted({row[0] for row in SM90}))
_SIZES = tuple(sorted({row[1] for row in SM90}))
_GRID = {row[:4]: row for row in SM90}
# which compute capabilities' targets take the table: Hopper's
ARCHITECTURES = {9}


def rate(flop_dtype: str, gemm: tuple[int, int, int, int] | None) -> float | None:
    """FLOP/s of a GEMM of (batch, m, n, k) with `flop_dtype` operands on an H100, by the table; None where the table
    has no column for the dtype or the kernel has no shape."""
    column = COLUMN.get(flop_dtype)
    if column is None or gemm is None:
        return None
    batch, m, n, k = gemm
    axes = [[(grid[i], w) for i, w in log_grid.bracket(grid, x)]
            for grid, x in ((_BATCHES, max(1, batch)), (_SIZES, m), (_SIZES, n), (_SIZES, k))]
    log_rate = 0.0
    for corner in itertools.product(*axes):
        weight = math.prod(w for _, w in corner)
        log_rate += weight * math.log(_GRID[tuple(v for v, _ in corner)][column])
    return math.exp(log_rate)


MAMF_SOURCE = ("'Maximum Achievable Matmul FLOPS comparison table' (stas00/ml-engineering @ 744d01e, "
               "compute/accelerator/README.md): cuBLAS via torch.matmul, best shape of a search, BF16 and FP8 e4m3")
# (the table's accelerator, its dtype) -> (MAMF TFLOP/s, the table's theoretical TFLOP/s), as the source prints them
MAMF = {
    ("NVIDIA A100 SXM", "bf16"): (271.2, 312),
    ("NVIDIA H100 SXM", "bf16"): (794.5, 989),  # its note: "H200 is the same"
    ("NVIDIA H100 SXM", "f8"): (1402.6, 1979),
    ("NVIDIA H200 SXM", "f8"): (1453.4, 1979),
    ("NVIDIA B200 SXM", "bf16"): (1745.0, 2250),
    ("NVIDIA B200 SXM", "f8"): (3432.5, 4500),
    ("NVIDIA GB200 SXM", "bf16"): (1822.0, 2500),
    ("NVIDIA GB200 SXM", "f8"): (3615.6, 5000),
}
# a target's device_kind -> the accelerator the tables measured (the same chip, board and memory type, or, for the
# 96 GB HBM2e H100 at 500 W, the SXM H100's share of its own peak: its clock is the target's compute_scale), by dtype
MAMF_CARD = {
    "NVIDIA A100-SXM4-40GB": {"bf16": "NVIDIA A100 SXM"},
    "NVIDIA A100-SXM4-80GB": {"bf16": "NVIDIA A100 SXM"},
    "NVIDIA H100 80GB HBM3": {"bf16": "NVIDIA H100 SXM", "f8": "NVIDIA H100 SXM"},
    "NVIDIA H100 96GB HBM2e": {"bf16": "NVIDIA H100 SXM", "f8": "NVIDIA H100 SXM"},
    "NVIDIA H200": {"bf16": "NVIDIA H100 SXM", "f8": "NVIDIA H200 SXM"},
    "NVIDIA B200": {"bf16": "NVIDIA B200 SXM", "f8": "NVIDIA B200 SXM"},
    "NVIDIA GB200": {"bf16": "NVIDIA GB200 SXM", "f8": "NVIDIA GB200 SXM"},
}
_MAMF_DTYPES = {"bf16": "bf16", "f16": "bf16", "f8": "f8"}  # kernels.Kernel.flop_dtype -> the table (fp16: bf16's)


def best_shape_efficiencies(device_kind: str) -> dict[str, float]:
    """The measured best-shape share of the dense peak of each GEMM dtype on a card (MAMF / theoretical, by
    kernels.Kernel.flop_dtype); a dtype or card the tables do not measure is absent."""
    cards = MAMF_CARD.get(device_kind, {})
    return {dtype: MAMF[cards[table], table][0] / MAMF[cards[table], table][1]
            for dtype, table in _MAMF_DTYPES.items() if table in cards}  # fmt: skip

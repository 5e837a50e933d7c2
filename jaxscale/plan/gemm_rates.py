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

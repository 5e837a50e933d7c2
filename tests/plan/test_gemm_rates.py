"""jaxscale.plan.gemm_rates: OpenXLA's measured H100 GEMM table as the predictor reads it.

The source prints each shape's rate as FLOP/s; XLA computed it as 2·b·m·n·k over a measured whole number of
nanoseconds, which gives the transcription a check of its own. Two rows quoted here were read from the source file
(tensorflow/tensorflow @ 9bebee8, third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h), not from the
module."""

from __future__ import annotations

import math

import pytest

from jaxscale.measure import kernels
from jaxscale.plan import gemm_rates, predict, targets
from jaxscale.plan.gemm_table_sm90 import SM90

# b=1, m=n=k=1024 and b=1, m=4096, n=2048, k=4096, "BF16xBF16->BF16", as printed in the source
SOURCE_ROWS = {(1, 1024, 1024, 1024): 246723764705882, (1, 4096, 2048, 4096): 764093096602028}


def test_the_table_is_the_full_grid_and_every_rate_is_a_whole_number_of_nanoseconds():
    assert len(SM90) == 3 * 5**3 and len({row[:4] for row in SM90}) == len(SM90)
    sizes = (256, 512, 1024, 2048, 4096)
    assert {row[:4] for row in SM90} == {(b, m, n, k) for b in (1, 2, 4) for m in sizes for n in sizes for k in sizes}
    for b, m, n, k, *rates in SM90:
        for rate in rates:
            nanoseconds = 2 * b * m * n * k / rate * 1e9
            assert abs(nanoseconds - round(nanoseconds)) < 1e-6, (b, m, n, k, rate)
    for shape, rate in SOURCE_ROWS.items():
        assert gemm_rates.rate("bf16", shape) == pytest.approx(rate, rel=1e-12)


def test_between_grid_shapes_the_rate_is_log_linear_and_outside_it_the_edge_rows_hold():
    low, high = gemm_rates.rate("bf16", (1, 1024, 2048, 1024)), gemm_rates.rate("bf16", (1, 2048, 2048, 1024))
    middle = gemm_rates.rate("bf16", (1, round(1024 * math.sqrt(2)), 2048, 1024))
    assert middle == pytest.approx(math.sqrt(low * high), rel=1e-3)  # the geometric middle of m: the geometric mean
    big = gemm_rates.rate("bf16", (1, 4096, 4096, 4096))
    assert gemm_rates.rate("bf16", (1, 65536, 14336, 8192)) == big  # past 4096 every dimension takes 4096's rate
    assert gemm_rates.rate("bf16", (16, 4096, 4096, 4096)) == gemm_rates.rate("bf16", (4, 4096, 4096, 4096))
    assert gemm_rates.rate("bf16", (1, 64, 256, 256)) == gemm_rates.rate("bf16", (1, 256, 256, 256))
    assert gemm_rates.rate("f8", (1, 4096, 4096, 4096)) is None and gemm_rates.rate("bf16", None) is None


def _gemm(dtype: str, shape: tuple[int, int, int, int]) -> kernels.Kernel:
    b, m, n, k = shape
    size = 2 if dtype == "bf16" else 1
    return kernels.Kernel(name="g", category="matmul", detail="gemm", trips=(), times=1, flops=2.0 * b * m * n * k,
                          flop_dtype=dtype, bytes_read=size * b * (m * k + k * n), bytes_written=size * b * m * n,
                          gemm=shape)  # fmt: skip


def test_an_h100_bf16_gemm_runs_at_its_measured_rate_and_other_targets_and_fp8_keep_the_formula():
    shape = (1, 1024, 1024, 1024)
    gemm = _gemm("bf16", shape)
    for name in ("h100", "h200"):  # compute-bound here: 8.7 us of compute against ~2 us of memory
        predicted, bound = predict.kernel_seconds(gemm, predict.gpu_roofline(targets.TARGETS[name]))
        assert predicted == pytest.approx(gemm.flops / SOURCE_ROWS[shape], rel=1e-9)
        assert bound == pytest.approx(gemm.flops / 989.4e12, rel=1e-3)  # the pure roofline: the dense peak
    a100 = predict.gpu_roofline(targets.TARGETS["a100-80gb"])  # no table: MAMF's 271.2 of 312, 64 tiles on 108 SMs
    assert predict.kernel_seconds(gemm, a100)[0] == pytest.approx(gemm.flops / (312e12 * 271.2 / 312 * 64 / 108),
                                                                  rel=1e-3)  # fmt: skip
    fp8 = _gemm("f8", (1, 4096, 4096, 4096))  # FP8 on the H100: MAMF's 1402.6 of 1979, 1024 tiles in 8 waves of 132
    h100 = predict.gpu_roofline(targets.TARGETS["h100"])
    assert predict.kernel_seconds(fp8, h100)[0] == pytest.approx(fp8.flops / (1978.9e12 * 1402.6 / 1979 * 1024 / 1056),
                                                                 rel=1e-3)  # fmt: skip
    assert "measured H100 GEMM table" in h100.source and "measured H100 GEMM table" not in a100.source
    rtx4090 = predict.gpu_roofline(targets.TARGETS["rtx4090"])  # Ada: no measured share, the 0.80 assumed
    ada = _gemm("f8", (1, 4096, 4096, 4096))  # 1024 tiles in 8 waves of 128 SMs: no quantization loss
    assert predict.kernel_seconds(ada, rtx4090)[0] == pytest.approx(ada.flops / (330.3e12 * 0.80), rel=1e-3)


# The source's rows (stas00/ml-engineering @ 744d01e, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table"), copied from the file: accelerator | MAMF | Theory | Efficiency | best shape | torch | notes.
MAMF_BF16_ROWS = """
| NVIDIA A100 SXM  |  271.2 |    312 |      86.9% |  1024x10240x5120 | 2.6.0+cu126                    |
| NVIDIA H100 SXM  |  794.5 |    989 |      80.3% |  2048x2048x13312 | 2.7.0+cu126                    | H200 is the same
| NVIDIA B200 SXM  | 1745.0 |   2250 |      77.6% |  1792x16128x3072 | 2.7.1+cu128                    |
| NVIDIA GB200 SXM | 1822.0 |   2500 |      72.9% |   4096x9728x2048 | 2.10.0.dev20250916+cu130       |
"""
MAMF_FP8_ROWS = """
| NVIDIA B200 SXM  | 3432.5 |   4500 |      76.3% |  15360x4096x3072 | 2.7.1+cu128                    |
| NVIDIA H200 SXM  | 1453.4 |   1979 |      73.4% |  1280x4096x12032 | 2.7.1+cu128                    |
| NVIDIA GB200 SXM | 3615.6 |   5000 |      72.3% |  19456x5120x1536 | 2.10.0.dev20250916+cu130       |
| NVIDIA H100 SXM  | 1402.6 |   1979 |      70.9% |  1024x9216x14336 | 2.7.0+cu126                    |
"""


def _rows(text: str, dtype: str) -> dict[tuple[str, str], tuple[float, float, float]]:
    cells = [[cell.strip() for cell in line.split("|")[1:5]] for line in text.strip().splitlines()]
    return {(name, dtype): (float(mamf), float(theory), float(share.rstrip("%")) / 100)
            for name, mamf, theory, share in cells}  # fmt: skip


def test_each_measured_share_is_the_source_rows_figures_and_each_card_takes_its_own_rows():
    quoted = {**_rows(MAMF_BF16_ROWS, "bf16"), **_rows(MAMF_FP8_ROWS, "f8")}
    assert {key: value[:2] for key, value in quoted.items()} == gemm_rates.MAMF
    for mamf, theory, share in quoted.values():  # the source's own efficiency column, to its rounding
        assert mamf / theory == pytest.approx(share, abs=5e-4)
    h200 = gemm_rates.best_shape_efficiencies("NVIDIA H200")  # "H200 is the same" in bf16, its own row in FP8
    assert h200 == {"bf16": 794.5 / 989, "f16": 794.5 / 989, "f8": 1453.4 / 1979}
    assert gemm_rates.best_shape_efficiencies("NVIDIA A100-SXM4-40GB") == {"bf16": 271.2 / 312, "f16": 271.2 / 312}
    for card in ("NVIDIA RTX A5000", "NVIDIA RTX A6000", "NVIDIA L40S", "NVIDIA L4", "NVIDIA GeForce RTX 4090"):
        assert gemm_rates.best_shape_efficiencies(card) == {}  # measured nowhere: predict.GEMM_EFFICIENCY
    # every mapped card is a target's (a misspelt device kind would map nothing)
    assert set(gemm_rates.MAMF_CARD) <= {target.device_kind for target in targets.TARGETS.values()}


def test_docs_predict_md_quotes_the_tables_rates_as_the_module_gives_them():
    """docs/predict.md's GEMM-table row: the rate at 4096^3 and its share of the H100's dense bf16 peak, and the
    1000 x 3000 x 700 example against the formula (0.80 of the peak with 128 x 128 tiles in waves over 132 SMs)."""
    from conftest import REPO

    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    big = gemm_rates.rate("bf16", (1, 4096, 4096, 4096))
    mid = gemm_rates.rate("bf16", (1, 1000, 3000, 700))
    formula = 989.4e12 * 0.80 * predict.quantization((1, 1000, 3000, 700), 132)
    assert f"({big / 1e12:.0f} TFLOP/s bf16 at 4096³, {big / 989.4e12:.2f} of the peak" in text
    assert f"(1000 x 3000 x 700: {mid / 1e12:.0f} against {formula / 1e12:.0f} TFLOP/s)" in text

"""jaxscale.plan.attention_rates: the B200's measured fused-attention rates as the predictor reads them.

The rows below are copied from the source file (NVIDIA/cudnn-frontend @ bb37575,
benchmark/sdpa_benchmark_training/artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv), not from the module. The
file prints each backend's median times and its TFLOP/s, so each rate has a check of its own: the source's FLOP count
(4·B·T·S·H·D forward, halved for causal; 2.5x that backward) over the printed time."""

from __future__ import annotations

import csv
import io

import pytest

from jaxscale.measure import kernels
from jaxscale.plan import attention_rates, predict, targets

SOURCE_CSV = """batch_size,q_seqlen,kv_seqlen,num_q_heads,num_kv_heads,head_dim,is_causal,backend,forward_time,backward_time,fwd_tflops_per_sec,bwd_tflops_per_sec
1,512,512,128,8,128,True,pyt_cudnn,0.102,0.160,83.991,134.164
1,512,512,128,8,128,True,flash_attention,0.134,0.264,63.936,81.393
1,1024,1024,128,8,128,True,pyt_cudnn,0.135,0.278,254.501,308.529
1,1024,1024,128,8,128,True,flash_attention,0.223,0.819,154.417,104.860
1,2048,2048,128,8,128,True,pyt_cudnn,0.287,0.925,478.921,371.486
1,2048,2048,128,8,128,True,flash_attention,0.540,1.728,254.381,198.845
1,4096,4096,128,8,128,True,pyt_cudnn,0.642,1.960,855.678,701.265
1,4096,4096,128,8,128,True,flash_attention,1.603,5.025,342.990,273.484
1,8192,8192,128,8,128,True,pyt_cudnn,1.877,5.833,1171.278,942.509
1,8192,8192,128,8,128,True,flash_attention,5.499,17.288,399.925,318.004
1,16384,16384,128,8,128,True,pyt_cudnn,6.602,20.460,1332.415,1074.776
1,16384,16384,128,8,128,True,flash_attention,20.690,65.324,425.128,336.635
1,32768,32768,128,8,128,True,pyt_cudnn,24.795,79.338,1419.000,1108.688
1,32768,32768,128,8,128,True,flash_attention,80.742,254.491,435.762,345.634
1,65536,65536,128,8,128,True,pyt_cudnn,101.812,327.889,1382.330,1073.059
1,65536,65536,128,8,128,True,flash_attention,318.926,1008.204,441.285,348.981
1,131072,131072,128,8,128,True,pyt_cudnn,415.333,1343.117,1355.418,1047.843
1,131072,131072,128,8,128,True,flash_attention,1268.653,4041.247,443.738,348.253
"""  # noqa: E501
BACKENDS = {"pyt_cudnn": "cudnn", "flash_attention": "flash_attention_2"}
B200_BF16_PEAK = 2250e12  # NVIDIA B200 datasheet, dense bf16 (jaxscale.measure.peaks)


def _rows() -> list[dict]:
    return list(csv.DictReader(io.StringIO(SOURCE_CSV)))


def test_the_table_is_the_source_rows_and_each_rate_is_its_flops_over_its_time():
    table = attention_rates.MEASURED["NVIDIA B200"]
    quoted = {}
    for row in _rows():
        seq, heads, dim = int(row["q_seqlen"]), int(row["num_q_heads"]), int(row["head_dim"])
        forward_flops = 4 * int(row["batch_size"]) * seq * int(row["kv_seqlen"]) * heads * dim / 2  # causal
        forward, backward = float(row["fwd_tflops_per_sec"]), float(row["bwd_tflops_per_sec"])
        # the printed rate is its FLOPs over its printed time (ms, rounded to 3 places: about 0.1% at 0.1 ms)
        assert forward_flops / (float(row["forward_time"]) * 1e-3) / 1e12 == pytest.approx(forward, rel=4e-3)
        assert 2.5 * forward_flops / (float(row["backward_time"]) * 1e-3) / 1e12 == pytest.approx(backward, rel=4e-3)
        quoted.setdefault(BACKENDS[row["backend"]], {})[seq] = (forward, backward)
    assert table == quoted


def _attention(detail: str, matmuls: int, seq: int, dtype: str = "bf16", heads: int = 32) -> kernels.Kernel:
    flops = matmuls * 2.0 * 1 * heads * seq * seq * 128 / 2  # causal
    return kernels.Kernel(name="a", category="attention", detail=detail, trips=(), times=1, flops=flops,
                          flop_dtype=dtype, bytes_read=1, bytes_written=1,
                          attention=(matmuls, 1, heads, seq, seq, 128, True))  # fmt: skip


def test_a_b200_attention_call_runs_at_its_kernels_measured_rate_for_its_direction_and_sequence():
    b200 = predict.gpu_roofline(targets.TARGETS["b200"])
    cudnn_forward = _attention("__cudnn$fmhaSoftmax", 2, 8192)
    assert predict.kernel_seconds(cudnn_forward, b200)[0] == pytest.approx(cudnn_forward.flops / 1171.278e12, rel=1e-6)
    cudnn_backward = _attention("__cudnn$fmhaSoftmaxBackward", 5, 4096)
    assert predict.kernel_seconds(cudnn_backward, b200)[0] == pytest.approx(cudnn_backward.flops / 701.265e12, rel=1e-6)
    # the Pallas kernels at FlashAttention-2's rates: 7 backward matmuls, each at its backward rate
    pallas_backward = _attention("mha_backward", 7, 16384)
    assert predict.kernel_seconds(pallas_backward, b200)[0] == pytest.approx(pallas_backward.flops / 336.635e12,
                                                                             rel=1e-6)  # fmt: skip
    # between rows: log-linear in the sequence (the geometric middle of 4096 and 8192: the geometric mean rate)
    middle = _attention("mha_forward", 2, 5793)
    rate = middle.flops / predict.kernel_seconds(middle, b200)[0]
    assert rate == pytest.approx((342.990 * 399.925) ** 0.5 * 1e12, rel=1e-3)
    # past the table's ends: the end rows
    short = _attention("mha_forward", 2, 128)
    assert short.flops / predict.kernel_seconds(short, b200)[0] == pytest.approx(63.936e12, rel=1e-6)


def test_the_gb200_takes_the_b200s_shares_of_its_own_peak_and_other_cards_and_dtypes_keep_the_generation_figure():
    gb200 = predict.gpu_roofline(targets.TARGETS["gb200"])
    call = _attention("__cudnn$fmhaSoftmax", 2, 8192)
    gb200_rate = 2500e12 * 1171.278e12 / B200_BF16_PEAK  # the same share of the GB200's 2,500 TFLOP/s
    assert predict.kernel_seconds(call, gb200)[0] == pytest.approx(call.flops / gb200_rate, rel=1e-6)
    h100 = predict.gpu_roofline(targets.TARGETS["h100"])
    assert predict.kernel_seconds(call, h100)[0] == pytest.approx(call.flops / (989.4e12 * 0.35), rel=1e-3)
    fp8 = _attention("__cudnn$fmhaSoftmaxF8", 2, 8192, dtype="f8")  # FP8 attention: not in the bf16 table
    b200 = predict.gpu_roofline(targets.TARGETS["b200"])
    assert predict.kernel_seconds(fp8, b200)[0] == pytest.approx(fp8.flops / (4500e12 * 0.35), rel=1e-3)
    assert attention_rates.SOURCE in b200.source and attention_rates.SOURCE not in h100.source


def test_docs_predict_md_quotes_the_tables_rates_as_the_module_gives_them():
    from conftest import REPO

    text = " ".join((REPO / "docs" / "predict.md").read_text().split())
    table = attention_rates.MEASURED["NVIDIA B200"]
    (c1, cb1), (c2, cb2), (c3, cb3) = (table["cudnn"][seq] for seq in (512, 4096, 32768))
    (f1, fb1), (f2, fb2), (f3, fb3) = (table["flash_attention_2"][seq] for seq in (512, 4096, 32768))
    assert (f"cuDNN forward {c1:,.0f} TFLOP/s at sequence 512, {c2:,.0f} at 4,096, {c3:,.0f} at 32,768; backward "
            f"{cb1:,.0f}, {cb2:,.0f}, {cb3:,.0f}. FlashAttention-2 forward {f1:,.0f}, {f2:,.0f}, {f3:,.0f}; backward "
            f"{fb1:,.0f}, {fb2:,.0f}, {fb3:,.0f}: on a B200 it reaches a fifth of the peak where cuDNN reaches over "
            "half") in text  # fmt: skip
    assert f3 / 2250 < 0.2 < 0.5 < c3 / 2250  # a fifth of the dense bf16 peak, and over half


def test_docs_published_md_puts_cudnn_near_three_times_flashattention_2_on_a_b200_at_the_runs_sequence():
    """docs/published.md on MaxText's 70B on B200s (sequence 8192): cuDNN's rates over FlashAttention-2's there."""
    from conftest import REPO

    text = " ".join((REPO / "docs" / "published.md").read_text().split())
    cudnn, flash = (attention_rates.MEASURED["NVIDIA B200"][kernel][8192] for kernel in ("cudnn", "flash_attention_2"))
    assert all(2.7 < c / f < 3.3 for c, f in zip(cudnn, flash, strict=True))  # forward 2.93, backward 2.96
    assert "which that table puts near three times faster on a B200" in text

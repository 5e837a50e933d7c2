"""Fused attention rates by GPU, kernel, direction and sequence, where a card's were measured: not one efficiency.

A fused attention kernel (jaxscale.measure.attention_calls) runs its matmul work at a share of the tensor peak. By
default that share is one published figure per GPU generation (jaxscale.plan.predict.ATTENTION_EFFICIENCY). Where a
card's kernels were measured by sequence length, the share is the measured rate over that card's dense bf16 peak,
interpolated linearly in log rate against log2 of the sequence and clamped at the table's ends:

- **B200** (NVIDIA/cudnn-frontend @ bb37575, `benchmark/sdpa_benchmark_training/artifacts/`: the results file
  `sdpa_bf16_benchmark_results_NVIDIA_B200.csv` and its run log `sample_b200_bf16_run.txt`, which names the GPU,
  'NVIDIA B200', cuDNN 9.13.0 and flash-attn 2.7.4.post1): bf16, batch 1, 128 query and 8 key/value heads, head
  dimension 128, causal, sequence 512 to 131,072, the median forward and backward times and their TFLOP/s, counted
  as the lab counts them (`flops()` in `benchmark_single_sdpa.py`: 4·B·T·S·H·D forward, halved for causal, 2.5x that
  backward). cuDNN's fused attention (backend `pyt_cudnn`) gives cuDNN's calls their rate; FlashAttention-2
  (`flash_attention`) gives the Pallas (Triton) flash kernels theirs, as on Hopper, where the Pallas kernel takes
  FlashAttention-2's published share: it is FlashAttention-2's algorithm without Blackwell's own instructions. The
  Pallas backward does 7 matmuls where FlashAttention-2 does 5, and each runs at that rate. The GB200's GPU is the
  B200's: it takes the same shares of its own peak.

What the table does not measure keeps the generation's figure: other GPUs, FP8 attention, and the Pallas
preprocess kernel (memory only). A head dimension other than 128 and a non-causal call take the table's rows too
(the only ones measured): a stated assumption. Not fitted to any training run.
"""

from __future__ import annotations

import math

from jaxscale.measure import kernels, peaks
from jaxscale.plan import log_grid

SOURCE = ("NVIDIA/cudnn-frontend @ bb37575, benchmark/sdpa_benchmark_training/artifacts/"
          "sdpa_bf16_benchmark_results_NVIDIA_B200.csv (cuDNN 9.13.0 and FlashAttention 2.7.4.post1 on a B200, bf16, "
          "head dim 128, causal)")  # fmt: skip
# the table's GPU -> kernel -> sequence -> (forward, backward) TFLOP/s, as the results file prints them
MEASURED = {
    "NVIDIA B200": {
        "cudnn": {512: (83.991, 134.164), 1024: (254.501, 308.529), 2048: (478.921, 371.486),
                  4096: (855.678, 701.265), 8192: (1171.278, 942.509), 16384: (1332.415, 1074.776),
                  32768: (1419.000, 1108.688), 65536: (1382.330, 1073.059), 131072: (1355.418, 1047.843)},
        "flash_attention_2": {512: (63.936, 81.393), 1024: (154.417, 104.860), 2048: (254.381, 198.845),
                              4096: (342.990, 273.484), 8192: (399.925, 318.004), 16384: (425.128, 336.635),
                              32768: (435.762, 345.634), 65536: (441.285, 348.981), 131072: (443.738, 348.253)},
    },
}  # fmt: skip
# a target's device_kind -> the GPU whose table it takes (as shares of its own peak)
CARD = {"NVIDIA B200": "NVIDIA B200", "NVIDIA GB200": "NVIDIA B200"}
_DTYPES = ("bf16", "f16")  # the table's: FP8 and float32 attention keep the generation's figure


def kernel_kind(detail: str) -> str:
    """The table's kernel for an attention Kernel.detail: cuDNN's custom-call targets, else the Pallas kernels."""
    return "cudnn" if detail.startswith("__cudnn$") else "flash_attention_2"


def share(card: str | None, kernel: kernels.Kernel) -> float | None:
    """The measured share of the dense bf16 peak at which a fused attention call's matmuls run on a card, or None
    where the table does not measure it (no card's table, another dtype, the preprocess kernel's no matmuls).

    Args:
      card: the target's device kind (Roofline.device_kind; None on a CPU): a card without a table gets None.
      kernel: the attention kernel: its detail names the kernel, its attention tuple (matmuls, batch, heads, q_len,
        kv_len, ...) the direction (2 matmuls forward, more backward) and the sequence (the geometric mean of q_len
        and kv_len is looked up).
    """
    measured = CARD.get(card or "")
    if measured is None or kernel.attention is None or kernel.flop_dtype not in _DTYPES or not kernel.attention[0]:
        return None
    matmuls, _, _, q_len, kv_len = kernel.attention[:5]
    rows = MEASURED[measured][kernel_kind(kernel.detail)]
    sizes = tuple(sorted(rows))
    column = 0 if matmuls == 2 else 1
    tflops = log_grid.interpolate(sizes, math.sqrt(q_len * kv_len), lambda i: rows[sizes[i]][column])
    return tflops * 1e12 / peaks.find_peak(measured).bfloat16

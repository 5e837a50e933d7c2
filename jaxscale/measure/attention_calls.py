"""Fused attention kernels in a compiled GPU program, and the matmul work each does, read from its shapes.

Two kinds of custom call run a whole attention (QK^T, softmax, AV, or their gradients) in one kernel:

- **The Pallas flash kernels** (jaxscale.model.flash_attention, `jax.experimental.pallas.ops.gpu.attention`):
  `custom_call_target="__gpu$xla.gpu.triton"` with the kernel's name in its backend config, `name = "mha_forward"`,
  `"mha_backward"` or `"mha_preprocess_backward"`. Operands q [B, T, H, D], k [B, S, H, D], ... The forward does
  2 matmuls of T x S x D per (batch, head) (QK^T, PV). The backward (`mha_backward_kernel`) does 7: its dk/dv
  loop QK^T, P^T dO, dO V^T, dS^T Q, and its dq loop QK^T, dO V^T and dS K again, so 3.5x the forward's work,
  more than FlashAttention-2's 5 (2.5x: Dao 2023, arXiv 2307.08691; its benchmark counts
  `4 * batch * seqlen**2 * nheads * headdim // (2 if causal else 1)` forward and 2.5x that backward,
  Dao-AILab/flash-attention `benchmarks/benchmark_flash_attention.py`). The kernel pads D to a power of two
  (`pl.next_power_of_2(head_dim)`; masked loads fill zeros) and its tensor cores multiply the padded tiles,
  so D here is the padded one. The preprocess kernel (rowsum of out * dO) does no matmul: memory only.
  The kernel's IR is MLIR bytecode, so whether it is causal cannot be read from the HLO: `causal` is None
  and the caller resolves it from the run's config (kernels.resolve_causal).
- **cuDNN's fused attention** (`jax.nn.dot_product_attention(implementation="cudnn")`): the targets XLA names
  `__cudnn$fmhaSoftmax`, `__cudnn$fmhaScaleBiasSoftmax`, `...Dropout`, `...F8` and their `...Backward` forms
  (jax/_src/cudnn/fused_attention_stablehlo.py). The backend config gives `intermediate_tensor_shape` (the
  [B, N, T, S] probabilities) and `mask_type` (CAUSAL, PADDING_CAUSAL: causal); D is q's last dimension in both
  layouts (BTNH, BNTH). Forward 2 matmuls; backward 5, as FlashAttention-2 counts it (2.5x).

FLOPs = matmuls · 2·B·H·T·S·D, halved when causal: a causal kernel skips the masked blocks, and the published
efficiencies this work is priced at (jaxscale.plan.predict.ATTENTION_EFFICIENCY) count causal FLOPs the same way.
"""

from __future__ import annotations

import dataclasses
import re

from jaxscale.measure import hlo

_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_PALLAS_NAME = re.compile(r'\bname = "(mha_forward|mha_backward|mha_preprocess_backward)"')
_CUDNN = re.compile(r"^__cudnn\$fmha")
# XLA prints the backend config as JSON, with or without spaces after the colons.
_INTERMEDIATE = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_MASK = re.compile(r'"mask_type":\s*"?([A-Z_]+)')
PALLAS_MATMULS = {"mha_forward": 2, "mha_backward": 7, "mha_preprocess_backward": 0}
CUDNN_MATMULS = {"forward": 2, "backward": 5}


@dataclasses.dataclass(frozen=True)
class Call:
    """One fused attention kernel: what it is, its shapes and whether it is causal (None: not known)."""

    kernel: str  # "mha_forward", ... for the Pallas kernels; the custom-call target for cuDNN
    matmuls: int  # T x S x D matmuls per (batch, head): 2 forward; 7 Pallas backward, 5 cuDNN backward
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int  # as multiplied: the Pallas kernel's padded to a power of two
    causal: bool | None
    dtype: str  # the peak it runs at: "bf16", "f16", "tf32"

    @property
    def flops(self) -> float:
        """matmuls · 2·B·H·T·S·D, halved when causal (the full square when causality is unknown)."""
        full = self.matmuls * 2.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim
        return full / 2 if self.causal else full

    def as_tuple(self) -> tuple:
        return (self.matmuls, self.batch, self.heads, self.q_len, self.kv_len, self.head_dim, self.causal)

    @classmethod
    def from_tuple(cls, shape: tuple, kernel: str, dtype: str, causal: bool | None = None) -> Call:
        """A Call back from as_tuple's fields (kernels.Kernel.attention), with `causal` where it was unknown."""
        matmuls, batch, heads, q_len, kv_len, head_dim, known = shape
        return cls(kernel, matmuls, batch, heads, q_len, kv_len, head_dim, known if known is not None else causal,
                   dtype)  # fmt: skip


def _peak_dtype(element: str) -> str:
    return element if element in ("bf16", "f16") else "tf32"


def _operand_dims(instruction: hlo.Instruction, computation: dict, index: int) -> tuple[int, ...]:
    name = instruction.operands[index] if len(instruction.operands) > index else None
    return hlo.dims(computation[name].shape) if name in computation else ()


def _pallas(instruction: hlo.Instruction, computation: dict, name: str) -> Call | None:
    q, k = _operand_dims(instruction, computation, 0), _operand_dims(instruction, computation, 1)
    if len(q) != 4 or len(k) != 4:
        return None
    batch, q_len, heads, head_dim = q
    dtype = _peak_dtype(hlo.element_type(computation[instruction.operands[0]].shape))
    padded = 1 << max(0, head_dim - 1).bit_length()  # pl.next_power_of_2
    return Call(name, PALLAS_MATMULS[name], batch, heads, q_len, k[1], padded, None, dtype)


def _cudnn(instruction: hlo.Instruction, computation: dict, target: str) -> Call | None:
    shape = _INTERMEDIATE.search(instruction.attributes)
    q = _operand_dims(instruction, computation, 0)
    if shape is None or not q:
        return None
    dims = [int(d) for d in re.findall(r"\d+", shape.group(1))]
    if len(dims) != 4:
        return None
    batch, heads, q_len, kv_len = dims
    mask = _MASK.search(instruction.attributes)
    causal = ("CAUSAL" in mask.group(1)) if mask else None
    matmuls = CUDNN_MATMULS["backward" if "Backward" in target else "forward"]
    dtype = _peak_dtype(hlo.element_type(computation[instruction.operands[0]].shape))
    return Call(target, matmuls, batch, heads, q_len, kv_len, q[-1], causal, dtype)


def parse(instruction: hlo.Instruction, computation: dict[str, hlo.Instruction]) -> Call | None:
    """The fused attention kernel a custom call runs, or None when it is not one (or its shapes are unreadable).

    Args:
      instruction: a custom-call of the optimized HLO.
      computation: the computation holding it (for its operands' shapes).
    """
    found = _TARGET.search(instruction.attributes)
    target = found.group(1) if found else ""
    if target == "__gpu$xla.gpu.triton":
        name = _PALLAS_NAME.search(instruction.attributes)
        return _pallas(instruction, computation, name.group(1)) if name else None
    if _CUDNN.search(target):
        return _cudnn(instruction, computation, target)
    return None

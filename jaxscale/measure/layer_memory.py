"""The analytic bytes of activations: what each layer keeps for its backward pass, tensor by tensor (Korthikanti et
al. 2022's accounting, with what JAX's autodiff adds when scanned), what each remat policy and the closed form
(model.residuals) keep of it, and what the output head keeps (docs/measurements.md gives the derivation). The memory
model (jaxscale.measure.memory) sums them per device; the sizes are jaxscale.measure.activation_dims' Dims, a mixture
of experts' routed terms jaxscale.measure.moe_memory's.
"""

from __future__ import annotations

import dataclasses

from jaxscale.config import remat_policies
from jaxscale.measure import moe_memory
from jaxscale.measure.activation_dims import Dims

_FLOAT32 = 4  # params, gradients, optimizer state and LayerNorm statistics are float32
_BOOL = 1  # a dropout keep-mask element


def _split(terms: dict[str, int], names: set[str], d: Dims) -> dict[str, int]:
    """The terms with those in `names` divided by the tensor-parallel degree t (Megatron splits them), the
    others by d.sp (sequence parallelism splits the rest along the sequence: Korthikanti et al. 2022, Sec. 4.2.2,
    sbh(34/t + 5as/(ht)) per layer)."""
    return {name: value // d.t if name in names else value // d.sp for name, value in terms.items()}


# Per-layer tensors that tensor parallelism splits: everything between the column-parallel (QKV, up) and
# row-parallel (out, down) matmuls of a block: q, k, v, the attention matrices, the AV output, the MLP's
# hidden activations, and the compute-dtype kernel copies. LayerNorm inputs and outputs, the dropout masks
# and the block outputs stay whole on every device (Korthikanti et al. 2022, Sec. 4.2.2: 10sbh replicated,
# 24sbh/t and 5as²b/t split, for 16-bit activations).
_ATTN_SPLIT = {"softmax_exp", "softmax_weights", "v", "q_k", "attention_output", "qkv", "logsumexp", "kernel_casts"}
_MLP_SPLIT = {"up_output", "gelu_output", "gelu_intermediates", "kernel_casts"}
_LLAMA_MLP_SPLIT = {"gate_output", "up_output", "hidden", "silu_intermediates", "kernel_casts"}  # SwiGLU's


def attention_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes the attention sub-block keeps for its backward pass, per layer, by tensor.

    Korthikanti et al. (2022), Sec. 4.1, adapted: no dropout on the attention matrix (the GPT drops out
    only after the output projection), the softmax in its own dtype q (the reference: float32) with the
    attention weights cast back to the compute dtype p for the AV matmul, and 1-byte dropout masks.
    `scanned`: inside nn.scan each value JAX's autodiff saves becomes its own stacked loop output,
    because XLA cannot fuse across the loop boundary: LayerNorm's three float32 intermediates and the
    softmax-dtype copies of q and k stay; unrolled, XLA recomputes them inside fused kernels.
    """
    sbh, as2b = d.s * d.b * d.h, d.a * d.s * d.s * d.b
    terms = {"ln_output": d.p * sbh, "attention_output": d.p * sbh, "dropout_mask": d.mask * sbh}
    if d.fused_attention:  # a flash kernel keeps q, k, v, the output and the log-sum-exp only
        terms.update(qkv=3 * d.p * sbh, logsumexp=_FLOAT32 * d.a * d.s * d.b)
    else:
        terms.update(softmax_exp=d.q * as2b, softmax_weights=d.p * as2b)  # exp(x - max) and its normalized cast
        q_k = d.q if d.attention == "reference" else d.p
        terms.update(v=d.p * sbh, q_k=2 * (q_k if scanned else d.p) * sbh)
    if scanned:
        terms.update(ln_float32=3 * _FLOAT32 * sbh)
        terms.update(kernel_casts=4 * d.h * d.h * d.p if d.kernel_casts else 0)
    else:
        terms.update(ln_input=d.p * sbh, ln_stats=2 * _FLOAT32 * d.s * d.b)
    return _split(terms, _ATTN_SPLIT, d)


def mlp_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes the MLP sub-block keeps for its backward pass, per layer, by tensor (Korthikanti's 19sbh
    at p=2: LayerNorm input and output, GELU input, GELU output = down-projection input, dropout mask).
    Scanned, the tanh-approximate GELU's four intermediates and LayerNorm's float32 ones are kept too."""
    sbh, sbf = d.s * d.b * d.h, d.s * d.b * d.f
    terms = {
        "ln_output": d.p * sbh,
        "up_output": d.p * sbf,
        "gelu_output": d.p * sbf,
        "dropout_mask": d.mask * sbh,
    }
    if scanned:
        terms.update(gelu_intermediates=4 * d.p * sbf, ln_float32=3 * _FLOAT32 * sbh)
        terms.update(kernel_casts=2 * d.f * d.h * d.p if d.kernel_casts else 0)
    else:
        terms.update(ln_input=d.p * sbh, ln_stats=2 * _FLOAT32 * d.s * d.b)
    return _split(terms, _MLP_SPLIT, d)


def llama_attention_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes Llama's attention sub-block keeps for its backward pass, per layer, by tensor.

    As attention_residuals, with the differences of the family: RMSNorm keeps one float32 statistic per
    token (LayerNorm two); k and v are sbk, not sbh (grouped-query attention); q and k are kept after the
    rotation (the rotation's sin and cos are constants). Scanned, RMSNorm's float32 input and the
    rotation's float32 q and k stay as loop outputs. Tensor parallelism splits the same terms as the GPT's.
    """
    sbh, sbk, as2b = d.s * d.b * d.h, d.s * d.b * d.k, d.a * d.s * d.s * d.b
    terms = {"norm_output": d.p * sbh, "attention_output": d.p * sbh, "dropout_mask": d.mask * sbh}
    if d.fused_attention:
        terms.update(qkv=d.p * (sbh + 2 * sbk), logsumexp=_FLOAT32 * d.a * d.s * d.b)
    else:
        terms.update(softmax_exp=d.q * as2b, softmax_weights=d.p * as2b)
        q_k = d.q if d.attention == "reference" else d.p
        terms.update(v=d.p * sbk, q_k=(q_k if scanned else d.p) * (sbh + sbk))
    if scanned:
        terms.update(norm_float32=3 * _FLOAT32 * sbh)
        terms.update(kernel_casts=(2 * d.h * d.h + 2 * d.h * d.k) * d.p if d.kernel_casts else 0)
    else:
        terms.update(norm_input=d.p * sbh, norm_stats=_FLOAT32 * d.s * d.b)
    return _split(terms, _ATTN_SPLIT, d)


def llama_mlp_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes the SwiGLU MLP keeps for its backward pass, per layer: RMSNorm input and output, the gate and up
    projections' outputs and their product silu(gate)·up (the down projection's input), a dropout mask.
    Scanned, silu's sigmoid and RMSNorm's float32 intermediates stay too."""
    sbh, sbf = d.s * d.b * d.h, d.s * d.b * d.f
    terms = {
        "norm_output": d.p * sbh,
        "gate_output": d.p * sbf,
        "up_output": d.p * sbf,
        "hidden": d.p * sbf,
        "dropout_mask": d.mask * sbh,
    }
    if scanned:
        terms.update(silu_intermediates=3 * d.p * sbf, norm_float32=3 * _FLOAT32 * sbh)
        terms.update(kernel_casts=3 * d.f * d.h * d.p if d.kernel_casts else 0)
    else:
        terms.update(norm_input=d.p * sbh, norm_stats=_FLOAT32 * d.s * d.b)
    return _split(terms, _LLAMA_MLP_SPLIT, d)


_SWIGLU_TERMS = ("gate_output", "up_output", "hidden", "silu_intermediates", "kernel_casts")


def moe_mlp_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes a mixture of experts' layer keeps for its backward pass (jaxscale.model.moe): llama_mlp_residuals'
    RMSNorm and dropout mask, its SwiGLU terms for the shared experts (width d.moe.shared, 0 without them, prefixed
    shared_), and the router's and routed experts' terms of the dispatch (moe_memory.routed_residuals)."""
    dense = llama_mlp_residuals(dataclasses.replace(d, f=d.moe.shared), scanned)
    terms = {f"shared_{k}" if k in _SWIGLU_TERMS else k: v for k, v in dense.items()}
    return {**terms, **moe_memory.routed_residuals(d, scanned)}


def residual_functions(family: str, moe: bool = False) -> tuple:
    """The (attention, MLP) residual functions of a family, with `moe` a mixture of experts' MLP (looked up when
    called, so a test can swap one)."""
    attn, mlp = {
        "gpt": (attention_residuals, mlp_residuals),
        "llama": (llama_attention_residuals, llama_mlp_residuals),
    }[family]
    return attn, moe_mlp_residuals if moe else mlp


# Bytes of what each remat policy keeps besides the checkpointed module's input: the tensors
# jaxscale.config.remat_policies.kept names. Tensor parallelism splits the q/k/v and up (and gate) projections'
# outputs and the attention's; the out and down projections' are whole. A policy that saves by name keeps a
# tensor only where the unit's backward pass reads it: the out projection's output only under Block (the MLP's
# norm reads it), the down projection's never (it only feeds the residual add); JAX's dot policies
# (saves_by_dot_type) are counted with both in their unit. What is offloaded (qkv_proj_offloaded) is in host
# memory, none of it on the device. A mixture of experts' MLP: its shared experts' SwiGLU here (width d.moe.shared),
# the router's and routed experts' tensors moe_memory.saved_bytes.
def _policy_saved(d: Dims, policy: str) -> dict[str, int]:
    f = d.moe.shared if d.moe else d.f
    sbh, sbk, sbf, as2b = d.s * d.b * d.h, d.s * d.b * d.k, d.s * d.b * f, d.a * d.s * d.s * d.b
    kept, by_type = remat_policies.kept(policy, d.family), remat_policies.saves_by_dot_type(policy)
    qkv = d.p * (sbh * ("q" in kept) + sbk * ("k" in kept) + sbk * ("v" in kept)) // d.t
    up = d.p * (("gate" in kept) + ("up" in kept)) * sbf // d.t
    lse = _FLOAT32 * d.a * d.s * d.b // d.t if d.attention in ("chunked", "flash") else 0  # [b, a, s] float32
    # The attention output (and the kernels' log-sum-exp); with the logits (a dot policy: the T x T matrix,
    # which a fused kernel keeps inside it).
    logits = d.q * as2b if "logits" in kept and not d.fused_attention else 0
    context = (d.p * sbh + logits) // d.t + lse if "context" in kept else 0
    whole = d.p * sbh if by_type else 0  # a dot policy's out (Attn) and down (MLP) projection outputs
    attn = qkv + context + (whole if "out" in kept else 0)
    mlp = up + (whole if "down" in kept and f else 0)
    if d.moe:
        mlp += moe_memory.saved_bytes(d, kept, by_type, with_batch_dims="logits" in kept)
    # the out and down projections' outputs a name policy saves, kept under Block only (under Attn or MLP remat each is
    # its checkpoint's output)
    out = d.p * sbh // d.sp * (("out" in kept) + ("down" in kept and bool(f))) if not by_type else 0
    return {"Attn": attn, "MLP": mlp, "Block": attn + mlp + out}


# Terms of the analytic model that are fitted to compiled plans rather than counted (the row's
# analytic_fitted_terms; docs/measurements.md gives the data).
FITTED_TERMS = ("logits",)


def head_residuals(d: Dims, causal_mask: bool) -> dict[str, int]:
    """Bytes outside the layers: token inputs, the embedding's dropout mask, the final norm, and the logits.

    The logits term, 2p bytes per logit, is FITTED, not counted: it is the per-sequence slope of deviceless
    A5000 plans of llama3.2-1b (vocabulary 128256, seq 2048), 4 bytes per logit at p = 2 in both GEMM modes
    (the earlier p + 2·4 was 2.5x the plan there). Counted from the optimized HLO of a tiny step (Llama,
    vocabulary 16384, Triton GEMMs), the head's backward holds the matmul's p-byte logits and the float32
    gradient of the loss w.r.t. the float32 logits (softmax minus the label's scatter-add, in place) at
    once, p + 4 bytes per logit, then casts that gradient to p bytes into the logits' slot; at :seed with
    batch 256 the head's buffers share their slots with the layers' backward, so no one count of the head
    sets the peak, and the fitted value stays (FITTED_TERMS, the row's analytic_fitted_terms).
    With train.loss_chunk_len = C the head and loss run one [b, C, v] chunk at a time under remat
    (jaxscale.train.step.chunked_next_token_loss), so the term counts C positions instead of s.
    `causal_mask`: the [b, a, s, s] boolean mask that a scan hoists out of the loop and keeps once."""
    sbh, bsv = d.s * d.b * d.h, d.b * (d.c or d.s) * d.v  # with a chunked loss, one chunk's logits live
    return {
        "tokens": 2 * 4 * d.b * d.s,  # int32 inputs and labels
        "embedding_dropout_mask": d.mask * sbh // d.sp,
        "final_ln": 2 * d.p * sbh // d.sp,
        "logits": 2 * d.p * bsv // d.t,  # fitted (see above); split by vocabulary under tensor parallelism
        "causal_mask": _BOOL * d.a * d.s * d.s * d.b // d.t if causal_mask else 0,  # split by heads
    }


# What the closed form leaves out of the unscanned terms: the dropout mask and the norm's float32 statistics, which
# the backward pass recomputes (the mask from its random key, the statistics from the norm's input it keeps), and a
# mixture of experts' routing (its top-k, slots, masks and sort, integer and one-hot work recomputed from the
# router's logits, which it keeps: the router_probs term's size).
_RECOMPUTED = ("dropout_mask", "ln_stats", "norm_stats", "routing", "slot_rows", "sort_indices", "dispatch_mask",
               "combine_mask", "combine_weights")  # fmt: skip


def closed_form_residuals(d: Dims) -> dict[str, dict[str, int]]:
    """The bytes each sub-block keeps at the closed form (remat_policies.CLOSED_FORM, model.residuals=closed_form),
    by tensor: what its backward pass reads, each once in the compute dtype. The attention: the norm's input (the
    sub-block's input) and output, q, k, v, the kernel's output and log-sum-exp; the MLP: the norm's input and
    output, the up (and gate) projection's output and the down projection's input. They are the unscanned terms
    (attention_residuals, mlp_residuals and the Llama family's) less the dropout mask and the norm's statistics,
    recomputed (_RECOMPUTED); scanned or not, the same. A mixture of experts' MLP (d.moe): the norm's input and
    output, the router's float32 logits, the experts' tokens as they see them (the dense dispatch's are the norm's
    output), their gate, up and hidden, and the outputs the combine reads, at the dispatch's rows (moe_memory), with
    the shared experts' SwiGLU terms.
    """
    attn, mlp = residual_functions(d.family, moe=d.moe is not None)
    return {unit: {k: v for k, v in terms.items() if k not in _RECOMPUTED}
            for unit, terms in (("Attn", attn(d, False)), ("MLP", mlp(d, False)))}  # fmt: skip


def layer_activation_bytes(d: Dims, remat: tuple[str, ...], policy: str, scanned: bool) -> tuple[int, int]:
    """(bytes one layer keeps until its backward pass, bytes of one recomputed unit during it).

    A checkpointed module keeps only its input (p·sbh) and the dot outputs its policy saves; its
    residuals come back during the backward pass as a working set, one unit at a time, fused (XLA
    optimizes the recompute and its backward as one region, so the fused terms apply even when scanned).
    A mixture of experts' layer (d.moe) has moe_mlp_residuals for its MLP, and its expert-parallel exchange's
    transient copy (moe_memory.all_to_all_bytes) in the working set. A sub-block no remat target covers keeps
    what autodiff saves (attention_residuals and the others, `scanned` or not), or under model.residuals=closed_form
    (d.closed) its closed_form_residuals, scanned or not (a mixture of experts' MLP too).
    """
    sbh = d.s * d.b * d.h // d.sp  # a module's input: the residual stream, split by sequence parallelism
    attn, mlp = residual_functions(d.family, moe=d.moe is not None)
    kept = {"Attn": sum(attn(d, scanned).values()), "MLP": sum(mlp(d, scanned).values())}
    for unit in d.closed:
        kept[unit] = sum(closed_form_residuals(d)[unit].values())
    fused = {"Attn": sum(attn(d, False).values()), "MLP": sum(mlp(d, False).values())}
    fused["Block"] = fused["Attn"] + fused["MLP"]
    saved = _policy_saved(d, policy)
    if "Block" in remat:
        layer = d.p * sbh + saved["Block"]
    else:
        layer = sum(d.p * sbh + saved[unit] if unit in remat else kept[unit] for unit in ("Attn", "MLP"))
    return layer, max((fused[unit] for unit in remat), default=0) + moe_memory.all_to_all_bytes(d)

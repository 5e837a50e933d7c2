"""Memory figures named by source: analytic estimate, XLA's compiled plan, the device's allocator, the host.

On a device mesh every figure is per device: XLA's plan of a sharded program is one device's, and the
analytic model divides each tensor by the mesh axes that split it (`sharded_param_count`, `Dims.t`).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections

from jaxscale.config import mesh_shape


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int | None]:
    """XLA's buffer plan for one call of the compiled step, in bytes.

    compiled_peak_bytes = argument + output - alias + temp: the inputs and outputs live at once except
    where an output reuses a donated input's buffer (alias), plus XLA's scratch for intermediates (temp).
    It is the plan of the backend that compiled it (a CPU plan is only a proxy for a GPU's), and it
    leaves out the runtime's own overheads (allocator fragmentation, CUDA context, preallocation).
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {f"compiled_{k}_bytes": None for k in ("argument", "output", "temp", "alias", "peak")}
    row = {
        "compiled_argument_bytes": int(analysis.argument_size_in_bytes),
        "compiled_output_bytes": int(analysis.output_size_in_bytes),
        "compiled_temp_bytes": int(analysis.temp_size_in_bytes),
        "compiled_alias_bytes": int(analysis.alias_size_in_bytes),
    }
    row["compiled_peak_bytes"] = (
        row["compiled_argument_bytes"]
        + row["compiled_output_bytes"]
        - row["compiled_alias_bytes"]
        + row["compiled_temp_bytes"]
    )
    return row


def device_peak_bytes(devices: Sequence[jax.Device] | None = None) -> tuple[int | None, str | None]:
    """The allocator's peak_bytes_in_use (the largest over `devices`, default the first device), or
    (None, why) where the backend keeps no statistics (CPU)."""
    devices = list(devices or jax.local_devices()[:1])
    peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use") for device in devices]
    if any(peak is None for peak in peaks):
        platform = devices[0].platform
        return None, f"not available on the {platform} backend (memory_stats() has no peak_bytes_in_use)"
    return int(max(peaks)), None


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process (getrusage; kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# ---------------------------------------------------------------------------------------------------------
# Analytic estimate: bytes of named tensors, per config (see docs/measurements.md for the derivation).

# Optimizer state in float32 copies of the parameters: Adam's two moments, SGD's momentum trace.
OPTIMIZER_STATE_COPIES = {"adam": 2, "adamw": 2, "sgd": 1}
_FLOAT32 = 4  # params, gradients, optimizer state and LayerNorm statistics are float32
_BOOL = 1  # a dropout keep-mask element


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes that activation memory depends on, for one minibatch on one device: Korthikanti et al.'s s, b, h,
    a and t."""

    b: int  # sequences per minibatch on one device (the minibatch split over mesh.data x mesh.fsdp)
    s: int  # sequence length
    h: int  # hidden size
    a: int  # attention heads
    e: int  # MLP expansion
    v: int  # vocabulary
    p: int  # bytes per activation element (compute dtype)
    q: int  # bytes per attention-logit element (softmax dtype)
    mask: int  # bytes per dropout-mask element: 1, or 0 without dropout
    kernel_casts: bool  # compute dtype differs from the float32 params, so matmuls read cast copies
    attention: str  # reference | xla | cudnn
    t: int = 1  # tensor-parallel degree (mesh.tensor): heads, MLP width and vocabulary are split t ways

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> Dims:
        m, p = config.model, jnp.dtype(config.model.dtype).itemsize
        data, fsdp, tensor = mesh_shape(config)
        return cls(
            b=config.data.batch_size // config.train.num_minibatches // (data * fsdp),
            s=config.data.seq_len,
            h=m.hidden_size,
            a=m.hidden_size // m.head_dim,
            e=m.mlp_expansion,
            v=m.vocab_size,
            p=p,
            q=jnp.dtype(m.softmax_dtype).itemsize,
            mask=_BOOL if m.dropout_rate > 0 else 0,
            kernel_casts=p != _FLOAT32,
            attention=m.attention,
            t=tensor,
        )


def _split(terms: dict[str, int], names: set[str], t: int) -> dict[str, int]:
    """The terms with those in `names` divided by the tensor-parallel degree t (Megatron splits them)."""
    return {name: value // t if name in names else value for name, value in terms.items()}


# Per-layer tensors that tensor parallelism splits: everything between the column-parallel (QKV, up) and
# row-parallel (out, down) matmuls of a block: q, k, v, the attention matrices, the AV output, the MLP's
# hidden activations, and the compute-dtype kernel copies. LayerNorm inputs and outputs, the dropout masks
# and the block outputs stay whole on every device (Korthikanti et al. 2022, Sec. 4.2.2: 10sbh replicated,
# 24sbh/t and 5as²b/t split, for 16-bit activations).
_ATTN_SPLIT = {"softmax_exp", "softmax_weights", "v", "q_k", "attention_output", "qkv", "logsumexp", "kernel_casts"}
_MLP_SPLIT = {"up_output", "gelu_output", "gelu_intermediates", "kernel_casts"}


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
    if d.attention == "cudnn":  # flash attention keeps q, k, v, the output and the log-sum-exp only
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
    return _split(terms, _ATTN_SPLIT, d.t)


def mlp_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes the MLP sub-block keeps for its backward pass, per layer, by tensor (Korthikanti's 19sbh
    at p=2: LayerNorm input and output, GELU input, GELU output = down-projection input, dropout mask).
    Scanned, the tanh-approximate GELU's four intermediates and LayerNorm's float32 ones are kept too."""
    sbh = d.s * d.b * d.h
    terms = {
        "ln_output": d.p * sbh,
        "up_output": d.e * d.p * sbh,
        "gelu_output": d.e * d.p * sbh,
        "dropout_mask": d.mask * sbh,
    }
    if scanned:
        terms.update(gelu_intermediates=4 * d.e * d.p * sbh, ln_float32=3 * _FLOAT32 * sbh)
        terms.update(kernel_casts=2 * d.e * d.h * d.h * d.p if d.kernel_casts else 0)
    else:
        terms.update(ln_input=d.p * sbh, ln_stats=2 * _FLOAT32 * d.s * d.b)
    return _split(terms, _MLP_SPLIT, d.t)


# Outputs of dots that each remat policy keeps besides the checkpointed module's input. Tensor parallelism
# splits the QKV and up projections' outputs and the attention's; the out and down projections' are whole.
def _policy_saved(d: Dims, policy: str) -> dict[str, int]:
    sbh, as2b = d.s * d.b * d.h, d.a * d.s * d.s * d.b
    qkv, up = 3 * d.p * sbh // d.t, d.e * d.p * sbh // d.t
    projections = {"Attn": qkv + d.p * sbh, "MLP": up + d.p * sbh}  # qkv + out; up + down
    attention = (d.q * as2b + d.p * sbh) // d.t  # the logits and the AV output
    saved = {
        "nothing_saveable": {"Attn": 0, "MLP": 0},
        "dots_saveable": {"Attn": projections["Attn"] + attention, "MLP": projections["MLP"]},
        "dots_with_no_batch_dims_saveable": projections,
        "save_qkv_proj": {"Attn": qkv, "MLP": 0},
    }[policy]
    return {**saved, "Block": saved["Attn"] + saved["MLP"]}


def head_residuals(d: Dims, causal_mask: bool) -> dict[str, int]:
    """Bytes outside the layers: token inputs, the embedding's dropout mask, the final LayerNorm, and the
    logits (compute dtype, their float32 cast, and the float32 softmax the cross-entropy gradient reads).
    `causal_mask`: the [b, a, s, s] boolean mask that a scan hoists out of the loop and keeps once."""
    sbh, bsv = d.s * d.b * d.h, d.b * d.s * d.v
    return {
        "tokens": 2 * 4 * d.b * d.s,  # int32 inputs and labels
        "embedding_dropout_mask": d.mask * sbh,
        "final_ln": 2 * d.p * sbh,
        "logits": (d.p + 2 * _FLOAT32) * bsv // d.t,  # split by vocabulary under tensor parallelism
        "causal_mask": _BOOL * d.a * d.s * d.s * d.b // d.t if causal_mask else 0,  # split by heads
    }


def layer_activation_bytes(d: Dims, remat: tuple[str, ...], policy: str, scanned: bool) -> tuple[int, int]:
    """(bytes one layer keeps until its backward pass, bytes of one recomputed unit during it).

    A checkpointed module keeps only its input (p·sbh) and the dot outputs its policy saves; its
    residuals come back during the backward pass as a working set, one unit at a time, fused (XLA
    optimizes the recompute and its backward as one region, so the fused terms apply even when scanned).
    """
    sbh = d.s * d.b * d.h
    kept = {"Attn": sum(attention_residuals(d, scanned).values()), "MLP": sum(mlp_residuals(d, scanned).values())}
    fused = {"Attn": sum(attention_residuals(d, False).values()), "MLP": sum(mlp_residuals(d, False).values())}
    fused["Block"] = fused["Attn"] + fused["MLP"]
    saved = _policy_saved(d, policy)
    if "Block" in remat:
        layer = d.p * sbh + saved["Block"]
    else:
        layer = sum(d.p * sbh + saved[unit] if unit in remat else kept[unit] for unit in ("Attn", "MLP"))
    return layer, max((fused[unit] for unit in remat), default=0)


def sharded_param_count(model: ml_collections.ConfigDict, fsdp: int = 1, tensor: int = 1) -> int:
    """Parameters one device holds when FSDP splits every embed axis fsdp ways and tensor parallelism
    splits heads, MLP width and vocabulary tensor ways (the layout of jaxscale.train.sharding.RULES; a
    test checks this count against the real shardings). `param_count` is the fsdp = tensor = 1 case.

    Per layer: the four kernels (3H² + H² + 2eH²) have both axes, so / (fsdp·tensor); the two LayerNorms and
    the out and down biases (6H) only embed, / fsdp; the QKV and up biases (3H + eH) only heads or MLP,
    / tensor. Plus the token embedding and output kernel (2VH, both), the positional embedding and final
    LayerNorm (SH + 2H, embed) and the output bias (V, vocabulary).
    """
    h, v, s, f, t = model.hidden_size, model.vocab_size, model.max_seq_len, fsdp, tensor
    return model.num_layers * layer_param_count(model, f, t) + 2 * v * h // (f * t) + (s * h + 2 * h) // f + v // t


def layer_param_count(model: ml_collections.ConfigDict, fsdp: int = 1, tensor: int = 1) -> int:
    """Parameters of one transformer block on one device (see sharded_param_count)."""
    h, e, f, t = model.hidden_size, model.mlp_expansion, fsdp, tensor
    return (4 * h * h + 2 * e * h * h) // (f * t) + 6 * h // f + (3 * h + e * h) // t


def analytic_memory(config: ml_collections.ConfigDict) -> dict[str, int]:
    """Analytic peak memory of one train step on one device, in bytes, broken down for the result row.

    Peak = params + gradients + optimizer state + activations, at the start of the (last minibatch's)
    backward pass, when every layer's saved activations are alive:
      params: 4·N (float32), N the parameters this device holds (sharded_param_count: all of them on one
        device or under pure data parallelism; ZeRO-3 / FSDP divides by mesh.fsdp, Rajbhandari et al.
        2020; tensor parallelism divides the split matrices by mesh.tensor, Shoeybi et al. 2019).
      optimizer: OPTIMIZER_STATE_COPIES × 4·N (sharded like the parameters).
      grads: 4·N for the minibatch's gradients, plus 4·N for the accumulator when num_minibatches > 1
        (scanned layers write their gradients into a stacked buffer allocated before the backward loop);
        sharded like the parameters (the step constrains them so: FSDP reduce-scatters).
      activations: L × per-layer bytes (layer_activation_bytes) + one recomputed unit + head_residuals,
        for the minibatch's share of this device (/ data·fsdp) with tensor-parallel terms split (Dims.t);
        with accumulate='loop' every minibatch's activations, as both XLA backends schedule the unrolled
        minibatches' forward passes together (measured; see docs/measurements.md). Under FSDP one layer's
        parameters are gathered whole (/ tensor) at a time, with their full gradient before it is
        reduce-scattered: 2 × 4 × its parameters (analytic_fsdp_gather_bytes, in the activations).
    """
    m, t = config.model, config.train
    _, fsdp, tensor = mesh_shape(config)
    d, n = Dims.from_config(config), sharded_param_count(m, fsdp, tensor)
    layer, working = layer_activation_bytes(d, tuple(m.remat), m.remat_policy, m.scan_layers)
    causal_mask = m.scan_layers and m.causal and m.attention == "reference"
    per_minibatch = m.num_layers * layer + sum(head_residuals(d, causal_mask).values())
    live = t.num_minibatches if t.accumulate == "loop" else 1
    gather = 2 * _FLOAT32 * layer_param_count(m, 1, tensor) if fsdp > 1 else 0
    row = {
        "analytic_params_bytes": _FLOAT32 * n,
        "analytic_grads_bytes": _FLOAT32 * n * (2 if t.num_minibatches > 1 else 1),
        "analytic_optimizer_bytes": _FLOAT32 * n * OPTIMIZER_STATE_COPIES[config.optimizer.name],
        "analytic_activation_bytes": live * per_minibatch + working + gather,
        "analytic_activation_per_layer_bytes": layer,
        "analytic_fsdp_gather_bytes": gather,
    }
    row["analytic_peak_bytes"] = sum(row[f"analytic_{k}_bytes"] for k in ("params", "grads", "optimizer", "activation"))
    return row


def analytic_columns(config: ml_collections.ConfigDict, compiled_peak_bytes: int | None) -> dict[str, object]:
    """The analytic breakdown plus compiled_to_analytic_peak_ratio (compiled plan / analytic estimate)."""
    row: dict[str, object] = dict(analytic_memory(config))
    peak = row["analytic_peak_bytes"]
    row["compiled_to_analytic_peak_ratio"] = compiled_peak_bytes / peak if compiled_peak_bytes and peak else None
    return row

"""FP8 matmuls for the projections: dynamic (current) tensorwise scaling, as torchtitan's Float8 runs it, or
delayed scaling, as Flax's Fp8DirectDotGeneralOp (MaxText's `quantization=fp8`) and Transformer Engine run it.

`model.fp8 = "dynamic"` runs each projection named by `model.fp8_targets` (attention, mlp, head, or projection
names; the output head stays in the compute dtype unless named, as in torchtitan) as an FP8 GEMM:

- forward: the input and the weight are each scaled by their own current absolute maximum (one float32 scale
  per tensor, `scale = amax / max(e4m3)`), rounded to float8_e4m3fn and multiplied back (a quantize-dequantize,
  Flax's `flax.linen.fp8_ops.qdq`, the maintained op), then multiplied;
- backward: the output's gradient likewise in float8_e5m2 (more range, less precision, for gradients); the
  input's gradient is its product with the quantized weight, the weight's gradient the quantized input's with it.

torchao's tensorwise recipe (torchtitan's `float8` default: `Float8LinearConfig`, "dynamic" scaling, e4m3 for
the forward's inputs and weights, e5m2 for the output gradient: pytorch/ao torchao/float8/README.md) computes the
same scales. On an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer) XLA's GEMM rewriter
turns `dot(convert(convert(x, f8) , bf16) * scale, ...)` into one FP8 GEMM with the scales as its arguments
(cuBLASLt's `__cublas$lt$matmul$f8`, or a Triton FP8 GEMM fusion): checked in a deviceless H100 compile
(tests/model/test_fp8.py). On a CPU (and a GPU without FP8) the same program computes in the compute dtype on
values rounded to FP8: the same function, so the CPU tests check the numerics.

`model.fp8 = "delayed"` runs the same projections through Flax's own `nn.Fp8DirectDotGeneralOp` (flax.linen.fp8_ops,
the maintained op; this module only casts the float32 kernel to the compute dtype on its shard first). Each GEMM keeps
per tensor (input, kernel, output gradient) a history of the last `model.fp8_amax_history` absolute maxima and a
scale; a step quantizes with the scale computed from the history *before* it (scale = max(history) / max(dtype), the
previous scale where that max is 0 or not finite) and pushes its own amax onto the history (Flax's
`update_fp8_meta`, Transformer Engine's `update_fp8_metas`). The state lives in Flax's `_overwrite_with_gradient`
collection: the ops return its new value as its "gradient", so the train step carries it beside the parameters
(jaxscale.train.step.TrainState.fp8_meta) and replaces it after each step instead of handing it to the optimizer,
as flax.training.train_state does. Accumulated over minibatches, the new states (one per minibatch, all computed
from the same old state) are combined by their maximum: the histories' newest entry is then the whole batch's amax,
the scales are equal anyway, so the step equals the one-minibatch step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from jaxscale.config import finetune
from jaxscale.config.spec import ModelConfig
from jaxscale.model import precision

OVERWRITE = fp8_ops.OVERWRITE_WITH_GRADIENT  # Flax's collection of delayed-scaling state (amax histories, scales)
FORWARD_DTYPE = jnp.float8_e4m3fn  # inputs and weights: 3 mantissa bits, max 448
GRADIENT_DTYPE = jnp.float8_e5m2  # output gradients: 2 mantissa bits, max 57344


def delayed(cfg: ModelConfig, name: str) -> bool:
    """Whether the projection called `name` runs in FP8 with delayed scaling (Flax's op and its state)."""
    return cfg.fp8 == "delayed" and applies(cfg, name)


def applies(cfg: ModelConfig, name: str) -> bool:
    """Whether the projection called `name` runs in FP8 under cfg.fp8 and cfg.fp8_targets."""
    return cfg.fp8 != "none" and name in finetune.fp8_projections(cfg.family, cfg.fp8_targets)


def tensor_scale(x: jax.Array, dtype: Any) -> jax.Array:
    """The float32 scale of a tensorwise quantization to `dtype`: amax(|x|) / max(dtype), 1 where x is all zero
    (Flax's convention: quantize divides by it, dequantize multiplies)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / jnp.finfo(dtype).max.astype(jnp.float32), jnp.float32(1))


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """`x` in the FP8 `dtype` at its own current tensorwise scale (Flax's fp8_ops.quantize), and that scale."""
    scale = tensor_scale(x, dtype)
    return fp8_ops.quantize(x, dtype, scale, x.dtype), scale


def dot_general(cfg: ModelConfig, names: tuple[str | None, ...]) -> Callable[..., jax.Array]:
    """A `dot_general` for nn.DenseGeneral in FP8 with dynamic tensorwise scaling (see the module docstring):
    inputs [.., in] in the compute dtype, the float32 kernel named `names` cast to it on its shard
    (jaxscale.model.precision.compute_weight) before it is quantized. Each GEMM takes FP8 operands and returns
    the compute dtype (the kernel's gradient float32, as precision.weight_gradient), multiplied by the
    operands' scales; the FP8 operands are what the backward pass keeps (a byte per element)."""

    def forward(x: jax.Array, w: jax.Array, dims: Any) -> tuple[jax.Array, tuple]:
        xq, x_scale = quantize(x, FORWARD_DTYPE)
        wq, w_scale = quantize(precision.compute_weight(cfg, w, names), FORWARD_DTYPE)
        out = lax.dot_general(xq, wq, dims, preferred_element_type=x.dtype)
        return out * (x_scale * w_scale).astype(x.dtype), (xq, x_scale, wq, w_scale)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def dot(x: jax.Array, w: jax.Array, dims: Any) -> jax.Array:
        return forward(x, w, dims)[0]

    def dot_fwd(x: jax.Array, w: jax.Array, dims: Any) -> tuple[jax.Array, tuple]:
        out, quantized = forward(x, w, dims)
        return out, (*quantized, w)

    def dot_bwd(dims: Any, residuals: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        xq, x_scale, wq, w_scale, w = residuals
        gq, g_scale = quantize(g, GRADIENT_DTYPE)
        x_grad = fp8_ops.dot_general_transpose_lhs(gq, xq, wq, dimension_numbers=dims, precision=None,
                                                   preferred_element_type=g.dtype)  # fmt: skip
        weight_grad = precision.weight_gradient(xq, gq, w.ndim, dims, None) * (x_scale * g_scale)
        return x_grad * (g_scale * w_scale).astype(g.dtype), precision.cotangent_like(weight_grad, w)

    dot.defvjp(dot_fwd, dot_bwd)
    return lambda x, w, dims, precision=None, **_: dot(x, w, dims)


class DelayedScalingDot(fp8_ops.Fp8DirectDotGeneralOp):
    """Flax's Fp8DirectDotGeneralOp (delayed scaling, its state in the OVERWRITE collection) for nn.DenseGeneral's
    `dot_general_cls`, the float32 kernel named `kernel_axes` first cast to the compute dtype on its shard
    (precision.compute_weight, as every projection's). The op computes its GEMMs' outputs and the input's and
    kernel's gradients in the compute dtype (the kernel's gradient then reaches the float32 kernel through the
    cast)."""

    config: ModelConfig | None = None
    kernel_axes: tuple[str | None, ...] = ()

    def __call__(self, x: jax.Array, w: jax.Array, dims: Any, **_: Any) -> jax.Array:
        return super().__call__(x, precision.compute_weight(self.config, w, self.kernel_axes), dims)


def delayed_dot_cls(cfg: ModelConfig, names: tuple[str | None, ...]) -> Callable[[], nn.Module]:
    """nn.DenseGeneral's `dot_general_cls` for a projection with delayed scaling (DelayedScalingDot)."""
    return functools.partial(DelayedScalingDot, config=cfg, kernel_axes=names, amax_history_length=cfg.fp8_amax_history)


def with_state(apply_fn: Callable[..., Any], fp8_meta: Any) -> Callable[..., Any]:
    """`apply_fn` (a model's apply) reading the delayed-scaling state `fp8_meta` beside the variables it is given:
    the loss functions pass {"params": ...} only."""
    return lambda variables, *args, **kwargs: apply_fn({**variables, OVERWRITE: fp8_meta}, *args, **kwargs)

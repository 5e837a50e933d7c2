"""FP8 matmuls for the projections: dynamic (current) tensorwise scaling, as torchtitan's Float8 runs it.

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

Delayed scaling (an amax history per tensor, Transformer Engine and MaxText's `quantization=fp8`) needs the
scales as state the step carries; it is not here (`model.fp8` allows "none" and "dynamic").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from jaxscale.config import finetune
from jaxscale.config.spec import ModelConfig
from jaxscale.model import precision

FORWARD_DTYPE = jnp.float8_e4m3fn  # inputs and weights: 3 mantissa bits, max 448
GRADIENT_DTYPE = jnp.float8_e5m2  # output gradients: 2 mantissa bits, max 57344


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

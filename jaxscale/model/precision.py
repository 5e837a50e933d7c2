"""Mixed precision of the weights: cast before FSDP gathers them, and the dtype their gradients are summed in.

Parameters are float32 and the model computes in `model.dtype` (bfloat16 by default). Real FSDP runs cast each
float32 shard to bf16 *before* all-gathering it and sum gradients over devices in float32 (PyTorch FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`; MaxText's float32 weights with bf16 compute).

- Every weight is cast while it is still split (a sharding constraint on the cast pins it to the parameter's
  own layout), so FSDP all-gathers the compute dtype. XLA's GPU compiler does this by itself too (it moves
  the cast before the gather even when the program gathers float32 first: checked on an H100 target); the
  CPU compiler converts bf16 collectives to float32 and gathers float32 whatever the order.
- `model.reduce_dtype`: under XLA's SPMD partitioner the sum of a weight's gradient over the devices that
  split the batch sits on the weight-gradient matmul (its contraction runs over the split batch), in that
  matmul's output dtype, so a bf16 matmul sums gradients in bf16. With "float32" every weight use below
  has a custom VJP whose weight-gradient matmul takes the compute-dtype activations and output gradient
  (tensor cores) and returns float32 (`preferred_element_type`), so XLA sums float32 (asserted in a GPU
  target's compiled HLO, tests/model/test_precision.py) while the matmul runs at the bf16 rate (a JVP with a
  float32 weight term, the first way this was done, transposed into a float32 matmul of upcast operands: a
  TF32 GEMM at half the rate). The forward pass and the activations' gradients keep the compute
  dtype. "compute": the weight gradient in the compute dtype, as Flax computes it by default.

The vectors (biases, norm scales, gpt's positions) are added or multiplied, not matmul'ed; their gradients
are sums over the batch in the compute dtype whichever the field (docs/mesh.md counts their bytes).
The train step applies `model.reduce_dtype` only where the batch is split over devices
(jaxscale.config.step_model); off a mesh the constraints are no-ops, and both values compute the same
function up to bf16 rounding (tests/model/test_precision.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.config.spec import ModelConfig
from jaxscale.model import nf4
from jaxscale.model.axes import constrain


def compute_weight(cfg: ModelConfig, w: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """The float32 weight `w` (logical axes `names`) in the compute dtype, cast on its shard before FSDP's gather."""
    return constrain(w.astype(cfg.dtype), names)


def _reduces_in_float32(cfg: ModelConfig) -> bool:
    return cfg.reduce_dtype == "float32" and jnp.dtype(cfg.dtype) != jnp.float32


def weight_dot_general(cfg: ModelConfig, names: tuple[str | None, ...]) -> Callable[..., jax.Array]:
    """A `dot_general` for nn.DenseGeneral (see `keep_kernel_dtype`): inputs [.., in] in the compute dtype,
    the float32 kernel named `names`; the output in the compute dtype, the kernel's gradient as
    `model.reduce_dtype` says."""

    def forward(x: jax.Array, w: jax.Array, dims: Any, precision: Any) -> jax.Array:
        return lax.dot_general(x, compute_weight(cfg, w, names), dims, precision=precision)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
    def dot(x: jax.Array, w: jax.Array, dims: Any, precision: Any) -> jax.Array:
        return forward(x, w, dims, precision)

    def dot_fwd(x: jax.Array, w: jax.Array, dims: Any, precision: Any) -> tuple[jax.Array, tuple]:
        return forward(x, w, dims, precision), (x, w)

    def dot_bwd(dims: Any, precision: Any, residuals: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, w = residuals
        w_compute = compute_weight(cfg, w, names)
        _, x_vjp = jax.vjp(lambda x_: lax.dot_general(x_, w_compute, dims, precision=precision), x)
        return x_vjp(g)[0], cotangent_like(weight_gradient(x, g, w.ndim, dims, precision), w)

    dot.defvjp(dot_fwd, dot_bwd)
    chosen = dot if _reduces_in_float32(cfg) else forward

    def apply(x: jax.Array, w: Any, dims: Any, precision: Any = None, **_: Any) -> jax.Array:
        if isinstance(w, nf4.Nf4Kernel):  # a 4-bit frozen kernel (QLoRA): dequantized here, at its use
            return nf4.dot_general(x, w, dims, precision)
        return chosen(x, w, dims, precision)

    return apply


def cotangent_like(grad: jax.Array, w: jax.Array) -> jax.Array:
    """A custom VJP's cotangent for the weight `w`, in `w`'s dtype, as JAX requires of a bwd rule.

    A trained weight is float32, so its float32 gradient is unchanged (no convert is emitted). A frozen weight
    (jaxscale.config.finetune, stored in finetune.frozen_dtype, bfloat16 by default) is a constant of the step:
    its cotangent is computed and dropped, and a float32 one would pass only through JAX's
    `_temporary_dtype_exception`, marked for removal. Cast to the weight's dtype it is the primal's type.

    Args:
      grad: the weight gradient (float32, from weight_gradient).
      w: the weight as the primal function received it.

    Returns:
      `grad` in `w`'s dtype.
    """
    return grad.astype(w.dtype)


def weight_gradient(x: jax.Array, g: jax.Array, w_ndim: int, dims: Any, precision: Any) -> jax.Array:
    """The gradient of `w` in `dot_general(x, w, dims)` from the output's cotangent `g`: one matmul of the
    compute-dtype `x` and `g` (tensor cores) with a float32 output, so the sum over the devices that split
    the batch, which XLA's partitioner puts on this matmul, runs in float32; laid out as `w`.

    `dims` as nn.DenseGeneral gives them: contracting dims, no batch dims. The cotangent's dims are x's free
    dims, then w's free dims, each in order.
    """
    (x_contract, w_contract), (x_batch, w_batch) = dims
    if x_batch or w_batch:
        raise ValueError(f"weight_gradient: batch dimensions {dims} are not a weight's (nn.DenseGeneral has none)")
    x_free = [a for a in range(x.ndim) if a not in x_contract]
    grad = lax.dot_general(x, g, ((x_free, list(range(len(x_free)))), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)  # fmt: skip
    # grad's axes: x's contracting axes in ascending order (each one of w's contracting axes), then w's free axes
    w_free = [a for a in range(w_ndim) if a not in w_contract]
    source = [w_contract[list(x_contract).index(a)] for a in sorted(x_contract)] + w_free
    return grad.transpose([source.index(axis) for axis in range(w_ndim)])


def keep_kernel_dtype(inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype: Any = None) -> list[Any]:
    """A `promote_dtype` for nn.DenseGeneral: inputs and bias to `dtype` (the layer's, the compute dtype), the
    kernel left float32 (weight_dot_general casts it on its shard)."""
    return [inputs.astype(dtype), kernel, None if bias is None else bias.astype(dtype)]


def lookup(cfg: ModelConfig, table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` [...] of the float32 token table [V, H] (named ("vocab", "embed")) in the compute dtype,
    [..., H]: the table cast on its shard and whole along embed at the lookup (so its output
    splits by batch like every activation); its gradient (a scatter-add over the batch) in float32 when
    `model.reduce_dtype` is float32."""

    def forward(table: jax.Array) -> jax.Array:
        table = compute_weight(cfg, table, ("vocab", "embed"))
        return jnp.take(constrain(table, ("vocab", None)), ids, axis=0)

    if not _reduces_in_float32(cfg):
        return forward(table)

    @jax.custom_jvp
    def take(table: jax.Array) -> jax.Array:
        return forward(table)

    @take.defjvp
    def take_jvp(primals, tangents):
        (table,), (table_dot,) = primals, tangents
        out = forward(table)
        return out, jnp.take(table_dot, ids, axis=0).astype(out.dtype)  # transposed: a float32 scatter-add

    return take(table)

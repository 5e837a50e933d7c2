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
  has a JVP whose weight term is a matmul with a float32 output (`preferred_element_type`): its transpose,
  the weight-gradient matmul, then yields float32 and XLA sums float32 (asserted in a GPU target's compiled
  HLO, tests/model/test_precision.py). The forward pass and the activations' gradients keep the compute
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

    @functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
    def dot(x: jax.Array, w: jax.Array, dims: Any, precision: Any) -> jax.Array:
        return forward(x, w, dims, precision)

    @dot.defjvp
    def dot_jvp(dims, precision, primals, tangents):
        (x, w), (x_dot, w_dot) = primals, tangents
        w_compute = compute_weight(cfg, w, names)
        out = lax.dot_general(x, w_compute, dims, precision=precision)
        # The weight term in float32: its transpose is the weight-gradient matmul, summed over devices in float32.
        w_term = lax.dot_general(x, w_dot, dims, precision=precision, preferred_element_type=jnp.float32)
        return out, lax.dot_general(x_dot, w_compute, dims, precision=precision) + w_term.astype(out.dtype)

    chosen = dot if _reduces_in_float32(cfg) else forward
    return lambda x, w, dims, precision=None, **_: chosen(x, w, dims, precision)


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

"""Weights stored in bfloat16 with no float32 master copy: how a float32 update lands on them.

A bf16 weight has 8 significant bits, so an update smaller than half its spacing (2^-8 of its magnitude) rounds
away when added to it with round-to-nearest: a small learning rate's steps are lost (Zamirai et al. 2020, "Revisiting
BFloat16 Training", arXiv 2010.06192). Three ways to add an update `u` (float32, the optimizer's output) to a weight
`w` (bf16):

- "nearest": bf16(w + u), round-to-nearest-even: what `optax.apply_updates` and PyTorch's in-place add do to a bf16
  tensor; the steps below half a spacing vanish.
- "stochastic": w + u rounded up or down at random with the probabilities that make it unbiased (its expectation is
  w + u): the float32 sum's low 16 bits compared with 16 random bits (torchao's `_fp32_to_bf16_sr`, used by its
  `bf16_stochastic_round` optimizers; optimi's and Zamirai et al.'s alternative). Random bits from the step's key.
- "kahan": compensated summation with a bf16 buffer `c` per weight: y = c + u; w' = bf16(w + y); c' = bf16(y - (w' -
  w)): what rounding lost this step is added to the next (Kahan 1965; optimi's `kahan_sum`, TorchDistX's
  AnyPrecisionAdamW, after Zamirai et al.). 2 more bytes a weight.
- "master": a float32 master copy `m` of each weight beside the bf16 one: m' = m + u; w' = bf16(m') (Micikevicius
  et al. 2018, "Mixed Precision Training", arXiv 1710.03740; Megatron-Core's distributed optimizer keeps its float32
  "main params" so). 4 more bytes a weight; the buffers are laid out like the optimizer state (split over the state
  axes at every ZeRO stage, jaxscale.train.sharding), so with ZeRO-1 the weights are bf16 and whole and their float32
  copy is split, Megatron's layout. The weights the model reads are then the master copy rounded to nearest, and no
  update is lost.

All arithmetic is float32; what is stored is bf16 but for the master copy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxscale.config.defaults import BF16_ROUNDINGS as ROUNDINGS


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
    """`x` (float32) to bfloat16, rounded away from zero with probability (its low 16 bits) / 2^16 and towards zero
    otherwise: unbiased, E[result] = x (for finite x; the bit pattern's carry moves it to the next binade)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    random = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)
    truncated = bits & jnp.uint32(0xFFFF0000)
    rounded = jnp.where(random < (bits & jnp.uint32(0xFFFF)), truncated + jnp.uint32(0x10000), truncated)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)  # exact: the low bits are 0


def kahan_add(weight: jax.Array, update: jax.Array, compensation: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weight + update, its new compensation), compensated: the update plus what earlier roundings lost is added,
    and what this rounding loses is kept in `compensation` (both bf16; arithmetic in float32)."""
    before = weight.astype(jnp.float32)
    step = compensation.astype(jnp.float32) + update.astype(jnp.float32)
    after = (before + step).astype(weight.dtype)
    return after, (step - (after.astype(jnp.float32) - before)).astype(compensation.dtype)


def apply_updates(params: Any, updates: Any, rounding: str, key: jax.Array, compensation: Any = None) -> tuple:
    """`params` (bf16 leaves, or float32 ones left to `optax.apply_updates`' arithmetic) plus the optimizer's
    `updates`, each added by `rounding` (ROUNDINGS); (new params, new compensation: the kahan buffers, else None).

    Args:
      params, updates: trees of the same structure.
      rounding: "nearest", "stochastic" (each leaf its own random bits, from `key`), "kahan" (`compensation`: a
        tree of bf16 buffers like params) or "master" (`compensation`: the float32 master copies).
      key: the step's key (stochastic only).
      compensation: kahan's buffers or the master copies (init_compensation), None otherwise.
    """
    leaves, tree = jax.tree_util.tree_flatten(params)
    steps = tree.flatten_up_to(updates)
    if rounding == "kahan":
        pairs = [kahan_add(w, u, c) for w, u, c in zip(leaves, steps, tree.flatten_up_to(compensation), strict=True)]
        return tree.unflatten([p for p, _ in pairs]), tree.unflatten([c for _, c in pairs])
    if rounding == "master":
        masters = [m + u.astype(m.dtype) for m, u in zip(tree.flatten_up_to(compensation), steps, strict=True)]
        weights = [m.astype(w.dtype) for w, m in zip(leaves, masters, strict=True)]
        return tree.unflatten(weights), tree.unflatten(masters)
    if rounding == "stochastic":
        keys = jax.random.split(key, len(leaves))
        new = [stochastic_round(w.astype(jnp.float32) + u.astype(jnp.float32), k) if w.dtype == jnp.bfloat16
               else (w + u).astype(w.dtype) for w, u, k in zip(leaves, steps, keys, strict=True)]  # fmt: skip
        return tree.unflatten(new), None
    if rounding == "nearest":
        new = [(w.astype(jnp.float32) + u.astype(jnp.float32)).astype(w.dtype)
               for w, u in zip(leaves, steps, strict=True)]  # fmt: skip
        return tree.unflatten(new), None
    raise ValueError(f"optimizer.bf16_rounding: unknown {rounding!r}; allowed: {', '.join(ROUNDINGS)}")


def init_compensation(params: Any, rounding: str = "kahan") -> Any:
    """The buffers `rounding` keeps beside the bf16 weights, made from the float32 initial `params`: Kahan's, zeros
    like each weight in bf16; the master copies, the float32 weights themselves; none ({}) otherwise."""
    if rounding == "kahan":
        return jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, jnp.bfloat16), params)
    if rounding == "master":
        return jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    return {}


def optimizer_step(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    rounding: str,
    key: jax.Array,
    compensation: Any = None,
) -> tuple[Any, Any, Any]:
    """One optimizer step on `params`: (new params, new optimizer state, new compensation), the one place both train
    steps (the whole model's, jaxscale.train.step; a layer's in the backward pass, jaxscale.train.fused_step) take it.

    Float32 weights (`rounding` ""): optax's update, then params + updates (flax's TrainState.apply_gradients). bf16
    weights without a master copy: the gradients in float32 into the optimizer (whose state was made for float32
    params), and its float32 update added to the bf16 weights by `rounding` (apply_updates; the stochastic rounding's
    bits from `key`, Kahan's buffers or the master copies `compensation`); compensation comes back None unless kahan
    or master.
    """
    if not rounding:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, None
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params, compensation = apply_updates(params, updates, rounding, key, compensation)
    return params, opt_state, compensation

"""Pipeline parallelism: the scanned layer stack split into stages over the mesh axis "stage", microbatches streamed
through the stages inside the one jitted step (GPipe; circular with `repeats` visits of each stage).

The layout follows MaxText's `layers/pipeline.py` (and Praxis's `LayerwiseShardablePipelined`): the stages are one
`jax.vmap` over a leading stage dimension (`spmd_axis_name="stage"`, so every sharding constraint inside a layer keeps
that dimension on the stage axis), the loop over iterations is a `lax.scan`, and the hand-off from stage s to s + 1 is
a rotation of the stage dimension, which JAX's SPMD partitioner lowers to a collective-permute on the stage axis. No
collective is written here; the partitioner places them (the compiled program is what docs/mesh.md counts).

Schedule (the loop's iterations): with p stages, m microbatches and v repeats, microbatch-visit k = r·m + j (repeat r
of microbatch j) enters stage 0 at iteration k and stage s at iteration k + s, so the loop runs v·m + p - 1
iterations and every stage idles (computes on nothing that is kept) in p - 1 of them: the bubble (p - 1)/(v·m + p - 1)
of the step's layer work. GPipe is v = 1. Circular (v > 1) needs m >= p: the last stage's output of repeat r feeds
stage 0's repeat r + 1 m - p + 1 iterations later. With n = L/(p·v) layers a visit, layer l = r·p·n + s·n + i of the
model (its one-device order) is layer i of stage s in visit r: the stack's [L, ...] parameters are taken as
[v, p, n, ...] (`stage_layout`), so every microbatch meets the layers in the model's order and the pipelined step
computes the function one device computes. GPipe's stage s holds layers s·n to s·n + n - 1, a contiguous block of the
stack, which is the layout the parameters already have (the "layers" axis split over "stage"); the circular schedule's
stage holds v blocks spread through the stack, so its parameters move once a step (an all-to-all of the weights and
of their gradients, in the compiled program).

The rows of the minibatch go to microbatch j as rows j, j + m, j + 2m, ... (a reshape [B/m, m] of the rows, whose
first dimension keeps the data-parallel split), and come back in their places; the loss is a sum over rows.

Autodiff of the loop keeps every iteration's residuals (GPipe in one program holds every microbatch in flight); a
remat policy on the blocks (model.remat) shrinks what each keeps, as on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.model.axes import constrain

STAGE_AXIS = "stage"  # the mesh axis (and the logical name of the stage dimension: jaxscale.config.layout_rules)
STREAM = ("batch", "stream_seq", "embed")  # a microbatch's activations between layers


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline's loop: `stages` p, `microbatches` m streamed per minibatch, `repeats` v visits of each stage."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def iterations(self) -> int:
        """Iterations of the loop: v·m + p - 1 (each stage computes in all of them, usefully in v·m)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of the stages' layer work that is idle: (p - 1) / (v·m + p - 1)."""
        return (self.stages - 1) / self.iterations

    @property
    def name(self) -> str:
        """The schedule's name: "gpipe" (one visit of each stage) or "circular"."""
        return "gpipe" if self.repeats == 1 else "circular"


def stage_layout(stacked: Any, schedule: Schedule, names: Any | None = None) -> Any:
    """The stack's parameters [L, ...] as [p, v, n, ...]: stage s's n layers of each of its v visits (layer
    r·p·n + s·n + i at [s, r, i]), the stage dimension on the stage axis.

    Args:
      stacked: a tree of [L, ...] arrays (nn.scan's stacked parameters).
      schedule: the pipeline's schedule.
      names: the same tree's per-layer logical names (without "layers"), or None: then only the stage dimension is
        constrained.

    Returns:
      The tree of [p, v, n, ...] arrays.
    """
    p, v = schedule.stages, schedule.repeats

    def relayout(x: jax.Array, leaf_names: tuple | None) -> jax.Array:
        n = x.shape[0] // (p * v)
        x = jnp.swapaxes(x.reshape(v, p, n, *x.shape[1:]), 0, 1)  # [p, v, n, ...]
        tail = (None,) * (x.ndim - 3) if leaf_names is None else tuple(leaf_names)
        return constrain(x, (STAGE_AXIS, None, None, *tail))

    if names is None:
        return jax.tree_util.tree_map(lambda x: relayout(x, None), stacked)
    is_names = lambda x: isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)  # noqa: E731
    return jax.tree_util.tree_map(lambda n, x: relayout(x, n), names, stacked, is_leaf=is_names)


def run(layer: Callable[[Any, jax.Array], jax.Array], staged: Any, x: jax.Array, schedule: Schedule) -> jax.Array:
    """x [B, T, H] through every layer of the stack, pipelined: the function `layer` applied L times in order.

    Args:
      layer: (one layer's parameters, activations [b, T, H]) -> activations [b, T, H].
      staged: the stack's parameters in `stage_layout`, [p, v, n, ...].
      x: the stack's input [B, T, H], B divisible by the schedule's microbatches.
      schedule: stages, microbatches, repeats.

    Returns:
      The stack's output [B, T, H].
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    batch, rest = x.shape[0], x.shape[1:]
    # microbatch j: rows j, j + m, ... ([B/m, m] keeps the rows' data-parallel split on its first dimension)
    micro = jnp.swapaxes(x.reshape(batch // m, m, *rest), 0, 1)  # [m, B/m, T, H]
    micro = constrain(micro, (None, *STREAM))
    stage_ids = jnp.arange(p)

    def one_stage(params: Any, h: jax.Array, repeat: jax.Array) -> jax.Array:  # params [v, n, ...], h [b, T, H]
        visit = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), params)

        def body(carry: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:
            return layer(layer_params, carry), None

        return jax.lax.scan(body, h, visit)[0]

    stages = jax.vmap(one_stage, spmd_axis_name=STAGE_AXIS)

    def iteration(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        outputs, done = carry  # outputs [p, b, T, H]: each stage's last; done [m, b, T, H]: the last stage's
        j0 = t % m  # stage 0 takes microbatch-visit t: fresh input in repeat 0, the last stage's output after
        first = jnp.where(t < m, micro[j0], done[j0])
        shifted = jnp.concatenate([outputs[-1:], outputs[:-1]], axis=0)  # stage s - 1's output to stage s
        inputs = jnp.where((stage_ids == 0).reshape(p, *(1,) * len(first.shape)), first[None], shifted)
        inputs = constrain(inputs, (STAGE_AXIS, *STREAM))
        repeat = jnp.clip((t - stage_ids) // m, 0, v - 1)  # each stage's visit this iteration
        outputs = constrain(stages(staged, inputs, repeat), (STAGE_AXIS, *STREAM))
        k = t - (p - 1)  # the visit the last stage finished
        valid = (k >= 0) & (k < v * m)
        j = jnp.clip(k, 0, v * m - 1) % m
        kept = jnp.where(valid, outputs[-1], done[j])
        done = constrain(jax.lax.dynamic_update_index_in_dim(done, kept, j, 0), (None, *STREAM))
        return (outputs, done), None

    start = (constrain(jnp.zeros((p, *micro.shape[1:]), x.dtype), (STAGE_AXIS, *STREAM)), jnp.zeros_like(micro))
    (_, done), _ = jax.lax.scan(iteration, start, jnp.arange(schedule.iterations))
    return jnp.swapaxes(done, 0, 1).reshape(batch, *rest)  # rows back in their places

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
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config.layout_rules import STATE_AXES, mesh_axes, without
from jaxscale.model.axes import constrain, mesh_axis_size

STAGE_AXIS = "stage"  # the mesh axis (and the logical name of the stage dimension: jaxscale.config.layout_rules)
STREAM = ("batch", "stream_seq", "embed")  # a microbatch's activations between layers
FINISHED = (None, "batch", "stage_seq", "embed")  # the finished microbatches [m, b, T, H]: positions over the stages
# the logical names that keep the stage axis inside the loop: the stacked layers, the stage dimension, the finished
PIPELINE_NAMES = ("layers", STAGE_AXIS, "stage_seq")


def inner_rules(rules: tuple) -> tuple:
    """The logical rules inside the pipeline's loop: `rules` with the stage axis taken out of every name but
    PIPELINE_NAMES. Outside the loop the embedding, the head and the loss split their positions over the stages
    (jaxscale.config.layout_rules: "seq" and "stream_seq"), so that every stage does 1/p of their work; inside, a
    stage's activations are whole on the stage axis (its one dimension is the stages').

    Args:
      rules: a logical-to-mesh rules table (the one in context).

    Returns:
      The table for the loop.
    """

    return tuple((name, mapped if name in PIPELINE_NAMES else without(mapped, (STAGE_AXIS,))) for name, mapped in rules)


def gathered_rules(rules: tuple) -> tuple:
    """`rules` with the model state's axes (layout_rules.STATE_AXES) taken out of "embed": the weights whole over them,
    as FSDP gathers them; inside the pipeline (mesh.pipeline_gather_once), so a stage's weights are gathered once a
    pass and their gradients reduce-scattered once, and the pipeline's per-device groups (`device_groups`) take every
    axis that splits the batch.

    Args:
      rules: a logical-to-mesh rules table (the loop's, `inner_rules`).

    Returns:
      The table with "embed" whole on the state axes.
    """
    return tuple((name, without(mapped, STATE_AXES) if name == "embed" else mapped) for name, mapped in rules)


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
        tail = (None,) * (x.ndim - 1) if leaf_names is None else tuple(leaf_names)
        if v > 1 and mesh_axis_size(STAGE_AXIS) == p:
            x = stage_major(x, p, v, tuple(nn.logical_to_mesh_axes(("layers", *tail)))[1:])
        else:  # GPipe: a reshape of each stage's own block; without a mesh, the same order
            x = jnp.swapaxes(x.reshape(v, p, n, *x.shape[1:]), 0, 1)  # [p, v, n, ...]
        return constrain(x, (STAGE_AXIS, None, None, *tail))

    if names is None:
        return jax.tree_util.tree_map(lambda x: relayout(x, None), stacked)
    return jax.tree_util.tree_map(lambda n, x: relayout(x, n), names, stacked, is_leaf=is_names)


def stage_major(x: jax.Array, p: int, v: int, tail: tuple) -> jax.Array:
    """[L, ...] split over the stage axis in contiguous blocks (device d: layers d·v·n to (d+1)·v·n - 1) -> the circular
    schedule's [p, v, n, ...] (device s: layers r·p·n + s·n + i), by one all-to-all over the stage axis.

    Device d's block r' (of v) holds layers q·n to q·n + n - 1 with q = d·v + r', which stage s = q mod p needs as its
    visit r = q div p. Each device sends every other ceil(v/p) slots of blocks (zeros where it has fewer for that stage)
    in a `jax.lax.all_to_all` inside a `jax.shard_map` over every mesh axis (each device its own shard of the other
    dimensions, `tail`'s layout), and each stage takes its v blocks from what it received: the weights cross the links
    once, where the partitioner's own reshape of the sharded [L] into [v, p, n] all-gathered every stage's weights onto
    every device.

    Args:
      x: [L, ...], L = p·v·n, its first dimension split over the stage axis.
      p: stages (the stage axis's size in the mesh in context).
      v: visits of each stage.
      tail: the mesh axes of x's other dimensions (a PartitionSpec's entries), kept.

    Returns:
      [p, v, n, ...], its first dimension split over the stage axis.
    """
    n, k = x.shape[0] // (p * v), -(-v // p)  # layers a block; slots a device sends each stage

    def local(block: jax.Array) -> jax.Array:  # [v·n, ...] -> [1, v, n, ...]
        d = jax.lax.axis_index(STAGE_AXIS)
        blocks = block.reshape(v, n, *block.shape[1:])  # [v, n, ...]: r' = q - d·v
        first = (jnp.arange(p) - d * v) % p  # [p]: the first of d's blocks that stage s needs
        wanted = first[:, None] + p * jnp.arange(k)[None, :]  # [p, k]: d's blocks for s, every p-th
        sent = jnp.take(blocks, jnp.minimum(wanted, v - 1), axis=0)  # [p, k, n, ...]
        sent = jnp.where((wanted < v).reshape(p, k, *(1,) * (blocks.ndim - 1)), sent, 0)
        got = jax.lax.all_to_all(sent, STAGE_AXIS, 0, 0, tiled=True)  # [p (sender), k, n, ...]
        q = jnp.arange(v) * p + d  # [v]: this stage's visit r holds blocks q = r·p + s
        source = q // v
        slot = (q % v - (d - source * v) % p) // p
        return got[source, slot][None]  # [1, v, n, ...]

    spec, out = jax.sharding.PartitionSpec(STAGE_AXIS, *tail), jax.sharding.PartitionSpec(STAGE_AXIS, None, None, *tail)
    return jax.shard_map(local, in_specs=spec, out_specs=out, check_vma=False)(x)


def is_names(x: Any) -> bool:
    """Whether a leaf of a names tree: a tuple of logical axis names (None for an unnamed dimension)."""
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


LAYER_INPUT = "pipeline_layer_input"
# The circular schedule's weights for an iteration are picked from the stage's visits by the iteration's index
# (visit_params): a value of every iteration, which the loop's backward pass would keep, a copy of the stage's visit
# weights an iteration (the Llama 3.1 8B plan of 4 stages x 2 visits and 8 microbatches was 70.6 GiB against GPipe's
# 30.6). Where its layers keep only their inputs (Block remat with nothing saved, `run`'s recompute_weights), an
# iteration keeps the layers' inputs, by name, and the backward pass picks the weights again (a slice and a select):
# the same matmuls, none of the copies. GPipe's weights do not depend on the iteration (kept once, outside the loop).
VISIT_POLICY = jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)


def visit_params(staged: Any, t: jax.Array, schedule: Schedule) -> Any:
    """Each stage's parameters for its visit at iteration t: [p, v, n, ...] -> [p, n, ...], stage s's visit
    (t - s) div m (clipped to the visits there are).

    GPipe (v = 1) takes the one visit. Circular: a per-stage index under the stages' vmap would be a gather, which
    XLA's partitioner serves by gathering every stage's weights onto every device; but with m >= p the stages of one
    iteration are on two visits at most, t div m and the one before, so both are taken with one index for all stages
    (a slice of each device's own block) and each stage selects its own (an elementwise select, on its device).
    """
    if schedule.repeats == 1:
        return jax.tree_util.tree_map(lambda a: a[:, 0], staged)
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    later = jnp.clip(t // m, 0, v - 1)
    earlier = jnp.clip(t // m - 1, 0, v - 1)
    on_later = (t - jnp.arange(p)) // m >= t // m  # [p]: stage s is on visit t div m

    def pick(a: jax.Array) -> jax.Array:
        late, early = (jax.lax.dynamic_index_in_dim(a, r, 1, keepdims=False) for r in (later, earlier))
        return jnp.where(on_later.reshape(p, *(1,) * (late.ndim - 1)), late, early)

    return jax.tree_util.tree_map(pick, staged)


def run(
    layer: Callable[[Any, jax.Array], jax.Array],
    staged: Any,
    x: jax.Array,
    schedule: Schedule,
    groups: Groups | None = None,
    names: Any | None = None,
    recompute_weights: bool = True,
) -> jax.Array:
    """x [B, T, H] through every layer of the stack, pipelined: the function `layer` applied L times in order.

    Args:
      layer: (one layer's parameters, activations [b, T, H]) -> activations [b, T, H].
      staged: the stack's parameters in `stage_layout`, [p, v, n, ...].
      x: the stack's input [B, T, H], B divisible by the schedule's microbatches.
      schedule: stages, microbatches, repeats.
      groups: the devices that split the batch, each device's rows run as a group of their own (`Groups`), so
        that the weight gradients the loop accumulates stay on their device until the loop ends; None: the rows
        as one batch (the partitioner reduces each iteration's weight gradients over the devices that split it).
      names: the stack's per-layer logical names (`stage_layout`'s), which lay out each group's weights (and so
        their gradients) as the stage's own; None: only the group and stage dimensions are constrained.
      recompute_weights: the circular schedule's per-iteration weights picked again in the backward pass rather
        than kept (VISIT_POLICY), for layers that keep only their inputs (`layer` under Block remat saving nothing);
        where a layer keeps more (no remat, a policy that saves), keeping only its inputs would recompute its forward
        pass, so the weights are kept, a copy an iteration.

    Returns:
      The stack's output [B, T, H].
    """
    if groups is None:
        return _loop(layer, staged, x, schedule, recompute_weights)
    batch, rest = x.shape[0], x.shape[1:]
    # [B, ...] -> [count, B / count, ...]: group g holds the rows of the g-th batch-splitting device
    rows = constrain(x.reshape(groups.count, batch // groups.count, *rest), ("batch", None, *STREAM[1:]))

    # every group's own reference to the (whole on the batch axes) weights: no copy, each device holds its own
    def own(w: jax.Array, leaf_names: tuple | None) -> jax.Array:  # [count, p, v, n, ...]: the group axis on the
        w = jnp.broadcast_to(w, (groups.count, *w.shape))  # batch axes, the rest laid out as the stage's own
        if leaf_names is not None:  # (unnamed, XLA lays the gradients out whole over the tensor axis: 2x the bytes)
            return constrain(w, ("batch", STAGE_AXIS, None, None, *leaf_names))
        free = (jax.sharding.PartitionSpec.UNCONSTRAINED,) * (w.ndim - 2)
        return jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec(groups.axes, STAGE_AXIS, *free))

    if names is None:
        weights = jax.tree_util.tree_map(lambda w: own(w, None), staged)
    else:
        weights = jax.tree_util.tree_map(lambda n, w: own(w, n), names, staged, is_leaf=is_names)
    loop = functools.partial(_loop, layer, schedule=schedule, recompute_weights=recompute_weights)
    per_group = jax.vmap(loop, spmd_axis_name=groups.axes)
    with nn.logical_axis_rules(groups.rules):
        out = per_group(weights, rows)
    return out.reshape(batch, *rest)


@dataclasses.dataclass(frozen=True)
class Groups:
    """The pipeline's rows taken per batch-splitting device (`run`): the mesh `axes` the batch splits over, their
    device `count`, and the logical rules inside a group (the batch axes removed: a group is one device's rows)."""

    axes: tuple[str, ...]
    count: int
    rules: tuple


def device_groups() -> Groups | None:
    """The Groups of the rules and mesh in context, where the weights are whole on every axis that splits the batch
    (data parallelism, ZeRO-1/2's whole parameters; not FSDP's split ones, which are gathered and their gradients
    reduce-scattered each iteration, as FSDP does each microbatch) and that split is over more than one device; else
    None (one device, the step's own per-device groups already, or FSDP)."""
    rules = tuple(nn.get_logical_axis_rules())
    axes = tuple(a for a in mesh_axes("batch", rules) if mesh_axis_size(a) > 1)
    if not axes or set(axes) & set(mesh_axes("embed", rules)):
        return None
    inner = tuple((name, without(mapped, axes)) for name, mapped in rules)
    return Groups(axes, math.prod(mesh_axis_size(a) for a in axes), inner)


def _loop(
    layer: Callable[[Any, jax.Array], jax.Array], staged: Any, x: jax.Array, schedule: Schedule,
    recompute_weights: bool = True,
) -> jax.Array:
    """`run` of one batch of rows: the schedule's loop."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    batch, rest = x.shape[0], x.shape[1:]
    # microbatch j: rows j, j + m, ... ([B/m, m] keeps the rows' data-parallel split on its first dimension)
    micro = jnp.swapaxes(x.reshape(batch // m, m, *rest), 0, 1)  # [m, B/m, T, H]
    micro = constrain(micro, (None, *STREAM))
    stage_ids = jnp.arange(p)

    def one_stage(params: Any, h: jax.Array) -> jax.Array:  # params [n, ...], h [b, T, H]
        def body(carry: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:
            return layer(layer_params, checkpoint_name(carry, LAYER_INPUT)), None

        return jax.lax.scan(body, h, params)[0]

    stages = jax.vmap(one_stage, spmd_axis_name=STAGE_AXIS)

    def visit(staged: Any, t: jax.Array, inputs: jax.Array) -> jax.Array:
        return stages(visit_params(staged, t, schedule), inputs)

    if v > 1 and recompute_weights:  # circular: the iteration's picked weights picked again, not kept (VISIT_POLICY)
        visit = jax.checkpoint(visit, policy=VISIT_POLICY, prevent_cse=False)

    def iteration(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        outputs, done = carry  # outputs [p, b, T, H]: each stage's last; done [m, b, T, H]: the last stage's
        j0 = t % m  # stage 0 takes microbatch-visit t: fresh input in repeat 0, the last stage's output after
        first = micro[j0] if v == 1 else jnp.where(t < m, micro[j0], done[j0])
        shifted = jnp.concatenate([outputs[-1:], outputs[:-1]], axis=0)  # stage s - 1's output to stage s
        inputs = jnp.where((stage_ids == 0).reshape(p, *(1,) * len(first.shape)), first[None], shifted)
        inputs = constrain(inputs, (STAGE_AXIS, *STREAM))
        outputs = constrain(visit(staged, t, inputs), (STAGE_AXIS, *STREAM))
        k = t - (p - 1)  # the visit the last stage finished
        valid = (k >= 0) & (k < v * m)
        j = jnp.clip(k, 0, v * m - 1) % m
        kept = jnp.where(valid, outputs[-1], done[j])
        done = constrain(jax.lax.dynamic_update_index_in_dim(done, kept, j, 0), FINISHED)
        return (outputs, done), None

    start = (constrain(jnp.zeros((p, *micro.shape[1:]), x.dtype), (STAGE_AXIS, *STREAM)),
             constrain(jnp.zeros_like(micro), FINISHED))  # fmt: skip
    (_, done), _ = jax.lax.scan(iteration, start, jnp.arange(schedule.iterations))
    return jnp.swapaxes(done, 0, 1).reshape(batch, *rest)  # rows back in their places

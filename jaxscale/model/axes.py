"""Logical axis names for every family: the boxes parameters carry, the constraints activations carry.

Every parameter carries logical axis names (Flax's logical partitioning) and the activations between the
sharded matmuls carry logical constraints (`nn.with_logical_constraint`). The names follow the lab's
conventions (vocab, embed, pos, heads, kv_heads, head_dim, qkv, mlp, layers; batch and seq for activations);
the one table that maps them to mesh axes is `jaxscale.config.layout_rules.RULES`. Without those rules in context
(the default 1x1x1 mesh) the constraints are no-ops, and `jaxscale.train` unboxes the initial parameters, so
the param tree and its values are those of an unannotated model.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax

Initializer = Callable[..., jax.Array]


class LogicalAxes(nn.LogicallyPartitioned):
    """Flax's logical-partitioning box (what `nn.with_logical_partitioning` returns) whose unboxing adds no
    sharding constraint.

    The names are read by jaxscale.train.sharding (`nn.get_partition_spec`) to build the step's in/out
    shardings, and nn.scan prepends "layers" to them. Flax's own box would also constrain the value when it
    is unboxed with a mesh in context, and with Flax 0.12 DenseGeneral unboxes its kernel while it is still
    flat (kernel_init_wrap, and again in every apply's parameter-shape check), which a rank-3 name tuple
    cannot constrain; the layout needs no constraint there, the step's in_shardings already place the state.
    """

    def unbox(self, apply_constraint: bool = True) -> jax.Array:
        return self.value


def partitioned(init: Initializer, names: tuple[str, ...]) -> Initializer:
    """`init` whose parameter carries the logical axis names `names`, one per dimension."""

    def init_with_names(*args, **kwargs) -> LogicalAxes:
        return LogicalAxes(init(*args, **kwargs), names)

    return init_with_names


def mesh_axis_size(name: str) -> int:
    """The size of mesh axis `name` in the mesh in context (jax.set_mesh); 1 without a mesh or that axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return int(mesh.shape[name])


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """A logical sharding constraint on an activation; a no-op unless a mesh's rules are active."""
    return nn.with_logical_constraint(x, names)


# The vmap axis name under which the train step takes each batch-splitting device's rows as its own group
# (jaxscale.train.step's per-device accumulation), while it traces; None elsewhere.
_DEVICE_GROUPS: contextvars.ContextVar[str | None] = contextvars.ContextVar("device_groups", default=None)


@contextlib.contextmanager
def device_groups(axis_name: str) -> Iterator[None]:
    """Inside: the model is traced per device group, batched by `jax.vmap(..., axis_name=axis_name)` (each device's
    rows of a minibatch one group), so a statistic of every row of the minibatch is a mean over that axis
    (`mean_over_device_groups`)."""
    token = _DEVICE_GROUPS.set(axis_name)
    try:
        yield
    finally:
        _DEVICE_GROUPS.reset(token)


def mean_over_device_groups(x: jax.Array) -> jax.Array:
    """`x` averaged over the device groups in context (`device_groups`: a pmean, an all-reduce over the devices that
    split the batch); `x` itself outside them, where the program already sees every row."""
    axis = _DEVICE_GROUPS.get()
    return x if axis is None else jax.lax.pmean(x, axis)


def batch_devices() -> int:
    """Devices the logical "batch" axis is split over by the rules and mesh in context: 1 without them, and inside
    the step's device groups (whose rules split nothing by batch: the group axis is split instead)."""
    if jax.sharding.get_abstract_mesh().empty:
        return 1
    entry = nn.logical_to_mesh_axes(("batch",))[0]
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh_axis_size(name) for name in names)

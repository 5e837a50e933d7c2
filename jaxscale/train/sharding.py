"""The device mesh, and the shardings the one rules table gives the train step's state, batch and gradients.

The model names every parameter's axes (`nn.with_logical_partitioning`) and constrains the activations
between its sharded matmuls (`nn.with_logical_constraint`); `RULES` (jaxscale.config.layout_rules, re-exported
here) is the only place that says which mesh axis splits which name, read by the analytic models too. From the
table and the mesh sizes (`config.mesh`) come the layouts:

- data parallel (`mesh.data`): the batch is split, every parameter is replicated, gradients are all-reduced;
- FSDP / ZeRO-3 (`mesh.fsdp`): parameters, gradients and optimizer state are split along their `embed`
  axis, the batch along `data` x `fsdp`; XLA all-gathers a weight before its use and reduce-scatters its
  gradient;
- tensor parallel, Megatron-style (`mesh.tensor`): the QKV and attention-output projections split by heads,
  the MLP by its width, the embedding and output head by vocabulary; activations between the two matmuls
  of a block are split, the residual stream is replicated over `tensor` (an all-reduce after each block
  half, Shoeybi et al. 2019);
- expert parallel (`mesh.expert`, a mixture of experts): the routed experts split along their `expert` axis,
  the batch along `data` x `fsdp` x `expert`; the capacity dispatch's tokens go to the devices of their experts
  and back by all-to-all (GShard, Lepikhin et al. 2020; jaxscale.model.moe). Every other parameter, its gradient
  and optimizer state are split along `embed` over the expert axis too, with fsdp and context (the state axes), as
  FSDP splits them.

JAX's SPMD partitioner does the rest: the train step is jitted with the state's and batch's shardings as
in/out shardings (`Layout`), and tracing happens with the rules and the mesh in context
(`Layout.activate`), which turns the model's logical constraints into sharding constraints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.config import (
    MESH_AXES,
    accumulates_locally,
    check_mesh_devices,
    mesh_shape,
)
from jaxscale.config.layout_rules import RULES, gradient_rules, rules, without  # the rules table: its one home
from jaxscale.measure.params import removed_axis
from jaxscale.model import nf4
from jaxscale.train import fused_step, offload, quantized_state
from jaxscale.train.step import (
    Batch,
    LocalAccumulation,
    TrainState,
    init_metrics,
    make_init_fn,
    make_loss_fn,
    make_train_step,
    model_params,
    step_options,
    train_step,
)
from jaxscale.train.step import abstract_inputs as unsharded_inputs

BATCH_AXES = ("batch", "seq")  # a token batch [batch, seq]: rows over data x fsdp x expert, positions over context


def logical_specs(tree: Any) -> Any:
    """PartitionSpecs of logical names for a tree holding Flax's LogicallyPartitioned boxes and NF4 kernels (their
    arrays by the names of their stacked dims: jaxscale.model.nf4), P() elsewhere."""

    def spec(x: Any) -> Any:
        if isinstance(x, nf4.Nf4Weight):
            return x.partition_specs()
        if isinstance(x, nn.Partitioned):
            return x.get_partition_spec()
        return PartitionSpec() if hasattr(x, "shape") else None

    boxed = lambda x: isinstance(x, (nn.Partitioned, nf4.Nf4Weight))  # noqa: E731
    return jax.tree_util.tree_map(spec, tree, is_leaf=boxed)


def _moment_spec(leaf_shape: tuple[int, ...], param_shape: tuple[int, ...], names: PartitionSpec) -> PartitionSpec:
    """The logical names of an optimizer-state leaf kept for a parameter of `param_shape` named `names`.

    A moment of the parameter's shape (Adam's mu and nu, SGD's trace, Adafactor's unfactored v) takes its
    names; one with an axis reduced away (Adafactor's factored row and column statistics) the names of the
    axes it keeps; anything else (Adafactor's 1-element placeholders) is replicated.
    """
    if tuple(leaf_shape) == tuple(param_shape):
        return names
    axis = removed_axis(leaf_shape, param_shape)
    return PartitionSpec() if axis is None else PartitionSpec(*(n for i, n in enumerate(names) if i != axis))


def state_specs(state: Any, param_names: Any) -> Any:
    """Logical PartitionSpecs for every leaf of a TrainState (abstract or real, unboxed).

    The parameters take their own names; every optimizer-state leaf that sits under a copy of the parameter
    tree (the state of any optax optimizer: a parameter's path is a suffix of the leaf's path) takes the
    names of its parameter (`_moment_spec`), and an 8-bit moment's codes and absmax theirs
    (jaxscale.train.quantized_state.moment_specs: the codes the parameter's); the rest (step counters, the
    dropout key) is replicated.

    Args:
      state: the train step's state.
      param_names: the parameters' logical PartitionSpecs (a tree like state.params).
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    names = dict(jax.tree_util.tree_flatten_with_path(param_names, is_leaf=is_spec)[0])
    shapes = dict(jax.tree_util.tree_flatten_with_path(model_params(state.params, state.frozen))[0])

    def spec(path: tuple, leaf: Any) -> Any:
        for start in range(len(path)):
            suffix = tuple(path[start:])
            if suffix in names:
                if isinstance(leaf, quantized_state.QuantizedMoment):
                    return quantized_state.moment_specs(leaf, shapes[suffix].shape, names[suffix])
                return _moment_spec(leaf.shape, shapes[suffix].shape, names[suffix])
        if isinstance(leaf, quantized_state.QuantizedMoment):  # not under a copy of the parameter tree
            return quantized_state.QuantizedMoment(PartitionSpec(), PartitionSpec())
        return PartitionSpec()

    is_moment = lambda x: isinstance(x, quantized_state.QuantizedMoment)  # noqa: E731
    return jax.tree_util.tree_map_with_path(spec, state, is_leaf=is_moment)


def make_mesh(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (data, fsdp, context, expert, tensor) mesh of `config` over `devices` (default: all of jax.devices()).

    Devices fill the mesh in order, tensor fastest: the tensor-parallel group is made of neighbouring
    devices (one host's NVLink island on a GPU cluster), then the expert-parallel group, the context-parallel
    ring, and data parallel spans the farthest ones.

    Raises:
      ConfigError: the mesh's product is not the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(config)
    if shape.devices == 1:
        devices = devices[:1]
    check_mesh_devices(config, len(devices), f"the device list ({len(devices)} {devices[0].platform} devices)")
    return Mesh(np.array(devices).reshape(shape.physical), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every input and output of the train step lives on a mesh.

    Attributes:
      mesh: the (data, fsdp, context, expert, tensor) device mesh.
      state: a TrainState of NamedShardings (params, optimizer state, step, dropout key).
      metrics: NamedShardings of the running metric sums (replicated).
      batch: a Batch of NamedShardings (tokens split along the batch, and the sequence over context).
      grads: NamedShardings of the trained parameters' reduced gradients (and their accumulator when it is
        reduced every minibatch): the optimizer state's layout, so below ZeRO stage 3, where the parameters are
        whole, they are split over the state axes (reduce-scattered: layout_rules.gradient_table).
      rules: the logical-to-mesh rules the model's constraints are resolved with: the parameters' table
        (`rules(config, params=True)`), so a weight cast for its use keeps the parameter's own layout (below
        ZeRO stage 3 it is whole on fsdp and used where it lies, never sliced and gathered again).
      local: how the gradients are accumulated on each device and reduced once a step
        (`local_accumulation`); None where they are reduced after every minibatch.
    """

    mesh: Mesh
    state: Any
    metrics: Any
    batch: Any
    grads: Any = None
    rules: tuple = RULES
    local: LocalAccumulation | None = None

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Mesh and rules in context while a step is traced: the model's logical constraints take effect."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def named(self, logical: Any) -> Any:
        """NamedShardings on this mesh for a tree of logical PartitionSpecs."""
        return nn.logical_to_mesh_sharding(logical, self.mesh, self.rules)

    @property
    def devices(self) -> int:
        return self.mesh.devices.size


def make_layout(config: ml_collections.ConfigDict, mesh: Mesh, init_fn: Callable[[], TrainState]) -> Layout:
    """The layout of the train step's state, metrics and batch on `mesh`, from the logical names and `rules`.

    The parameters (trained and frozen) are laid out with `rules(config, params=True)`, everything else with
    `rules(config)`: below ZeRO stage 3 the optimizer state is split over fsdp while the parameters are not.

    Args:
      config: the run config (its model and optimizer decide the state's tree).
      mesh: from make_mesh (or a deviceless target's mesh, jaxscale.plan.target_compile).
      init_fn: the init function whose states the step will take (make_init_fn(config)); the layout's
        state tree has its static fields (apply_fn, tx), so jit accepts one for the other.
    """
    boxed = jax.eval_shape(make_init_fn(config, boxed=True))  # names, shapes only
    param_names = logical_specs(model_params(boxed.params, boxed.frozen))
    logical_state = state_specs(jax.eval_shape(init_fn), param_names)
    metrics = jax.tree_util.tree_map(lambda _: PartitionSpec(), jax.eval_shape(init_metrics))
    batch = Batch(inputs=PartitionSpec(*BATCH_AXES), labels=PartitionSpec(*BATCH_AXES))
    table, param_table = rules(config), rules(config, params=True)

    def named(logical: Any, table: tuple = table) -> Any:
        return nn.logical_to_mesh_sharding(logical, mesh, table)

    state = named(logical_state).replace(
        params=named(logical_state.params, param_table), frozen=named(logical_state.frozen, param_table)
    )
    state = offload.host_shardings(state, config)  # the offloaded parts in pinned host memory
    grads = named(logical_state.params, gradient_rules(config))
    return Layout(mesh=mesh, state=state, metrics=named(metrics), batch=named(batch), grads=grads,
                  rules=param_table, local=local_accumulation(config, mesh, state.params))  # fmt: skip


def local_accumulation(config: ml_collections.ConfigDict, mesh: Mesh, param_shardings: Any) -> LocalAccumulation | None:
    """How the step accumulates gradients on each device and reduces them once a step, where
    jaxscale.config.accumulates_locally says it does (data parallelism and ZeRO-1/2 with several minibatches: DDP's
    `no_sync`, llm.c, Megatron's distributed optimizer); None elsewhere (one minibatch: one reduction a step
    anyway; ZeRO-3 over fsdp > 1 reduce-scatters every minibatch's gradients, torchtitan's FSDP2 default, since a
    whole local copy would undo its memory saving)."""
    if not accumulates_locally(config):
        return None
    axes = dict(RULES)["batch"]  # the group axis splits as the batch does; inside a group nothing else may
    inner = tuple((name, without(mapped, axes)) for name, mapped in rules(config, params=True))

    def carry_sharding(sharding: NamedSharding) -> NamedSharding:  # [groups, *the parameter's own layout]
        return NamedSharding(mesh, PartitionSpec(axes, *(without(entry, axes) for entry in sharding.spec)))

    carry = jax.tree_util.tree_map(carry_sharding, param_shardings)
    return LocalAccumulation(axes=axes, count=mesh_shape(config).batch_split, rules=inner, carry=carry)


def make_step(config: ml_collections.ConfigDict, layout: Layout | None) -> Any:
    """The jitted train step: the single-device one (layout None, jaxscale.train.make_train_step), or the same
    `train_step` jitted with the layout's in/out shardings, the gradients constrained to the parameters'
    layout, and tracing (`.lower`, a first call) inside `layout.activate()`."""
    if layout is None:
        return make_train_step(config)
    if config.optimizer.in_backward:  # one device (validation) with its optimizer state on the host, paged by layer
        step = functools.partial(fused_step.fused_train_step, loss_fn=make_loss_fn(config),
                                 paged=config.optimizer.offload_state)  # fmt: skip
    else:
        step = functools.partial(offload.offloaded_step(train_step, config), **step_options(config),
                                 grad_shardings=layout.grads, local=layout.local)  # fmt: skip
    shardings = (layout.state, layout.metrics, layout.batch)
    jitted = jax.jit(step, in_shardings=shardings, out_shardings=shardings[:2], donate_argnums=(0, 1))
    return MeshStep(jitted, layout)


@dataclasses.dataclass(frozen=True)
class MeshStep:
    """A jitted step whose tracing happens with its layout's mesh and logical rules in context."""

    jitted: Any
    layout: Layout

    def lower(self, *args: Any) -> jax.stages.Lowered:
        with self.layout.activate():
            return self.jitted.lower(*args)

    def __call__(self, *args: Any) -> Any:
        with self.layout.activate():
            return self.jitted(*args)


def abstract_inputs(
    config: ml_collections.ConfigDict, layout: Layout, init_fn: Callable[[], TrainState]
) -> tuple[Any, Any, Batch]:
    """(state, metrics, batch) as ShapeDtypeStructs that carry the layout's shardings (nothing allocated)."""
    shapes = unsharded_inputs(config, init_fn)
    shardings = (layout.state, layout.metrics, layout.batch)
    return jax.tree_util.tree_map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, shardings
    )


def init_state(init_fn: Callable[[], TrainState], layout: Layout) -> TrainState:
    """The initial state built directly in its shards: the init is jitted with the layout as out_shardings,
    so under FSDP no device ever holds the whole state. Same values as the single-device init (JAX's
    partitionable threefry generates each shard's random numbers where it lives)."""
    # Traced without the mesh in context: there Flax's boxes would constrain DenseGeneral's flat kernels.
    return jax.jit(init_fn, out_shardings=layout.state)()


def place_metrics(metrics: Any, layout: Layout) -> Any:
    """The running metric sums, replicated on every device of the mesh.

    Each global array is built from this process's values for its own devices (make_array_from_callback):
    `jax.device_put` of a process-local array onto a mesh whose processes hold one device each makes an
    array whose local shard holds two (found with 2 processes x 1 CPU device).
    """

    def place(value: Any, sharding: NamedSharding) -> jax.Array:
        local = np.asarray(value)
        return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index])

    return jax.tree_util.tree_map(place, metrics, layout.metrics)


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a [batch, ...] array of `shape` that this process's devices hold under `sharding`: its share
    (whole rows: under context parallelism its devices hold parts of each, and the process passes them whole).

    Raises:
      ValueError: the process's rows are not one contiguous block (a mesh ordered across hosts).
    """
    starts, stops, batch_size = set(), set(), shape[0]
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows = index[0]
        starts.add(rows.start or 0)
        stops.add(batch_size if rows.stop is None else rows.stop)
    first, last = min(starts), max(stops)
    covered = sorted(set(zip(sorted(starts), sorted(stops), strict=True)))
    if sum(stop - start for start, stop in covered) != last - first:
        raise ValueError(f"this process's batch rows are not contiguous: {covered}")
    return slice(first, last)


def place_batch(batch: Batch, sharding: NamedSharding | None = None, *, share: bool = False) -> Batch:
    """A host batch ([batch, seq] arrays, numpy or jax) on the device(s): the one place batches are placed.

    Args:
      batch: the global batch, of which each process passes only its own rows (`process_rows`) to
        `jax.make_array_from_process_local_data`; or, with `share`, this process's share alone (its rows, as
        the text loader yields them), from which the global array is assembled across processes.
      sharding: the batch's sharding on a mesh (`Layout.batch.inputs`); None: the default device.
    """
    if sharding is None:
        return jax.device_put(batch)

    def place(host: Any) -> jax.Array:
        host = np.asarray(host)
        if share:
            return jax.make_array_from_process_local_data(sharding, host)
        local = host[process_rows(sharding, host.shape)]
        return jax.make_array_from_process_local_data(sharding, local, host.shape)

    return jax.tree_util.tree_map(place, batch)


def state_bytes_per_device(abstract_state: Any) -> dict[str, int]:
    """Bytes of trained params, frozen params and optimizer state one device holds under the state's shardings (exact).

    Args:
      abstract_state: the step's state as ShapeDtypeStructs carrying NamedShardings (abstract_inputs).
    """

    def shard_bytes(leaf: jax.ShapeDtypeStruct) -> int:
        shape = leaf.sharding.shard_shape(leaf.shape)
        return int(math.prod(shape)) * leaf.dtype.itemsize

    def total(tree: Any) -> int:
        return sum(shard_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree))

    return {
        "params": total(abstract_state.params),
        "frozen": total(abstract_state.frozen),
        "optimizer": total(abstract_state.opt_state),
    }


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one run's train step is compiled and fed: on one device (layout None, the program of old) or on a
    mesh. The run asks it for the step, its abstract inputs, the initial state, and places every batch
    through `place_batch` (the data sources are handed it), so the run's code is the same for both.
    """

    config: ml_collections.ConfigDict
    init_fn: Callable[[], TrainState]
    layout: Layout | None

    def step(self) -> Any:
        """The jitted train step (make_step)."""
        return make_step(self.config, self.layout)

    def abstract_inputs(self) -> tuple[Any, Any, Batch]:
        """(state, metrics, batch) as ShapeDtypeStructs, with the layout's shardings on a mesh."""
        if self.layout is None:
            return unsharded_inputs(self.config, self.init_fn)
        return abstract_inputs(self.config, self.layout, self.init_fn)

    def init_state(self) -> TrainState:
        """The initial state, built in its shards on a mesh (init_state)."""
        return jax.jit(self.init_fn)() if self.layout is None else init_state(self.init_fn, self.layout)

    def init_metrics(self) -> Any:
        metrics = init_metrics()
        return metrics if self.layout is None else place_metrics(metrics, self.layout)

    def place_batch(self, batch: Batch) -> Batch:
        """A global host batch where the step takes it: on the default device, or split over the mesh."""
        return place_batch(batch, self.batch_sharding)

    def place_share(self, share: Batch) -> Batch:
        """This process's share of a global batch (the text loader's rows) where the step takes it."""
        return place_batch(share, self.batch_sharding, share=True)

    @property
    def batch_sharding(self) -> NamedSharding | None:
        """The sharding of a [batch, seq] token array on the mesh (None on one device)."""
        return None if self.layout is None else self.layout.batch.inputs

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """The mesh and its logical rules in context (nothing on one device), for other functions of the
        model traced on the mesh, such as the validation step."""
        if self.layout is None:
            yield
        else:
            with self.layout.activate():
                yield

    @property
    def local_devices(self) -> list[jax.Device]:
        """The devices of this process that the step runs on."""
        if self.layout is None:
            return jax.local_devices()[:1]
        return [d for d in self.layout.mesh.devices.flat if d.process_index == jax.process_index()]


def placement(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Placement:
    """The Placement of `config`'s step: one device for the 1x1x1 mesh, else its mesh over `devices` (and a 1x1x1
    mesh where something is offloaded to the host: the layout's shardings carry the memory kinds).

    Raises:
      ConfigError: the mesh does not use every device (see config.check_mesh_devices).
    """
    init_fn = make_init_fn(config)
    if mesh_shape(config).devices == 1 and not offload.parts(config):  # offload needs the layout's memory kinds
        return Placement(config, init_fn, None)
    return Placement(config, init_fn, make_layout(config, make_mesh(config, devices), init_fn))


def host_scalars(tree: Any) -> dict[str, float]:
    """Replicated scalars as Python floats, read from this process's first shard (works across hosts)."""
    return {key: float(np.asarray(value.addressable_shards[0].data)) for key, value in tree.items()}

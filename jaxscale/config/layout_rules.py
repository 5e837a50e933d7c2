"""The one table that maps the model's logical axis names onto the mesh axes, and a config's layout of it.

The model names every parameter's axes and constrains its activations by logical names (jaxscale.model.axes);
`RULES` is the only place that says which mesh axis splits which name, and `table` (a config's: `rules(config)`) the
only place that says what mesh.zero_stage and mesh.sequence_parallel change in it. The layout
(jaxscale.train.sharding) applies it; the analytic parameter and memory models (jaxscale.measure.params, .memory)
read the same table to count what one device holds. It lives on the config floor so that all of them may import it.
"""

from __future__ import annotations

import flax.linen as nn
import ml_collections

from jaxscale.config.spec import sequence_parallel, zero_stage

# Logical axis name -> mesh axes, in order of precedence (Flax's logical_to_mesh_axes): a rule gives a dimension its
# mesh axes only when none of them was taken by an earlier rule in the same array, and a later rule for the same name
# applies where an earlier one could not (`split_axes`). So in an activation ("batch", "stream_seq", "embed") the
# batch takes data, fsdp and expert and "embed" stays whole, while in a parameter ("embed", "mlp") "embed" is split
# over fsdp, context and expert. A name mapped to None (pos, head_dim, qkv) is never split, and "layers" only over a
# pipeline's stages. The names are the lab's conventions, shared by every model family (docs/mesh.md). This is the
# default layout (ZeRO-3 on the state axes, no sequence parallelism); `rules` derives a config's from it.
STATE_AXES = ("fsdp", "context", "expert")  # the mesh axes that shard the model state (ZeRO / FSDP), its first rule

RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations and tokens: data parallel x FSDP x expert parallel (the expert-parallel devices are data parallel
    # everywhere but in the experts' matmuls)
    ("batch", ("data", "fsdp", "expert")),
    # a mixture of experts' tokens dispatched to their experts, [batch, expert, capacity, embed]: the batch without
    # the expert axis, which splits the experts instead (jaxscale.model.moe; MaxText's activation_batch_no_exp)
    ("batch_no_expert", ("data", "fsdp")),
    ("vocab", "tensor"),  # token embedding, output head, logits
    ("heads", "tensor"),  # QKV, attention output, the attention itself
    ("kv_heads", "tensor"),  # grouped-query K/V (the Llama family)
    ("mlp", "tensor"),  # MLP up (and gate) columns, down rows, the hidden activation
    # a mixture of experts' stacked experts and router columns (jaxscale.model.moe); before "embed", so that an array
    # with both gives the expert axis to its experts
    ("expert", "expert"),
    # ZeRO-3: every parameter with an embed axis, and its gradient and optimizer state, split over the state axes
    # fsdp, context and expert (context-parallel devices hold the same weights and sum their gradients too:
    # torchtitan shards over both; expert-parallel devices are data parallel outside the experts, and split the
    # rest of the model state as FSDP does: Megatron's distributed optimizer, NeMo AutoModel's EP x FSDP)
    ("embed", STATE_AXES),
    # ... and over fsdp and context where the expert axis is taken: the stacked experts' and the router's embed
    ("embed", ("fsdp", "context")),
    # the residual stream's positions (block outputs, norms' inputs, dropout), and every other activation's: context
    # parallelism; and, outside a pipeline's loop (the embedding, the head and the loss, which every stage runs), split
    # over its stages too (jaxscale.model.pipeline.inner_rules takes "stage" out of them inside the loop)
    ("stream_seq", ("context", "stage")),
    ("seq", ("context", "stage")),
    ("stage_seq", "stage"),  # the positions of a pipeline's finished microbatches, split over its stages
    # the stacked axis of nn.scan: split into the pipeline's stages (jaxscale.model.pipeline), whole without them;
    # "stage" is the pipeline's stage dimension of its activations and of its stage-major parameters
    ("layers", "stage"),
    ("stage", "stage"),
    ("pos", None),
    ("head_dim", None),
    ("qkv", None),
)


def rules(config: ml_collections.ConfigDict | None = None, *, params: bool = False) -> tuple:
    """The logical-to-mesh table of `config`'s layout: RULES with what mesh.zero_stage and
    mesh.sequence_parallel change (`table`).

    Args:
      config: the run config (None: RULES).
      params: the table the parameters are laid out with. Below ZeRO stage 3 the parameters stay whole on
        the state axes (their "embed" is not split there), while the optimizer state (and, at stage 2, the
        gradients) keep the default table's split.
    """
    if config is None:
        return RULES
    return table(zero_stage(config), sequence_parallel(config), params=params)


def table(stage: int, sequence_split: bool, *, params: bool = False) -> tuple:
    """RULES with what a ZeRO stage and sequence parallelism change: `rules`' table from the two facts it depends
    on (a jaxscale.config.spec.RunSpec's zero_stage and sequence_parallel).

    Args:
      stage: mesh.zero_stage.
      sequence_split: Megatron sequence parallelism is on (jaxscale.config.spec.sequence_parallel).
      params: the parameters' table (below stage 3 their "embed" stays whole on the state axes).

    Returns:
      The logical-to-mesh table (each of "embed"'s rules changed alike).
    """
    changes = {}
    if params and stage < 3:
        changes["embed"] = None
    if sequence_split:  # Korthikanti et al. 2022: norms, dropout and residuals split over tensor
        changes["stream_seq"] = ("context", "tensor", "stage")
    return tuple((name, changes.get(name, axes)) for name, axes in RULES)


def gradient_rules(config: ml_collections.ConfigDict) -> tuple:
    """The table the step's reduced gradients are laid out with (`gradient_table` of the config's layout)."""
    return gradient_table(zero_stage(config), sequence_parallel(config))


def gradient_table(stage: int, sequence_split: bool) -> tuple:
    """The table the step's reduced gradients are laid out with: the optimizer state's at every stage. Below stage 3
    the parameters are whole, but each device updates only its share of the state, so it needs only its share of the
    gradient: the step reduce-scatters the gradients (stage 2 every minibatch by default, stage 1 once a step after
    the local accumulation), then all-gathers the updated parameters, which costs the links what data parallelism's
    all-reduce does (DeepSpeed's stage 1 and Megatron's distributed optimizer: a reduce-scatter is half an
    all-reduce, the all-gather the other half). Read by the layout and the analytic memory model.

    Args:
      stage: mesh.zero_stage.
      sequence_split: Megatron sequence parallelism is on.

    Returns:
      The logical-to-mesh table.
    """
    return table(stage, sequence_split)


def gathered_table(sequence_split: bool) -> tuple:
    """The table of the weights a layer uses under FSDP: gathered whole over the state axes ("embed" unsplit), still
    split over tensor and, a mixture of experts' stacked experts, over expert (the parameters' table below ZeRO stage
    3, whose weights are whole already). Read by the analytic memory model's gathered layer."""
    return table(1, sequence_split, params=True)


def _as_tuple(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def without(mapped: str | tuple[str, ...] | None, axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """A rules-table entry (or a PartitionSpec's) with the mesh axes `axes` removed (None if nothing is left)."""
    return tuple(a for a in _as_tuple(mapped) if a not in axes) or None


def mesh_axes(name: str, table: tuple = RULES) -> tuple[str, ...]:
    """The mesh axes of a logical name's first rule in `table`: what it is split over where no other dimension of the
    array took them (() where it is never split, or the name is not in it). `split_axes` says what each dimension
    of an array gets, later rules of a name included.

    Args:
      name: a logical axis name (jaxscale.model.axes).
      table: a rules table (RULES, or a config's `rules`).

    Returns:
      The mesh axes, in the table's order.
    """
    return _as_tuple(next((axes for rule, axes in table if rule == name), None))


def split_axes(names: tuple[str | None, ...], table: tuple = RULES) -> tuple[tuple[str, ...], ...]:
    """The mesh axes each dimension of an array named `names` is split over under `table`: Flax's own resolution
    (nn.logical_to_mesh_axes, which the layout applies), so the analytic models count what the layout does.

    Args:
      names: the array's logical axis names, one per dimension (None: unnamed, never split).
      table: a rules table (RULES, or a config's `rules`).

    Returns:
      One tuple of mesh axes per dimension (() where it is whole).
    """
    return tuple(_as_tuple(axes) for axes in nn.logical_to_mesh_axes(tuple(names), table))

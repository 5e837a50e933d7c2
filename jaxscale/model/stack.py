"""What every family shares around its block: remat wrapping, the layer stack (scan or unrolled), the
projections and the token embedding, each with logical axis names (jaxscale.model.axes).
"""

from __future__ import annotations

import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxscale.config import remat_policies
from jaxscale.config.spec import ModelConfig
from jaxscale.model import fp8, lora, nf4, pipeline, precision, ring_attention
from jaxscale.model.axes import Initializer, constrain, mesh_axis_size, partitioned


def maybe_remat(module: type[nn.Module], target: str, cfg: ModelConfig) -> type[nn.Module]:
    """Wraps `module` in nn.remat when `target` is in cfg.remat, with the policy
    jaxscale.config.remat_policies names cfg.remat_policy (the table the FLOP and memory models read too); a
    sub-block no remat target covers (`keeps_closed_form`) in nn.remat with remat_policies.CLOSED_FORM, which keeps
    exactly the tensors its backward pass reads and recomputes only elementwise work.

    prevent_cse: outside nn.scan it must be True, or XLA's common-subexpression elimination merges the
    backward pass's recomputation with the forward pass and silently undoes the remat. Inside nn.scan
    the loop boundary already stops that merge, and True would only add optimization barriers that
    block fusion (the JAX and Flax docs advise False there), so it is `not cfg.scan_layers`.
    """
    if target in cfg.remat:
        policy = cfg.remat_policy
    elif keeps_closed_form(module, target, cfg):
        policy = remat_policies.CLOSED_FORM_NAME
    else:
        return module
    return nn.remat(module, prevent_cse=not cfg.scan_layers, policy=remat_policies.remat_policy(policy, cfg.family))


def keeps_closed_form(module: type[nn.Module], target: str, cfg: ModelConfig) -> bool:
    """Whether the sub-block `module` ("Attn" or "MLP") keeps the closed form (remat_policies.CLOSED_FORM) for its
    backward pass: `target` is one of remat_policies.closed_form_units (model.residuals=closed_form, no remat target
    covering it, an attention kernel that names its residuals) and the module tags every tensor its backward reads
    (`names_backward_reads`: the MLPs, a mixture of experts' too, and the attentions). Otherwise
    JAX's autodiff decides what it keeps (inside nn.scan, every intermediate its backward reads, float32 ones
    included, as loop outputs: docs/measurements.md)."""
    units = remat_policies.closed_form_units(cfg, mesh_axis_size("context"))
    return target in units and getattr(module, "names_backward_reads", False)


class ResidualBlock(nn.Module):
    """One pre-norm block, x + attn(x) then + mlp(x); returns (x, None) so that nn.scan can carry x.

    A family subclasses it naming its attention and MLP sub-blocks; remat wraps them as "Attn" and "MLP".
    """

    config: ModelConfig
    train: bool
    attn_block: ClassVar[type[nn.Module]]
    mlp_block: ClassVar[type[nn.Module]]

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        cfg = self.config
        attn_cls = maybe_remat(self.attn_block, "Attn", cfg)
        mlp_cls = maybe_remat(self.mlp_block, "MLP", cfg)
        x = x + attn_cls(cfg, self.train, name="attn")(x)  # [B, T, H]
        x = x + mlp_cls(cfg, self.train, name="mlp")(x)
        return constrain(x, ("batch", "stream_seq", "embed")), None


# Collections a block may sow into (jaxscale.model.moe: the router's losses the train step adds, its metrics); under
# nn.scan they are stacked along the layers like the params (a collection the scan does not name is dropped).
SOWN_COLLECTIONS = ("aux_loss", "moe_metrics")


class Transformer(nn.Module):
    """The stack of `block`s: nn.scan over layers (params stacked on a leading "layers" axis) or unrolled.

    `block` is a family's block class: (config, train) attributes, called as block(x, None) -> (x, None).
    `first_block`, when given, is the block of the first cfg.first_dense_layers layers (unrolled only: a mixture of
    experts' dense layers, jaxscale.model.moe).
    """

    config: ModelConfig
    train: bool
    block: type[nn.Module]
    first_block: type[nn.Module] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        block_cls = maybe_remat(self.block, "Block", cfg)
        if cfg.scan_layers:
            scanned = nn.scan(
                block_cls,
                variable_axes={"params": 0, fp8.OVERWRITE: 0, **dict.fromkeys(SOWN_COLLECTIONS, 0)},
                split_rngs={"params": True, "dropout": True},
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            stages = mesh_axis_size(pipeline.STAGE_AXIS)
            if stages > 1 and not self.is_initializing():  # the same stacked params, pipelined over the stage axis
                with jax.named_scope("pipeline"):
                    return self._pipelined(block_cls, x, stages)
            with jax.named_scope("blocks"):  # stacked params: ("layers", ...)
                x, _ = scanned(cfg, self.train, name="blocks")(x, None)
            return x
        first_cls = maybe_remat(self.first_block or self.block, "Block", cfg)
        for i in range(cfg.num_layers):
            with jax.named_scope(f"block_{i}"):
                cls = first_cls if i < cfg.first_dense_layers else block_cls
                x, _ = cls(cfg, self.train, name=f"block_{i}")(x, None)
        return x

    def _pipelined(self, block_cls: type[nn.Module], x: jax.Array, stages: int) -> jax.Array:
        """x [B, T, H] through nn.scan's stacked blocks (the "blocks" params, as the scanned stack holds them) by
        jaxscale.model.pipeline over `stages` stages: the same function, each stage's layers on its devices. x comes
        in (and goes out) with its positions split over the stages, as the embedding and the head run; the loop runs
        with pipeline.inner_rules."""
        cfg = self.config
        microbatches, repeats, gather_once = cfg.pipeline
        schedule = pipeline.Schedule(stages, microbatches or stages, repeats)
        stacked = {col: tree["blocks"] for col, tree in self.variables.items() if "blocks" in tree}
        block = block_cls(cfg, self.train, parent=None)  # unbound: applied to each layer's variables
        micro = jax.ShapeDtypeStruct((x.shape[0] // schedule.microbatches, *x.shape[1:]), x.dtype)
        boxed = jax.eval_shape(lambda h: block.init(jax.random.PRNGKey(0), h, None), micro)
        is_box = lambda leaf: isinstance(leaf, nn.LogicallyPartitioned)  # noqa: E731
        names = jax.tree_util.tree_map(lambda leaf: tuple(leaf.names) if is_box(leaf) else None, boxed, is_leaf=is_box)
        if jax.tree_util.tree_structure(names, is_leaf=pipeline.is_names) != jax.tree_util.tree_structure(stacked):
            names = None  # NF4's packed kernels: only the stage dimension is constrained

        def layer(variables: dict, h: jax.Array) -> jax.Array:
            return block.apply(variables, h, None)[0]

        rules = pipeline.inner_rules(tuple(nn.get_logical_axis_rules()))
        with nn.logical_axis_rules(pipeline.gathered_rules(rules) if gather_once else rules):  # the loop's layout
            staged = pipeline.stage_layout(stacked, schedule, names)
            only_inputs = cfg.remat == ("Block",) and cfg.remat_policy == "nothing_saveable"  # what the layers keep
            return pipeline.run(layer, staged, x, schedule, pipeline.device_groups(), names, only_inputs)


def count_params(params) -> int:
    """Number of scalars in a params tree (arrays or ShapeDtypeStructs, boxed or not; an NF4 kernel counts its
    kernel's elements)."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, nf4.Nf4Weight))
    return sum(math.prod(p.shape) for p in leaves)


def unstack_scanned_params(params: dict, num_layers: int) -> dict:
    """Maps params of a scan_layers=True model to the layout of the unrolled model (block_0 ... block_{L-1})."""
    params = dict(params)
    transformer = dict(params["transformer"])
    stacked = transformer.pop("blocks")
    for i in range(num_layers):
        transformer[f"block_{i}"] = jax.tree_util.tree_map(lambda p, i=i: p[i], stacked)
    params["transformer"] = transformer
    return params


def dense(
    features: int | tuple[int, ...],
    kernel_axes: tuple[str, ...],
    cfg: ModelConfig,
    name: str,
    axis: int | tuple[int, ...] = -1,
    use_bias: bool = True,
) -> nn.DenseGeneral:
    """A projection in the compute dtype with float32 params: kernel named `kernel_axes`, bias its output axes;
    the kernel gathered and its gradient summed in the dtypes jaxscale.model.precision says.

    Args:
      features: output width, or a tuple of output dims (e.g. (heads, head_dim)).
      kernel_axes: logical names of the kernel's dims, contracted dims first.
      axis: the input dims contracted.
    With model.lora_rank > 0 and `name` among the projections of model.lora_targets, the projection carries a
    LoRA adapter (jaxscale.model.lora.LoraDenseGeneral); with model.fp8 on and `name` among model.fp8_targets, its
    matmul runs in FP8 (jaxscale.model.fp8).
    """
    outputs = 1 if isinstance(features, int) else len(features)
    fields = dict(
        features=features,
        axis=axis,
        use_bias=use_bias,
        dtype=cfg.dtype,
        kernel_init=partitioned(nn.initializers.lecun_normal(), kernel_axes),
        bias_init=partitioned(nn.initializers.zeros_init(), kernel_axes[-outputs:]),
        promote_dtype=precision.keep_kernel_dtype,
        dot_general=(fp8.dot_general if fp8.applies(cfg, name) else precision.weight_dot_general)(cfg, kernel_axes),
        name=name,
    )
    if fp8.delayed(cfg, name):  # Flax's delayed-scaling op, its state in its own collection (jaxscale.model.fp8)
        fields["dot_general_cls"] = fp8.delayed_dot_cls(cfg, kernel_axes)
    if lora.adapted(cfg, name):  # a LoRA adapter beside the kernel (jaxscale.model.lora)
        return lora.lora_dense(cfg, kernel_axes, **fields)
    return nn.DenseGeneral(**fields)


class Embed(nn.Embed):
    """nn.Embed whose table is cast, gathered and differentiated as jaxscale.model.precision says.

    At the lookup the table is whole along embed (the all-gather FSDP does for any weight), so the lookup's
    output splits by batch like every activation; with the table split along embed, XLA's partitioner would
    have to move the looked-up activations between layouts, and replicates them instead ("Involuntary full
    rematerialization"). Off a mesh, in float32, this is nn.Embed exactly.
    """

    config: ModelConfig | None = None

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        return precision.lookup(self.config, self.embedding, inputs)  # [B, T, H]

    def attend(self, query: jax.Array) -> jax.Array:
        """query [..., H] @ embedding.T: [..., V] in the compute dtype (the tied output head)."""
        dims = (((query.ndim - 1,), (1,)), ((), ()))
        dot = precision.weight_dot_general(self.config, ("vocab", "embed"))
        return dot(query.astype(self.config.dtype), self.embedding, dims)


def embed(cfg: ModelConfig, init: Initializer) -> Embed:
    """The token embedding [vocab, hidden] named ("vocab", "embed"), looked up in the compute dtype."""
    return Embed(
        cfg.vocab_size,
        cfg.hidden_size,
        dtype=cfg.dtype,
        embedding_init=partitioned(init, ("vocab", "embed")),
        config=cfg,
        name="embed",
    )


def output_logits(cfg: ModelConfig, x: jax.Array, token_embed: Embed, use_bias: bool) -> jax.Array:
    """[B, T, V] float32 logits of the final normalized activations x [B, T, H]: the token embedding
    transposed when cfg.tie_embeddings (no bias), else an output projection named ("embed", "vocab")."""
    if cfg.tie_embeddings:
        logits = token_embed.attend(x)  # x @ embedding.T
    else:
        logits = output_projection(cfg, use_bias)(x)
    return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))


def output_projection(cfg: ModelConfig, use_bias: bool) -> nn.DenseGeneral:
    """The untied output head [hidden, vocab], named "output" in the model's params."""
    return dense(cfg.vocab_size, ("embed", "vocab"), cfg, "output", use_bias=use_bias)


def head_logits(cfg: ModelConfig, params: dict, x: jax.Array, use_bias: bool) -> jax.Array:
    """The model's output head applied to its params from outside the model (the chunked loss): the same
    modules as output_logits, so [..., T, H] -> [..., T, V] float32 logits of the same function."""
    if cfg.tie_embeddings:
        table = embed(cfg, nn.initializers.zeros_init())
        logits = table.apply({"params": params["embed"]}, x, method=Embed.attend)  # x @ embedding.T
    else:
        logits = output_projection(cfg, use_bias).apply({"params": params["output"]}, x)
    return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))


def whole_sequence(h: jax.Array) -> jax.Array:
    """A sub-block's normalized input [B, T, H], whole along the sequence on the tensor axis: under sequence
    parallelism the all-gather before the block's column-parallel matmuls (Korthikanti et al.'s g), shared by q, k
    and v (and gate and up); a no-op otherwise. Without it XLA gathered per projection: Llama 3.1 8B on 1x1x8
    all-gathered 626 GB a step per GPU, 265 GB with it; on 1x4x2 and 1x2x4 it costs 13% and 18% more gathered
    bytes (docs/mesh.md, "Sequence parallelism")."""
    return constrain(h, ("batch", "seq", "embed"))


def branch_output(cfg: ModelConfig, h: jax.Array, train: bool) -> jax.Array:
    """A sub-block's output before its residual add: [B, T, H] laid out like the residual stream (the
    tensor-parallel partial sums reduced there), then dropout."""
    h = constrain(h, ("batch", "stream_seq", "embed"))
    return nn.Dropout(cfg.dropout_rate)(h, deterministic=not train)


def positions(seq: int) -> jax.Array:
    """[seq] the original position of each slot of the sequence the blocks see: arange, or under context
    parallelism (a mesh axis "context" in context) the load-balanced order the ring attends in, each device
    holding one early and one late chunk (jaxscale.model.ring_attention)."""
    context = mesh_axis_size("context")
    return jnp.arange(seq) if context == 1 else jnp.asarray(ring_attention.balanced_positions(seq, context))


def to_block_order(x: jax.Array) -> jax.Array:
    """[B, T, ...] in natural order -> the order of `positions` (the identity without context parallelism)."""
    context = mesh_axis_size("context")
    return x if context == 1 else ring_attention.to_balanced(x, context, axis=1)


def to_natural_order(x: jax.Array) -> jax.Array:
    """The inverse of to_block_order: the blocks' output back in natural order for the head and the loss."""
    context = mesh_axis_size("context")
    return x if context == 1 else ring_attention.from_balanced(x, context, axis=1)

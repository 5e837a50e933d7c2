"""The GPT of the reference experiment (Flax linen): bf16 compute, fp32 params and softmax, remat and scan.

Every parameter carries logical axis names (`nn.with_logical_partitioning`) and the activations between the
sharded matmuls carry logical constraints (`nn.with_logical_constraint`). The names follow the lab's
conventions (embed, vocab, pos, heads, qkv, head_dim, mlp, layers; batch and seq for activations); the one
table that maps them to mesh axes is `jaxscale.train.sharding.RULES`. Without those rules in context (the
default 1x1x1 mesh) the constraints are no-ops and the values of the initialised parameters are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.ad_checkpoint import checkpoint_name

# Named remat policies (MaxText's vocabulary). An unknown name is a KeyError, caught by config validation.
REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable model hyper-parameters (Flax module attributes must be hashable); see config.base_config."""

    vocab_size: int = 2048
    hidden_size: int = 1024
    head_dim: int = 128
    num_layers: int = 12
    mlp_expansion: int = 4
    max_seq_len: int = 512
    dropout_rate: float = 0.1
    dtype: str = "bfloat16"
    softmax_dtype: str = "float32"
    causal: bool = True
    remat: tuple[str, ...] = ()
    remat_policy: str = "nothing_saveable"
    scan_layers: bool = False
    attention: str = "reference"

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelConfig:
        return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls)})


def maybe_remat(module: type[nn.Module], target: str, cfg: ModelConfig) -> type[nn.Module]:
    """Wraps `module` in nn.remat when `target` is in cfg.remat.

    prevent_cse: outside nn.scan it must be True, or XLA's common-subexpression elimination merges the
    backward pass's recomputation with the forward pass and silently undoes the remat. Inside nn.scan
    the loop boundary already stops that merge, and True would only add optimization barriers that
    block fusion (the JAX and Flax docs advise False there), so it is `not cfg.scan_layers`.
    """
    if target not in cfg.remat:
        return module
    return nn.remat(module, prevent_cse=not cfg.scan_layers, policy=REMAT_POLICIES[cfg.remat_policy])


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


def partitioned(init: Callable, names: tuple[str, ...]) -> Callable:
    """`init` whose parameter carries logical axis names, one per dimension (see the module docstring)."""

    def init_with_names(*args, **kwargs) -> LogicalAxes:
        return LogicalAxes(init(*args, **kwargs), names)

    return init_with_names


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """A logical sharding constraint on an activation; a no-op unless a mesh's rules are active."""
    return nn.with_logical_constraint(x, names)


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    """LayerNorm in the compute dtype with float32 scale and bias named ("embed",)."""
    return nn.LayerNorm(
        dtype=cfg.dtype,
        scale_init=partitioned(nn.initializers.ones, ("embed",)),
        bias_init=partitioned(nn.initializers.zeros, ("embed",)),
        name=name,
    )


def dense_inits(kernel_names: tuple[str, ...], bias_names: tuple[str, ...]) -> dict[str, Callable]:
    """Flax's default Dense initializers (LeCun normal kernel, zero bias) with logical axis names."""
    return {
        "kernel_init": partitioned(nn.initializers.lecun_normal(), kernel_names),
        "bias_init": partitioned(nn.initializers.zeros, bias_names),
    }


class Embed(nn.Embed):
    """nn.Embed whose table is whole along embed at the lookup (the all-gather FSDP does for any weight).

    The lookup's output then splits by batch like every activation; with the table split along embed,
    XLA's partitioner would have to move the looked-up activations between layouts, and replicates them
    instead ("Involuntary full rematerialization"). Off a mesh this is nn.Embed exactly.
    """

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)  # [V, H]
        return jnp.take(constrain(embedding, ("vocab", None)), inputs, axis=0)  # [B, T, H]


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, softmax_dtype) -> jax.Array:
    """Scaled dot-product attention as the reference writes it: logits and softmax in `softmax_dtype`.

    Args:
      q, k, v: [batch, seq, heads, head_dim] in the compute dtype.
    Returns:
      [batch, seq, heads, head_dim] in the compute dtype.
    """
    dtype = q.dtype
    q = (q * (q.shape[-1] ** -0.5)).astype(softmax_dtype)
    k = k.astype(softmax_dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # [B, nh, T, T] in softmax_dtype
    if causal:
        seq = q.shape[1]
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))  # [T, T]
        logits = jnp.where(mask, logits, jnp.finfo(softmax_dtype).min)
    weights = nn.softmax(logits, axis=-1).astype(dtype)  # cast back after the softmax
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)  # [B, T, nh, hd]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Dispatches to the configured attention kernel; all compute the same function."""
    if cfg.attention == "reference":
        return reference_attention(q, k, v, cfg.causal, jnp.dtype(cfg.softmax_dtype))
    # jax.nn.dot_product_attention computes its logits and softmax in float32 for bf16/fp16 inputs.
    return jax.nn.dot_product_attention(q, k, v, is_causal=cfg.causal, implementation=cfg.attention)


class AttnBlock(nn.Module):
    """Pre-LayerNorm multi-head self-attention with one fused QKV projection."""

    config: ModelConfig
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        with jax.named_scope("attn"):
            h = layer_norm(cfg, "pre_norm")(x)  # [B, T, H]
            qkv = nn.DenseGeneral(
                (cfg.num_heads, 3 * cfg.head_dim),
                dtype=cfg.dtype,
                **dense_inits(("embed", "heads", "qkv"), ("heads", "qkv")),
                name="qkv",
            )(h)
            qkv = constrain(checkpoint_name(qkv, "qkv_proj"), ("batch", "seq", "heads", "qkv"))  # [B, T, nh, 3*hd]
            q, k, v = jnp.split(qkv, 3, axis=-1)  # each [B, T, nh, hd]
            h = constrain(attention(q, k, v, cfg), ("batch", "seq", "heads", "head_dim"))  # [B, T, nh, hd]
            h = nn.DenseGeneral(
                cfg.hidden_size,
                axis=(-2, -1),
                dtype=cfg.dtype,
                **dense_inits(("heads", "head_dim", "embed"), ("embed",)),
                name="out",
            )(h)
            h = constrain(h, ("batch", "seq", "embed"))  # [B, T, H]: the tensor-parallel partial sums reduced
            return nn.Dropout(cfg.dropout_rate)(h, deterministic=not self.train)


class MLPBlock(nn.Module):
    """Pre-LayerNorm MLP: Dense -> GELU -> Dense."""

    config: ModelConfig
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        with jax.named_scope("mlp"):
            h = layer_norm(cfg, "pre_norm")(x)  # [B, T, H]
            width = cfg.mlp_expansion * cfg.hidden_size
            h = nn.Dense(width, dtype=cfg.dtype, **dense_inits(("embed", "mlp"), ("mlp",)), name="up")(h)
            h = constrain(checkpoint_name(nn.gelu(h), "mlp_hidden"), ("batch", "seq", "mlp"))  # [B, T, 4H]
            h = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, **dense_inits(("mlp", "embed"), ("embed",)), name="down")(h)
            h = constrain(h, ("batch", "seq", "embed"))  # [B, T, H]
            return nn.Dropout(cfg.dropout_rate)(h, deterministic=not self.train)


class Block(nn.Module):
    """One transformer block; returns (x, None) so that nn.scan can carry x."""

    config: ModelConfig
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        cfg = self.config
        attn_cls = maybe_remat(AttnBlock, "Attn", cfg)
        mlp_cls = maybe_remat(MLPBlock, "MLP", cfg)
        x = x + attn_cls(cfg, self.train, name="attn")(x)
        x = x + mlp_cls(cfg, self.train, name="mlp")(x)
        return constrain(x, ("batch", "seq", "embed")), None


class Transformer(nn.Module):
    """The stack of blocks: nn.scan over layers (params stacked on axis 0) or an unrolled Python loop."""

    config: ModelConfig
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        block_cls = maybe_remat(Block, "Block", cfg)
        if cfg.scan_layers:
            scanned = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},  # stacked params: ("layers", ...)
            )
            with jax.named_scope("blocks"):
                x, _ = scanned(cfg, self.train, name="blocks")(x, None)
            return x
        for i in range(cfg.num_layers):
            with jax.named_scope(f"block_{i}"):
                x, _ = block_cls(cfg, self.train, name=f"block_{i}")(x, None)
        return x


class GPT(nn.Module):
    """Decoder-only transformer. Input [batch, seq] int tokens, output [batch, seq, vocab] float32 logits."""

    config: ModelConfig
    train: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        seq = tokens.shape[1]
        with jax.named_scope("embed"):
            embed_init = partitioned(nn.linear.default_embed_init, ("vocab", "embed"))
            x = Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, embedding_init=embed_init, name="embed")(
                tokens
            )  # [B, T, H]
            pos_init = partitioned(nn.initializers.normal(0.02), ("pos", "embed"))
            pos_emb = self.param("pos_emb", pos_init, (cfg.max_seq_len, cfg.hidden_size))
            x = x + pos_emb[None, :seq].astype(cfg.dtype)
            x = constrain(nn.Dropout(cfg.dropout_rate)(x, deterministic=not self.train), ("batch", "seq", "embed"))
        x = Transformer(cfg, self.train, name="transformer")(x)
        with jax.named_scope("head"):
            x = layer_norm(cfg, "post_norm")(x)
            logits = nn.Dense(
                cfg.vocab_size, dtype=cfg.dtype, **dense_inits(("embed", "vocab"), ("vocab",)), name="output"
            )(x)
            return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))  # [B, T, V]


def count_params(params) -> int:
    """Number of scalars in a params tree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(p.shape) for p in jax.tree_util.tree_leaves(params))


def unstack_scanned_params(params: dict, num_layers: int) -> dict:
    """Maps params of a scan_layers=True model to the layout of the unrolled model (block_0 ... block_{L-1})."""
    params = dict(params)
    transformer = dict(params["transformer"])
    stacked = transformer.pop("blocks")
    for i in range(num_layers):
        transformer[f"block_{i}"] = jax.tree_util.tree_map(lambda p, i=i: p[i], stacked)
    params["transformer"] = transformer
    return params

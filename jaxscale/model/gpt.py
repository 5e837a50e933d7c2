"""The GPT of the reference experiment (Flax linen): pre-LayerNorm, fused QKV, GELU MLP, learned positions.

bf16 compute, fp32 params and softmax; remat, scan, the attention kernels and the logical axis names (on
every parameter, and constraints on the activations between sharded matmuls) come from jaxscale.model.stack,
.attention and .axes, shared with the other families. The remat policies' `checkpoint_name` tags: `attn_norm` and
`mlp_norm` (each LayerNorm's output), `qkv_proj`
(the fused projection), `context` (the attention output), `out_proj`, `mlp_up` (before GELU), `mlp_hidden`
(after), `mlp_down`. `tie_embeddings` gives GPT-2's output head: the token embedding transposed, with no
output bias.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config.spec import ModelConfig
from jaxscale.model.attention import attention
from jaxscale.model.axes import constrain, partitioned
from jaxscale.model.stack import (
    ResidualBlock,
    Transformer,
    branch_output,
    dense,
    embed,
    output_logits,
    to_block_order,
    to_natural_order,
    whole_sequence,
)


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    """LayerNorm in the compute dtype (statistics in float32), scale and bias named ("embed",)."""
    return nn.LayerNorm(
        epsilon=cfg.norm_epsilon,
        dtype=cfg.dtype,
        scale_init=partitioned(nn.initializers.ones_init(), ("embed",)),
        bias_init=partitioned(nn.initializers.zeros_init(), ("embed",)),
        name=name,
    )


class AttnBlock(nn.Module):
    """Pre-LayerNorm multi-head self-attention with one fused QKV projection."""

    config: ModelConfig
    train: bool
    names_backward_reads = True  # every tensor its backward reads is tagged (jaxscale.model.stack.keeps_closed_form)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        with jax.named_scope("attn"):
            h = whole_sequence(checkpoint_name(layer_norm(cfg, "pre_norm")(x), "attn_norm"))  # [B, T, H]
            qkv = dense((cfg.num_heads, 3 * cfg.head_dim), ("embed", "heads", "qkv"), cfg, "qkv")(h)
            qkv = constrain(checkpoint_name(qkv, "qkv_proj"), ("batch", "seq", "heads", "qkv"))  # [B, T, nh, 3*hd]
            q, k, v = jnp.split(qkv, 3, axis=-1)  # each [B, T, nh, hd]
            h = checkpoint_name(attention(q, k, v, cfg), "context")
            h = constrain(h, ("batch", "seq", "heads", "head_dim"))  # [B, T, nh, hd]
            h = dense(cfg.hidden_size, ("heads", "head_dim", "embed"), cfg, "out", axis=(-2, -1))(h)
            return branch_output(cfg, checkpoint_name(h, "out_proj"), self.train)  # [B, T, H]


class MLPBlock(nn.Module):
    """Pre-LayerNorm MLP: Dense -> GELU -> Dense."""

    config: ModelConfig
    train: bool
    names_backward_reads = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        with jax.named_scope("mlp"):
            h = whole_sequence(checkpoint_name(layer_norm(cfg, "pre_norm")(x), "mlp_norm"))  # [B, T, H]
            h = checkpoint_name(dense(cfg.mlp_width, ("embed", "mlp"), cfg, "up")(h), "mlp_up")  # [B, T, F]
            h = constrain(checkpoint_name(nn.gelu(h), "mlp_hidden"), ("batch", "seq", "mlp"))  # F = 4H by default
            h = dense(cfg.hidden_size, ("mlp", "embed"), cfg, "down")(h)
            return branch_output(cfg, checkpoint_name(h, "mlp_down"), self.train)  # [B, T, H]


class Block(ResidualBlock):
    """One GPT block: attention then MLP, each with its residual."""

    attn_block = AttnBlock
    mlp_block = MLPBlock


class GPT(nn.Module):
    """Decoder-only transformer. Input [batch, seq] int tokens, output [batch, seq, vocab] float32 logits
    (or, with features_only, the final normalized activations [batch, seq, hidden] the head reads)."""

    config: ModelConfig
    train: bool = False
    head_bias = True  # the output projection has a bias (when not tied to the embedding)

    @nn.compact
    def __call__(self, tokens: jax.Array, features_only: bool = False) -> jax.Array:
        cfg = self.config
        seq = tokens.shape[1]
        # GPT-2 draws its (tied) token embedding from N(0, 0.02); the reference keeps Flax's default.
        embed_init = nn.initializers.normal(0.02) if cfg.tie_embeddings else nn.linear.default_embed_init
        with jax.named_scope("embed"):
            token_embed = embed(cfg, embed_init)
            x = token_embed(to_block_order(tokens))  # [B, T, H], in the ring's order under context parallelism
            pos_init = partitioned(nn.initializers.normal(0.02), ("pos", "embed"))
            pos_emb = self.param("pos_emb", pos_init, (cfg.max_seq_len, cfg.hidden_size))
            x = x + to_block_order(pos_emb[None, :seq]).astype(cfg.dtype)
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=not self.train)
            x = constrain(x, ("batch", "stream_seq", "embed"))
        x = to_natural_order(Transformer(cfg, self.train, Block, name="transformer")(x))
        with jax.named_scope("head"):
            x = layer_norm(cfg, "post_norm")(x)  # [B, T, H]
            return x if features_only else output_logits(cfg, x, token_embed, self.head_bias)  # [B, T, V]

"""The Llama family (Flax linen): RMSNorm, SwiGLU MLP, rotary position embeddings, grouped-query attention.

No biases and no position table. bf16 compute with fp32 params; the reference attention keeps fp32 logits and
softmax; the rotation runs in float32. Remat targets (MLP, Attn, Block), their policies and the
`checkpoint_name` tags (`attn_norm` and `mlp_norm` on the two RMSNorms' outputs; `query_proj`, `key_proj`,
`value_proj`, and `query_rotated`, `key_rotated` after the rotation; `context` on the attention output, `out_proj`;
`mlp_gate`, `mlp_up`, `mlp_hidden` on the down projection's input, `mlp_down`), the layer
scan, the attention kernels and the logical axis names with their activation constraints are those of the
GPT (jaxscale.model.stack, .attention, .axes), so the mesh rules split both families alike.
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
from jaxscale.model.stack import positions as sequence_positions


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotates each head's dimension pairs (i, i + head_dim/2) by positions * theta^(-2i/head_dim).

    The half-split pairing of Hugging Face's Llama. Rotating query and key by their positions makes their
    dot product depend on the positions' difference only.

    Args:
      x: [batch, seq, heads, head_dim], head_dim even.
      positions: [seq] integer positions.
      theta: the frequencies' base (rope_theta).
    Returns:
      [batch, seq, heads, head_dim] in x's dtype (computed in float32).
    """
    half = x.shape[-1] // 2
    inverse_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [hd/2]
    angles = positions.astype(jnp.float32)[:, None] * inverse_freq[None, :]  # [T, hd/2]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]  # [1, T, 1, hd/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # each [B, T, h, hd/2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rms_norm(cfg: ModelConfig, name: str) -> nn.RMSNorm:
    """RMSNorm in the compute dtype (statistics in float32), its scale named ("embed",)."""
    return nn.RMSNorm(
        epsilon=cfg.norm_epsilon,
        dtype=cfg.dtype,
        scale_init=partitioned(nn.initializers.ones_init(), ("embed",)),
        name=name,
    )


def qk_norm(cfg: ModelConfig, name: str, heads_axis: str) -> nn.RMSNorm:
    """RMSNorm of the queries or keys [B, T, heads, head_dim] before RoPE (model.qk_norm): "head" over each head's
    head_dim (Qwen3's q_norm / k_norm), "full" over all heads together (OLMoE's, a scale per heads x head_dim)."""
    axes = (-1,) if cfg.qk_norm == "head" else (-2, -1)
    names = ("head_dim",) if cfg.qk_norm == "head" else (heads_axis, "head_dim")
    return nn.RMSNorm(epsilon=cfg.norm_epsilon, dtype=cfg.dtype, reduction_axes=axes, feature_axes=axes,
                      scale_init=partitioned(nn.initializers.ones_init(), names), name=name)  # fmt: skip


class LlamaAttention(nn.Module):
    """Pre-RMSNorm grouped-query self-attention with rotary embeddings; separate q, k, v projections."""

    config: ModelConfig
    train: bool
    names_backward_reads = True  # every tensor its backward reads is tagged (jaxscale.model.stack.keeps_closed_form)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        with jax.named_scope("attn"):
            h = whole_sequence(checkpoint_name(rms_norm(cfg, "pre_norm")(x), "attn_norm"))  # [B, T, H]
            q = dense((heads, head_dim), ("embed", "heads", "head_dim"), cfg, "q", use_bias=False)(h)
            k = dense((kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), cfg, "k", use_bias=False)(h)
            v = dense((kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), cfg, "v", use_bias=False)(h)
            q = constrain(checkpoint_name(q, "query_proj"), ("batch", "seq", "heads", "head_dim"))  # [B, T, nh, hd]
            k = constrain(checkpoint_name(k, "key_proj"), ("batch", "seq", "kv_heads", "head_dim"))  # [B, T, nkv, hd]
            v = constrain(checkpoint_name(v, "value_proj"), ("batch", "seq", "kv_heads", "head_dim"))
            if cfg.qk_norm != "none":  # Qwen3 and OLMoE normalize q and k before the rotation
                q, k = qk_norm(cfg, "q_norm", "heads")(q), qk_norm(cfg, "k_norm", "kv_heads")(k)
            positions = sequence_positions(x.shape[1])  # [T]: arange, or the context-parallel ring's order
            q = checkpoint_name(rotary_embedding(q, positions, cfg.rope_theta), "query_rotated")
            k = checkpoint_name(rotary_embedding(k, positions, cfg.rope_theta), "key_rotated")
            h = checkpoint_name(attention(q, k, v, cfg), "context")
            h = constrain(h, ("batch", "seq", "heads", "head_dim"))  # [B, T, nh, hd]
            h = dense(cfg.hidden_size, ("heads", "head_dim", "embed"), cfg, "out", axis=(-2, -1), use_bias=False)(h)
            return branch_output(cfg, checkpoint_name(h, "out_proj"), self.train)  # [B, T, H]


def swiglu(cfg: ModelConfig, h: jax.Array, width: int) -> jax.Array:
    """down(silu(gate(h)) * up(h)) of the normalized h [B, T, H], hidden width `width`: the projections gate, up and
    down of the calling module (SwiGLU's, or a mixture of experts' shared experts, jaxscale.model.moe)."""
    gate = dense(width, ("embed", "mlp"), cfg, "gate", use_bias=False)(h)  # [B, T, F]
    up = dense(width, ("embed", "mlp"), cfg, "up", use_bias=False)(h)  # [B, T, F]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    h = constrain(checkpoint_name(nn.silu(gate) * up, "mlp_hidden"), ("batch", "seq", "mlp"))  # [B, T, F]
    h = dense(cfg.hidden_size, ("mlp", "embed"), cfg, "down", use_bias=False)(h)
    return checkpoint_name(h, "mlp_down")  # [B, T, H]


class SwiGLU(nn.Module):
    """Pre-RMSNorm SwiGLU MLP: down(silu(gate(x)) * up(x)), hidden width cfg.mlp_width."""

    config: ModelConfig
    train: bool
    names_backward_reads = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        with jax.named_scope("mlp"):
            h = whole_sequence(checkpoint_name(rms_norm(cfg, "pre_norm")(x), "mlp_norm"))  # [B, T, H]
            return branch_output(cfg, swiglu(cfg, h, cfg.mlp_width), self.train)  # [B, T, H]


class LlamaBlock(ResidualBlock):
    """One Llama block: grouped-query attention then SwiGLU, each with its residual."""

    attn_block = LlamaAttention
    mlp_block = SwiGLU


class Llama(nn.Module):
    """Decoder-only Llama. Input [batch, seq] int tokens, output [batch, seq, vocab] float32 logits (or, with
    features_only, the final normalized activations [batch, seq, hidden] the head reads)."""

    config: ModelConfig
    train: bool = False
    head_bias = False  # no biases anywhere in Llama
    block = LlamaBlock  # every layer's (jaxscale.model.moe.MoELlama: the MoE block, LlamaBlock for the first dense)

    @nn.compact
    def __call__(self, tokens: jax.Array, features_only: bool = False) -> jax.Array:
        cfg = self.config
        with jax.named_scope("embed"):
            token_embed = embed(cfg, nn.initializers.normal(0.02))  # HF's init range
            tokens = to_block_order(tokens)  # the ring's load-balanced order under context parallelism
            x = nn.Dropout(cfg.dropout_rate)(token_embed(tokens), deterministic=not self.train)  # [B, T, H]
            x = constrain(x, ("batch", "stream_seq", "embed"))
        x = to_natural_order(Transformer(cfg, self.train, self.block, LlamaBlock, name="transformer")(x))
        with jax.named_scope("head"):
            x = rms_norm(cfg, "post_norm")(x)  # [B, T, H]
            return x if features_only else output_logits(cfg, x, token_embed, self.head_bias)  # [B, T, V]

"""Attention kernels shared by every family, all with grouped-query attention: the reference einsum (fp32
logits), jax.nn's (xla, cudnn), the chunked online-softmax loop (plain JAX, .chunked_attention) and the
Pallas flash kernel (.flash_attention). docs/attention.md compares them. Under context parallelism (a mesh
axis "context" of more than one device in context) the chunked kernel runs as a ring over it (.ring_attention)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxscale.config.spec import ModelConfig
from jaxscale.model.axes import mesh_axis_size
from jaxscale.model.chunked_attention import chunked_attention, default_key_block
from jaxscale.model.flash_attention import block_sizes, flash_attention
from jaxscale.model.ring_attention import BlockKernel, ring_attention


def _masked(logits: jax.Array, causal: bool) -> jax.Array:
    """Sets the logits of keys after their query to the dtype's minimum; logits [..., T, S], T == S."""
    if not causal:
        return logits
    seq = logits.shape[-1]
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))  # [T, S]
    return jnp.where(mask, logits, jnp.finfo(logits.dtype).min)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, softmax_dtype) -> jax.Array:
    """Scaled dot-product attention as the reference writes it: logits and softmax in `softmax_dtype`.

    Grouped-query attention (fewer K/V heads than query heads) groups the query heads instead of
    repeating K and V: query head h reads K/V head h // (heads // kv_heads), as jax.nn.dot_product_attention
    does. With one K/V head per query head it is the reference's plain multi-head einsum.

    Args:
      q: [batch, seq, heads, head_dim] in the compute dtype.
      k, v: [batch, seq, kv_heads, head_dim], kv_heads dividing heads.
    Returns:
      [batch, seq, heads, head_dim] in the compute dtype.
    """
    dtype = q.dtype
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = (q * (head_dim**-0.5)).astype(softmax_dtype)
    k = k.astype(softmax_dtype)
    if kv_heads == heads:
        logits = _masked(jnp.einsum("bqhd,bkhd->bhqk", q, k), causal)  # [B, nh, T, T] in softmax_dtype
        weights = nn.softmax(logits, axis=-1).astype(dtype)  # cast back after the softmax
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)  # [B, T, nh, hd]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # [B, T, nkv, g, hd]
    logits = _masked(jnp.einsum("bqkgd,bskd->bkgqs", q, k), causal)  # [B, nkv, g, T, T]
    weights = nn.softmax(logits, axis=-1).astype(dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v)  # [B, T, nkv, g, hd]
    return out.reshape(batch, seq, heads, head_dim)


def ring_kernel(cfg: ModelConfig, chunk: int, dtype) -> BlockKernel:
    """The kernel of the context-parallel ring's blocks (chunked or flash; validation allows only these), its
    blocks dividing the ring's chunk of `chunk` positions."""
    if cfg.attention == "flash":
        blocks = block_sizes(cfg.head_dim, chunk, dtype, cfg.attention_block_q, cfg.attention_block_k)
        return BlockKernel("flash", flash_blocks=blocks)
    return BlockKernel("chunked", block_k=cfg.attention_block_k or default_key_block(chunk))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Dispatches to the configured kernel; all compute the same function (K/V may have fewer heads than q).

    Args:
      q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
    Returns:
      [batch, seq, heads, head_dim].
    """
    if cfg.attention == "reference":
        return reference_attention(q, k, v, cfg.causal, jnp.dtype(cfg.softmax_dtype))
    context = mesh_axis_size("context")
    if context > 1:  # the sequence is split over a mesh axis: a ring over its devices, in the balanced order
        return ring_attention(q, k, v, cfg.causal, ring_kernel(cfg, q.shape[1] // (2 * context), q.dtype))
    if cfg.attention == "chunked":
        return chunked_attention(q, k, v, cfg.causal, cfg.attention_block_k or default_key_block(k.shape[1]))
    if cfg.attention == "flash":
        return flash_attention(q, k, v, cfg.causal, cfg.attention_block_q, cfg.attention_block_k)
    # jax.nn.dot_product_attention computes its logits and softmax in float32 for bf16/fp16 inputs and takes
    # K/V with fewer heads than the query (grouped-query attention) as they are.
    return jax.nn.dot_product_attention(q, k, v, is_causal=cfg.causal, implementation=cfg.attention)

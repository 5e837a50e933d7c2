"""Memory-efficient attention in plain JAX: a loop over key blocks with an online softmax, and a custom VJP.

Rabe & Staats (2021), "Self-attention does not need O(n^2) memory", and the FlashAttention algorithm (Dao et
al. 2022): the forward pass visits the keys `block_k` at a time, keeping per query row a running maximum m,
a running sum l of exp(logit - m) and an unnormalised output; it returns the output and each row's
log-sum-exp (lse = m + log l). The custom VJP keeps only those two beyond the inputs (q, k, v, out, lse) and
recomputes each block's probabilities exp(logit - lse) in the backward pass, so no [T, S] matrix is ever
held: memory grows linearly with the sequence on every backend, the CPU's included.

Logits, statistics and accumulators are float32 whatever the compute dtype (the output is cast back).
Grouped-query attention groups the query heads as the reference einsum does (no K/V repeat). The causal mask
is applied inside every block; blocks entirely above the diagonal are computed and masked (the loop does not
skip them), so the FLOPs are those of the reference. The output and the log-sum-exp are tagged
`attention_out` and `attention_lse` (jax.ad_checkpoint.checkpoint_name) inside the forward rule, so a remat
policy naming them keeps them and the backward pass does not rerun the forward loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config.kernel_blocks import default_key_block  # noqa: F401  (re-exported)

F32 = jnp.float32


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, nh, hd] -> [B, T, nkv, g, hd] in float32: query head h is group member h % g of K/V head h // g."""
    batch, seq, heads, head_dim = x.shape
    return x.astype(F32).reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)


def _key_blocks(x: jax.Array, block_k: int) -> jax.Array:
    """[B, S, nkv, hd] -> [S / block_k, B, block_k, nkv, hd] float32, the scan's leading axis first."""
    batch, seq, heads, head_dim = x.shape
    return jnp.moveaxis(x.astype(F32).reshape(batch, seq // block_k, block_k, heads, head_dim), 1, 0)


def _block_logits(q: jax.Array, k_block: jax.Array, start: jax.Array, causal: bool) -> jax.Array:
    """Scaled logits of every query against one key block, [B, nkv, g, T, block_k]; -inf above the diagonal.

    Args:
      q: [B, T, nkv, g, hd] float32, already multiplied by head_dim ** -0.5.
      k_block: [B, block_k, nkv, hd] float32.
      start: the block's first key position.
    """
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k_block)
    if not causal:
        return logits
    query_pos = jnp.arange(q.shape[1])[:, None]  # [T, 1]
    key_pos = start + jnp.arange(k_block.shape[1])[None, :]  # [1, block_k]
    return jnp.where(key_pos <= query_pos, logits, -jnp.inf)


def block_forward(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, block_k: int) -> tuple[jax.Array, jax.Array]:
    """(out [B, T, nh, hd] float32, lse [B, nkv, g, T] float32) by the online softmax over key blocks. q and k
    may differ in length (without the causal mask, which compares their indices). The context-parallel ring
    (jaxscale.model.ring_attention) calls it per pair of sequence chunks and merges the parts by their
    log-sum-exp."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    qg = _grouped(q, kv_heads) * head_dim**-0.5  # [B, T, nkv, g, hd]
    starts = jnp.arange(k.shape[1] // block_k) * block_k

    def visit(carry, block):
        m, total, acc = carry  # [B, nkv, g, T] x 2, [B, nkv, g, T, hd]
        start, k_block, v_block = block
        logits = _block_logits(qg, k_block, start, causal)
        m_next = jnp.maximum(m, logits.max(axis=-1))  # finite from the first block on: key 0 is always visible
        p = jnp.exp(logits - m_next[..., None])  # 0 where masked
        correction = jnp.exp(m - m_next)  # 0 on the first block (m = -inf)
        total = correction * total + p.sum(axis=-1)
        acc = correction[..., None] * acc + jnp.einsum("bkgts,bskd->bkgtd", p, v_block)
        return (m_next, total, acc), None

    group = heads // kv_heads
    stats = jnp.full((batch, kv_heads, group, seq), -jnp.inf, F32), jnp.zeros((batch, kv_heads, group, seq), F32)
    acc = jnp.zeros((batch, kv_heads, group, seq, head_dim), F32)
    blocks = (starts, _key_blocks(k, block_k), _key_blocks(v, block_k))
    (m, total, acc), _ = jax.lax.scan(visit, (*stats, acc), blocks)
    out = jnp.moveaxis(acc / total[..., None], 3, 1).reshape(batch, seq, heads, head_dim)  # [B, T, nh, hd]
    return out, m + jnp.log(total)


def block_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    causal: bool,
    block_k: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) float32 of the queries against the keys k, v: each block's probabilities recomputed as
    exp(logits - lse) (the FlashAttention-2 backward). `out`, `lse` and `d_out` are the queries' whole attention's
    (over every key, not only these): with them the result is these keys' share of the gradients, and the shares
    of disjoint key sets add up (the ring's backward)."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    scale = head_dim**-0.5
    qg = _grouped(q, kv_heads) * scale
    d_out = _grouped(d_out, kv_heads)  # [B, T, nkv, g, hd]
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out, _grouped(out, kv_heads))  # rowsum(dO * O), [B, nkv, g, T]

    def visit(dq, block):
        start, k_block, v_block = block
        p = jnp.exp(_block_logits(qg, k_block, start, causal) - lse[..., None])  # [B, nkv, g, T, bk]
        dv = jnp.einsum("bkgts,btkgd->bskd", p, d_out)  # the group's query heads summed into their K/V head
        dp = jnp.einsum("btkgd,bskd->bkgts", d_out, v_block)
        ds = p * (dp - delta[..., None])  # d(loss)/d(scaled logits)
        dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg)
        return dq + jnp.einsum("bkgts,bskd->btkgd", ds, k_block), (dk, dv)

    starts = jnp.arange(k.shape[1] // block_k) * block_k
    blocks = (starts, _key_blocks(k, block_k), _key_blocks(v, block_k))
    dq, (dk, dv) = jax.lax.scan(visit, jnp.zeros_like(qg), blocks)
    dq = (dq * scale).reshape(batch, seq, heads, head_dim)
    dk, dv = (jnp.moveaxis(d, 0, 1).reshape(k.shape) for d in (dk, dv))  # [S / bk, B, bk, ...] -> [B, S, ...]
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, block_k: int) -> jax.Array:
    """Scaled dot-product attention over key blocks of `block_k`, with a recomputing backward pass.

    Args:
      q: [batch, seq, heads, head_dim].
      k, v: [batch, seq, kv_heads, head_dim], kv_heads dividing heads.
      causal: mask keys after their query.
      block_k: keys per block; it must divide the key sequence (config validation checks it).
    Returns:
      [batch, seq, heads, head_dim] in q's dtype.
    """
    return block_forward(q, k, v, causal, block_k)[0].astype(q.dtype)


def _chunked_fwd(q, k, v, causal, block_k):
    out, lse = block_forward(q, k, v, causal, block_k)
    out, lse = checkpoint_name(out.astype(q.dtype), "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (q, k, v, out, lse)


def _chunked_bwd(causal, block_k, residuals, d_out):
    """dq, dk, dv from the inputs, out and lse (block_backward over every key), in the inputs' dtypes."""
    q, k, v, out, lse = residuals
    dq, dk, dv = block_backward(q, k, v, out, lse, d_out, causal, block_k)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


chunked_attention.defvjp(_chunked_fwd, _chunked_bwd)

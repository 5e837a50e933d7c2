"""Context parallelism's attention: a ring over the mesh axis "context", with causal load balancing.

Under context parallelism every activation's sequence is split over the `context` axis (n devices), and
attention needs every earlier key. Ring attention (Liu et al. 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context") passes the key/value blocks around the ring instead of gathering
them: at step j each device attends its own queries to the block that started j devices before it, and
merges the partial result into its running one by the log-sum-exp (the online softmax of flash attention,
one block at a time); a block moves on by `jax.lax.ppermute` while nothing else needs it. Each device holds
a 1/n share of the keys and values at any time, never the whole sequence.

**Load balancing.** With a causal mask and contiguous shares, device 0 would attend one block and device n-1
all n. The sequence is therefore cut into 2n chunks of c = T / 2n positions and device i holds chunks i and
2n-1-i (`to_balanced`, the "zigzag" order of Llama 3's context parallelism and of torchtitan's, whose
`_HeadTailLoadBalancer` does the same; Brandon et al. 2023, "Striped Attention", balance by striding instead).
The model permutes its tokens into this order once at the input (`jaxscale.model.stack.to_block_order`),
computes every position-wise layer unchanged, rotates or embeds by the permuted positions
(`balanced_positions`), and restores the natural order before the head.

**Skipping what the mask hides.** In the balanced order the local positions increase, so step 0 (a device's
own queries against its own keys) is plain causal attention over its 2c positions. At step j >= 1 the keys
come from device s = (i - j) mod n. If s < i, chunk s is before both local chunks and chunk 2n-1-s after both
(2n-1-s > 2n-1-i): every local query attends the first received chunk only, unmasked (2c x c). If s > i, both
received chunks are after local chunk i and before local chunk 2n-1-i: the second local chunk alone attends
both, unmasked (c x 2c). So every step is 2c²
query-key pairs on every device (`jax.lax.cond` on s < i), the n-1 steps after the first cost the same
everywhere and no device idles; the (2c)² of step 0 are computed with the mask as the chunked kernel does.

**Blocks.** Each (queries, keys) pair goes through a kernel that returns its log-sum-exp (`BlockKernel`): the
plain-JAX chunked one (`jaxscale.model.chunked_attention.block_forward` / `block_backward`: online softmax over
key blocks, logits in float32, grouped-query heads without repeating K/V) or the Pallas flash kernel
(`jaxscale.model.flash_attention.block_forward` / `block_backward`, model.attention=flash), so nothing of size
[T, S] is ever held. The parts are merged in float32.

**Backward.** A custom VJP around the whole ring keeps only the local q, k, v, the output and its log-sum-exp
(tagged `attention_out` / `attention_lse` as the other kernels' are, so remat policies naming them apply).
The backward runs the ring again: the key/value blocks travel with their gradient accumulators dk, dv, each
device adding its queries' share (the FlashAttention-2 backward with the global log-sum-exp and
rowsum(dO·O)), and one last hop brings every accumulator home. Communication per device and layer: forward
n-1 hops of k and v; backward n-1 hops of k, v, dk, dv and one of dk, dv, all `collective-permute`s (the
compiled HLO's `compiled_collective_collective_permute_bytes`).

`ring_attention` is called on the global arrays while a mesh and the logical-axis rules are in context (the
model's attention dispatch, jaxscale.model.attention): it runs the ring in `jax.shard_map` over q, k, v's
logical axes (batch over data and fsdp, the sequence over context, heads over tensor).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

from jaxscale.model import flash_attention
from jaxscale.model.chunked_attention import block_backward, block_forward, chunked_attention

AXIS = "context"
F32 = jnp.float32


def balanced_positions(seq: int, n: int) -> np.ndarray:
    """[seq] int32: the original position held by each slot of the balanced order (device i's slots are
    [2ic, 2(i+1)c): chunk i, then chunk 2n-1-i, of c = seq / 2n positions). Numpy: a constant of the trace."""
    chunks = np.arange(seq, dtype=np.int32).reshape(2 * n, seq // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def _split(x: jax.Array, axis: int, sizes: tuple[int, ...]) -> jax.Array:
    return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])


def to_balanced(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """x in natural order along `axis` -> the balanced order (a reshape, a reverse and an interleave, which
    XLA's partitioner moves between devices with collective-permutes when `axis` is split). n = 1: x."""
    if n == 1:
        return x
    axis %= x.ndim
    halves = _split(x, axis, (2, n, x.shape[axis] // (2 * n)))  # [.., 2, n, c, ..]: chunks 0..n-1, n..2n-1
    first = jax.lax.index_in_dim(halves, 0, axis, keepdims=False)
    last = jnp.flip(jax.lax.index_in_dim(halves, 1, axis, keepdims=False), axis)  # chunks 2n-1, .., n
    return jnp.stack([first, last], axis=axis + 1).reshape(x.shape)  # [.., n, 2, c, ..]


def from_balanced(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """The inverse of to_balanced."""
    if n == 1:
        return x
    axis %= x.ndim
    pairs = _split(x, axis, (n, 2, x.shape[axis] // (2 * n)))
    first = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    last = jnp.flip(jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False), axis)
    return jnp.stack([first, last], axis=axis).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """The kernel each (queries, keys) pair of the ring goes through: "chunked" (plain JAX, key blocks of
    `block_k`) or "flash" (the Pallas kernel with `flash_blocks`). Both give (out float32, lse [B, nkv, g, T]
    natural-log float32) forward, and float32 (dq, dk, dv) backward from the queries' whole out and lse. Their
    causal mask compares indices: the ring uses it only on a device's own 2c positions, which increase in the
    balanced order, so the indices' order is the positions'."""

    kernel: str
    block_k: int = 0
    flash_blocks: pallas_attention.BlockSizes | None = None

    def forward(self, q, k, v, causal):
        if self.kernel == "flash":
            return flash_attention.block_forward(q, k, v, causal, self.flash_blocks)
        return block_forward(q, k, v, causal, self.block_k)

    def backward(self, q, k, v, out, lse, d_out, causal):
        if self.kernel == "flash":
            return flash_attention.block_backward(q, k, v, out, lse, d_out, causal, self.flash_blocks)
        return block_backward(q, k, v, out, lse, d_out, causal, self.block_k)


def _merge(out: jax.Array, lse: jax.Array, part_out: jax.Array, part_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two softmax-weighted partial outputs over disjoint keys, combined by their log-sum-exps.

    out [B, T, nh, hd] float32; lse [B, nkv, g, T] float32 (-inf where a part saw no key)."""
    new = jnp.logaddexp(lse, part_lse)
    batch, seq, heads, _ = out.shape

    def weight(part: jax.Array) -> jax.Array:  # [B, nkv, g, T] -> [B, T, nh, 1]
        return jnp.moveaxis(jnp.exp(part - new).reshape(batch, heads, seq), 1, 2)[..., None]

    return out * weight(lse) + part_out * weight(part_lse), new


def _ring_shift(tree, n: int):
    """Every device's arrays to the next device on the ring (i -> i + 1 mod n)."""
    return jax.lax.ppermute(tree, AXIS, [(i, (i + 1) % n) for i in range(n)])


def _rows(x: jax.Array, start: int, stop: int, axis: int) -> jax.Array:
    return jax.lax.slice_in_dim(x, start, stop, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, kernel: BlockKernel, n: int) -> jax.Array:
    return _ring_fwd(q, k, v, causal, kernel, n)[0]


def _ring_fwd(q, k, v, causal, kernel, n):
    """The local queries against every device's keys, one block a step; returns out in q's dtype."""
    index = jax.lax.axis_index(AXIS)
    chunk = q.shape[1] // 2
    out, lse = kernel.forward(q, k, v, causal)  # step 0: its own keys, causal (local positions increase)

    def step(carry, j):
        out, lse, k, v = carry
        k, v = _ring_shift((k, v), n)  # now the keys of device (index - j) mod n
        if causal:
            source = (index - j) % n

            def earlier():  # every local query against the received first chunk, unmasked
                return kernel.forward(q, _rows(k, 0, chunk, 1), _rows(v, 0, chunk, 1), False)

            def later():  # the local second chunk against both received chunks; the first chunk's rows get nothing
                part_out, part_lse = kernel.forward(_rows(q, chunk, 2 * chunk, 1), k, v, False)
                none_out = jnp.zeros_like(part_out)
                none_lse = jnp.full_like(part_lse, -jnp.inf)
                return jnp.concatenate([none_out, part_out], 1), jnp.concatenate([none_lse, part_lse], 3)

            part = jax.lax.cond(source < index, earlier, later)
        else:
            part = kernel.forward(q, k, v, False)
        return (*_merge(out, lse, *part), k, v), None

    (out, lse, _, _), _ = jax.lax.scan(step, (out, lse, k, v), jnp.arange(1, n))
    out = checkpoint_name(out.astype(q.dtype), "attention_out")
    lse = checkpoint_name(lse, "attention_lse")
    return out, (q, k, v, out, lse)


def _ring_bwd(causal, kernel, n, residuals, d_out):
    """dq, dk, dv: the ring again, each key/value block travelling with its dk, dv accumulators."""
    q, k, v, out, lse = residuals
    index = jax.lax.axis_index(AXIS)
    chunk = q.shape[1] // 2
    dq, dk, dv = kernel.backward(q, k, v, out, lse, d_out, causal)

    def rows(x, start, stop):  # a range of the local queries' rows of q, out, d_out (axis 1) and lse (axis 3)
        return tuple(_rows(a, start, stop, 1) for a in x[:3]) + (_rows(x[3], start, stop, 3),)

    queries = (q, out, d_out, lse)

    def grads(query_rows, k_block, v_block):
        q_, out_, d_out_, lse_ = query_rows
        return kernel.backward(q_, k_block, v_block, out_, lse_, d_out_, False)

    def step(carry, j):
        dq, k, v, dk, dv = carry
        k, v, dk, dv = _ring_shift((k, v, dk, dv), n)
        if causal:
            source = (index - j) % n

            def earlier():  # all local queries, the received first chunk
                dq_part, dk_part, dv_part = grads(queries, _rows(k, 0, chunk, 1), _rows(v, 0, chunk, 1))
                zero = jnp.zeros_like(dk_part)
                return dq_part, jnp.concatenate([dk_part, zero], 1), jnp.concatenate([dv_part, zero], 1)

            def later():  # the local second chunk, both received chunks
                dq_part, dk_part, dv_part = grads(rows(queries, chunk, 2 * chunk), k, v)
                return jnp.concatenate([jnp.zeros_like(dq_part), dq_part], 1), dk_part, dv_part

            dq_part, dk_part, dv_part = jax.lax.cond(source < index, earlier, later)
        else:
            dq_part, dk_part, dv_part = grads(queries, k, v)
        return (dq + dq_part, k, v, dk + dk_part, dv + dv_part), None

    (dq, _, _, dk, dv), _ = jax.lax.scan(step, (dq, k, v, dk, dv), jnp.arange(1, n))
    dk, dv = _ring_shift((dk, dv), n)  # device i held the accumulators of block i + 1: one hop home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, kernel: BlockKernel) -> jax.Array:
    """Attention of q over k, v in the balanced order, the sequence split over the mesh axis "context".

    Args:
      q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] (kv_heads dividing heads), all in
        the balanced order of `to_balanced` with the context axis's size.
      kernel: the blocks' kernel; its blocks must divide seq / (2 x context) (config validation checks it).
    Returns:
      [batch, seq, heads, head_dim] in q's dtype, in the balanced order. Without a mesh in context, or with a
      context axis of one device: the kernel on the natural order.
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = 1 if mesh.empty or AXIS not in mesh.axis_names else int(mesh.shape[AXIS])
    if n == 1:
        if kernel.kernel == "flash":
            return flash_attention.flash_with_blocks(q, k, v, causal, kernel.flash_blocks)
        return chunked_attention(q, k, v, causal, kernel.block_k)
    q_spec = nn.logical_to_mesh_axes(("batch", "seq", "heads", "head_dim"))
    kv_spec = nn.logical_to_mesh_axes(("batch", "seq", "kv_heads", "head_dim"))

    def ring(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _ring(q, k, v, causal, kernel, n)

    mapped = jax.shard_map(ring, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
    return mapped(q, k, v)

"""Flash attention: JAX's Pallas kernel (`jax.experimental.pallas.ops.gpu.attention.mha`, Triton lowering).

One forward kernel (queries in blocks of `block_q` against keys in blocks of `block_k`, online softmax in
float32, writing the output and each row's log-sum-exp) and a fused backward pair (dq; dk, dv) that
recomputes the probabilities from the log-sum-exp. Nothing of size [T, S] is stored.

- **Where it runs.** On a GPU backend, and in a deviceless GPU-target compile (jaxscale.plan), the Triton
  kernels: three `__gpu$xla.gpu.triton` custom calls per layer in the compiled step. On the CPU backend the
  same kernels run in Pallas's interpret mode (`interpret=True`): plain XLA loops, slow (seconds a step at
  the `:tiny` sizes), for tests and small runs, not for timing. `lax.platform_dependent` picks the branch
  when the program is lowered, so a GPU-target plan holds the Triton kernels only.
- **Grouped-query attention.** The kernel takes as many K/V heads as query heads: K and V are repeated to
  the query heads (`jnp.repeat`, query head h reads K/V head h // group) inside this function's forward and
  backward rules, and dk, dv are summed back over each group. The repeat costs, per call, two transient
  [B, S, heads, head_dim] copies instead of [B, S, kv_heads, head_dim] (llama3.1-8b, 32 heads over 8 K/V
  heads, bf16, 8192 tokens: 2 x 64 MiB instead of 2 x 16 MiB per sequence); the residuals kept for the
  backward pass are the unrepeated k and v.
- **Block sizes.** `block_sizes` turns model.attention_block_q / _k (0: the default) into the kernel's
  BlockSizes. Default: the largest power of two at most 128 and at most 32768 / (head_dim padded to a power
  of two x the dtype's bytes) that divides the sequence; the backward kernels take min(32, block_q, block_k)
  (Pallas's own default is 128 forward, 32 backward). The forward kernel keeps a q block and two pipeline
  stages of k and v blocks in shared memory, (block_q + 4 block_k) x head_dim_padded x bytes: at head_dim
  256 and blocks of 128 (bf16) that is 320 KiB, over an H100's 227 KiB, and XLA refuses the compile.
- **Remat.** The output and the kernel's log-sum-exp are tagged `attention_out` and `attention_lse` inside
  the forward rule: a remat policy that saves them spares the backward pass a second forward kernel.
- **On a mesh.** A Triton custom call cannot be split by XLA's partitioner, so under a mesh the kernel runs
  in `jax.shard_map` over the logical axes of q, k, v (batch over data and fsdp, heads over tensor): each
  device attends its own sequences and heads.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

from jaxscale.config.kernel_blocks import (  # noqa: F401  (re-exported: the kernel's rules)
    BACKWARD_BLOCK,
    NUM_STAGES,
    SHARED_MEMORY_BYTES,
    default_block,
    forward_shared_memory,
    padded_head_dim,
)


def block_sizes(head_dim: int, seq_len: int, dtype, block_q: int = 0, block_k: int = 0) -> pallas_attention.BlockSizes:
    """The kernel's block sizes from model.attention_block_q / _k (0: default_block)."""
    itemsize = jnp.dtype(dtype).itemsize
    block_q = block_q or default_block(head_dim, seq_len, itemsize)
    block_k = block_k or default_block(head_dim, seq_len, itemsize)
    backward = min(BACKWARD_BLOCK, block_q, block_k)
    return pallas_attention.BlockSizes(
        block_q=block_q,
        block_k=block_k,
        block_q_dkv=backward,
        block_kv_dkv=backward,
        block_q_dq=backward,
        block_kv_dq=backward,
    )


def _repeat_kv(k: jax.Array, v: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
    """K and V with one head per query head: [B, S, nkv, hd] -> [B, S, heads, hd], head h from K/V head h // g."""
    group = heads // k.shape[2]
    return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def _on_platform(kernel, *args):
    """kernel(interpret)(*args): Pallas's interpret mode when lowered for the CPU, the Triton kernel otherwise."""
    return jax.lax.platform_dependent(*args, cpu=kernel(True), default=kernel(False))


def _mha_kwargs(q: jax.Array, causal: bool, blocks: pallas_attention.BlockSizes, interpret: bool) -> dict:
    return dict(
        sm_scale=q.shape[-1] ** -0.5,
        causal=causal,
        block_sizes=blocks,
        backward_pass_impl="triton",
        num_warps=None,
        num_stages=NUM_STAGES,
        grid=None,
        interpret=interpret,
        debug=False,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, blocks: pallas_attention.BlockSizes) -> jax.Array:
    return _flash_fwd(q, k, v, causal, blocks)[0]


def _flash_fwd(q, k, v, causal, blocks):
    k_rep, v_rep = _repeat_kv(k, v, q.shape[2])

    def kernel(interpret):
        return lambda *qkv: pallas_attention.mha(
            *qkv, None, **_mha_kwargs(q, causal, blocks, interpret), return_residuals=True
        )

    out, lse = _on_platform(kernel, q, k_rep, v_rep)  # [B, T, nh, hd], [B, nh, T] (base-2 log-sum-exp)
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return out, (q, k, v, out, lse)


def _flash_bwd(causal, blocks, residuals, d_out):
    return _backward(*residuals, d_out, causal, blocks)


def _backward(q, k, v, out, lse, d_out, causal, blocks):
    """dq, dk, dv (in the inputs' dtypes) by the kernel's backward pair, from q's whole attention's out and
    base-2 log-sum-exp lse [B, nh, T] (the kernel's own residuals)."""
    batch, seq, kv_heads, head_dim = k.shape
    k_rep, v_rep = _repeat_kv(k, v, q.shape[2])

    def kernel(interpret):
        def backward(q, k_rep, v_rep, out, lse, d_out):
            # The Pallas kernel's own backward rule (mha.bwd is its _mha_backward), called by keyword.
            kwargs = _mha_kwargs(q, causal, blocks, interpret)
            res = (q, k_rep, v_rep, None, out, lse)
            return pallas_attention.mha.bwd(**kwargs, return_residuals=False, res=res, do=d_out)[:3]

        return backward

    dq, dk, dv = _on_platform(kernel, q, k_rep, v_rep, out, lse, d_out)
    group = q.shape[2] // kv_heads

    def summed(d: jax.Array) -> jax.Array:  # [B, S, nh, hd] -> [B, S, nkv, hd], each group's heads added
        return d.astype(jnp.float32).reshape(batch, seq, kv_heads, group, head_dim).sum(axis=3).astype(k.dtype)

    return dq, summed(dk), summed(dv)


_flash.defvjp(_flash_fwd, _flash_bwd)

_LN2 = math.log(2.0)  # the kernel's log-sum-exp is base 2: lse_2 = lse / ln 2


def block_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, blocks: pallas_attention.BlockSizes
) -> tuple[jax.Array, jax.Array]:
    """One kernel call for a (queries, keys) pair of the context-parallel ring (jaxscale.model.ring_attention):
    (out [B, T, nh, hd] float32, lse [B, nkv, g, T] natural-log float32). q and k may differ in length;
    `causal` is the kernel's own mask (query i sees keys 0..i), which the ring uses only where both are the
    same positions in increasing order."""
    k_rep, v_rep = _repeat_kv(k, v, q.shape[2])

    def kernel(interpret):
        return lambda *qkv: pallas_attention.mha(
            *qkv, None, **_mha_kwargs(q, causal, blocks, interpret), return_residuals=True
        )

    out, lse = _on_platform(kernel, q, k_rep, v_rep)  # lse: [B, nh, T], base 2
    batch, seq, heads, _ = q.shape
    kv_heads = k.shape[2]
    return out.astype(jnp.float32), (lse * _LN2).reshape(batch, kv_heads, heads // kv_heads, seq)


def block_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    causal: bool,
    blocks: pallas_attention.BlockSizes,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) float32 of the queries against these keys, from the queries' whole attention's `out` and
    natural-log `lse` [B, nkv, g, T] (block_forward's layout): the kernel's backward pair on the pair."""
    batch, seq, heads, _ = q.shape
    lse_2 = (lse / _LN2).reshape(batch, heads, seq)
    # The fused backward pair needs as many query blocks as key blocks: a pair of unequal lengths (the ring's
    # 2c x c and c x 2c) scales the longer side's backward blocks by the ratio.
    keys, shorter = k.shape[1], min(seq, k.shape[1])
    on_q, on_kv = blocks.block_q_dq * seq // shorter, blocks.block_kv_dq * keys // shorter
    blocks = dataclasses.replace(blocks, block_q_dq=on_q, block_q_dkv=on_q, block_kv_dq=on_kv, block_kv_dkv=on_kv)
    grads = _backward(q, k, v, out.astype(q.dtype), lse_2, d_out.astype(q.dtype), causal, blocks)
    return tuple(g.astype(jnp.float32) for g in grads)


def flash_with_blocks(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, blocks: pallas_attention.BlockSizes
) -> jax.Array:
    """The kernel with its custom VJP on one device's arrays (no shard_map), at the given block sizes."""
    return _flash(q, k, v, causal, blocks)


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, block_q: int = 0, block_k: int = 0
) -> jax.Array:
    """Causal (or full) attention by the Pallas flash kernel; on a mesh in context, per device in shard_map.

    Args:
      q: [batch, seq, heads, head_dim].
      k, v: [batch, seq, kv_heads, head_dim], kv_heads dividing heads.
      block_q, block_k: the forward kernel's blocks (0: default_block); powers of two dividing seq.
    Returns:
      [batch, seq, heads, head_dim] in q's dtype.
    """
    blocks = block_sizes(q.shape[-1], q.shape[1], q.dtype, block_q, block_k)

    def call(q, k, v):
        return _flash(q, k, v, causal, blocks)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.axis_sizes) == 1:
        return call(q, k, v)
    q_spec = nn.logical_to_mesh_axes(("batch", "seq", "heads", "head_dim"))
    kv_spec = nn.logical_to_mesh_axes(("batch", "seq", "kv_heads", "head_dim"))
    mapped = jax.shard_map(call, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
    return mapped(q, k, v)

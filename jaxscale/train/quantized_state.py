"""8-bit optimizer state by block-wise dynamic quantization: Adam / AdamW whose two moments are stored in 8 bits.

Dettmers, Lewis, Shleifer, Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR 2022 (arXiv
2110.02861). A moment tensor is flattened and cut into blocks of `block_size` elements (section 2.1, block-wise
quantization: 2048). Each block is divided by its largest magnitude (its absmax, kept in float32), and each
normalized element is stored as the uint8 index of the nearest of 256 values of the dynamic quantization map
(section 1.3, dynamic tree quantization: a sign bit, an exponent given by the number of leading zero bits, an
indicator bit, a linear fraction; section 2.2, dynamic quantization: for the strictly positive second moment the
sign bit becomes a fraction bit). Dequantization is a table lookup times the block's absmax. Every step the moments
are dequantized, updated in float32 by optax's own Adam (`optax.scale_by_adam`) and quantized again, as the paper's
8-bit Adam does and bitsandbytes' `Adam8bit` (bitsandbytes/optim/optimizer.py, `Optimizer2State`): the first
moment with the signed map, the second with the unsigned one.

bitsandbytes' fused kernel updates one tensor at a time, so its float32 moments never exist for the whole model.
Here a step updates one quantized parameter after another, in a loop over chunks of whole blocks (`chunk_size`
elements, UPDATE_CHUNK_SIZE), whose float32 moments are the only ones live: written over the whole tree at once,
XLA's plan held every parameter's float32 moments together (and the quantization's temporaries), which undid most
of the saving in a model's peak. Adam and the quantization are per element and per block, so the chunks change no
formula: a parameter's update and state are bit for bit the unchunked step's on that parameter where XLA does not
fuse a multiply-add differently (its CPU backend forms fused multiply-adds by fusion, at its default optimization
level; optax's own Adam on a tree moves by an ulp when another parameter joins the tree).

As in bitsandbytes, a parameter of fewer than `min_8bit_size` elements (its default 4096) keeps float32 moments:
biases and norm scales cost little and are the most sensitive. The block size defaults to the paper's 2048, which
bitsandbytes' 8-bit optimizers used until its commit aa57bd8 (2024-09, PR #1365) moved them to 256 (more absmax
per element: 4/256 bytes instead of 4/2048); both are the `block_size` argument.

Optax (0.2.8) has no 8-bit optimizer; `adam_8bit` is the lab's, built by `jaxscale.train.step.make_optimizer` for
`optimizer.state_dtype=int8`.

On a device mesh (jaxscale.train.sharding.state_specs) an optimizer-state leaf is laid out like its parameter only
where it has the parameter's shape; the codes and absmax of a quantized moment are flat, held in a `QuantizedMoment`
node whose path no parameter ends in, so they are replicated: every device holds the whole 8-bit state. The
flattened blocks cut across the parameter's `embed` split, and splitting them needs a logical name for the block
axis and a block count padded to the splitting devices, which the layout's rules table does not have. The float32
moments of small parameters keep the parameters' layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale.config.defaults import INT8_BLOCK_SIZE, INT8_MIN_SIZE
from jaxscale.config.quantization import dynamic_map  # the map's one home (the 4-bit base reads it too)

# Elements of a quantized parameter that one iteration of the update's loop dequantizes, updates and quantizes
# (whole blocks: 2048 of INT8_BLOCK_SIZE): 16 MiB per float32 array of the chunk, so a step's float32 temporaries
# are a few such arrays, not the whole tree's moments.
UPDATE_CHUNK_SIZE = 2**22


class QuantizedMoment(NamedTuple):
    """One parameter's moment in 8 bits: the flattened elements' codes and each block's normalization constant."""

    codes: jax.Array  # uint8 [n]: element i is code[codes[i]] * absmax[i // block_size]
    absmax: jax.Array  # float32 [ceil(n / block_size)]: each block's largest magnitude (0: an all-zero block)


def _blocks(flat: jax.Array, block_size: int) -> jax.Array:
    """[n] -> [ceil(n / block_size), block_size], the last block padded with zeros."""
    count = -(-flat.size // block_size)
    return jnp.pad(flat, (0, count * block_size - flat.size)).reshape(count, block_size)


def quantize_blockwise(x: jax.Array, code: np.ndarray, block_size: int = INT8_BLOCK_SIZE) -> QuantizedMoment:
    """`x` (any shape) in 8 bits: per block of `block_size` flattened elements N_b = max |x_b|, and per element the
    index of the code nearest x / N_b (the paper's quantization, section 1.2: argmin_j |code_j - x / N_b|; ties
    go to the lower code). The nearest code is found by binary search over the 255 midpoints between neighbouring
    codes (ascending): jnp.searchsorted's unrolled scan, 8 steps (its compare_all method holds an n x 255
    comparison in XLA's CPU plan). An all-zero block has absmax 0 and the codes of 0."""
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = _blocks(flat, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    normalized = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    midpoints = (code[1:] + code[:-1]) / np.float32(2)
    codes = jnp.searchsorted(midpoints, normalized.reshape(-1), side="left", method="scan_unrolled")
    return QuantizedMoment(codes=codes[: flat.size].astype(jnp.uint8), absmax=absmax)


def dequantize_blockwise(
    moment: QuantizedMoment, code: np.ndarray, shape: tuple[int, ...], block_size: int = INT8_BLOCK_SIZE
) -> jax.Array:
    """The float32 tensor of `shape` that `moment` stores: code[codes] (a table lookup) times its block's absmax."""
    values = jnp.asarray(code)[moment.codes]
    scaled = _blocks(values, block_size) * moment.absmax[:, None]
    return scaled.reshape(-1)[: values.size].reshape(shape)


def _update_leaf(
    adam: optax.GradientTransformation,
    grad: jax.Array,
    count: jax.Array,
    mu: QuantizedMoment,
    nu: QuantizedMoment,
    block_size: int,
    chunk_blocks: int,
) -> tuple[jax.Array, QuantizedMoment, QuantizedMoment]:
    """One quantized parameter's Adam step, at most `chunk_blocks` blocks at a time: (its update, new mu, new nu).

    A fori_loop over chunks of whole blocks reads each chunk's gradient, codes and absmax from its carry (the
    flattened gradient, the old moments), dequantizes them, runs `adam.update`, quantizes the new moments and
    writes the update and the new codes and absmax back in place; the blocks after the last whole chunk (the last
    block maybe partial) are one piece after the loop. A parameter of fewer than 2 x `chunk_blocks` whole blocks
    takes chunks of half its blocks: a loop of at least two iterations, which stays a loop in XLA's program (a
    loop of one iteration was inlined), so no parameter's float32 moments are live beside another's. Without
    loops XLA's scheduler held every parameter's at once, and an optimization barrier between parameters did not
    change that, in the CPU plan or the GPU target's (XLA's CPU pipeline removes the barrier before scheduling).
    Adam and the quantization are per element and per block, and every piece is whole blocks, so the values are
    the whole tensor's.
    """
    signed, unsigned = dynamic_map(True), dynamic_map(False)

    def piece(
        g: jax.Array, m: QuantizedMoment, v: QuantizedMoment
    ) -> tuple[jax.Array, QuantizedMoment, QuantizedMoment]:
        """Adam on a flat run of whole blocks (the last maybe partial): its update, new mu, new nu."""
        mu_f32 = dequantize_blockwise(m, signed, g.shape, block_size)
        nu_f32 = dequantize_blockwise(v, unsigned, g.shape, block_size)
        update, moments = adam.update(g, optax.ScaleByAdamState(count, mu_f32, nu_f32))
        new_mu = quantize_blockwise(moments.mu, signed, block_size)
        return update, new_mu, quantize_blockwise(moments.nu, unsigned, block_size)

    def part(moment: QuantizedMoment, block: jax.Array | int, blocks: int | None = None) -> QuantizedMoment:
        """The moment from block `block` on: `blocks` blocks (a dynamic slice), or all the rest (None)."""
        if blocks is None:
            return QuantizedMoment(moment.codes[block * block_size :], moment.absmax[block:])
        return QuantizedMoment(
            jax.lax.dynamic_slice_in_dim(moment.codes, block * block_size, blocks * block_size),
            jax.lax.dynamic_slice_in_dim(moment.absmax, block, blocks),
        )

    def put(moment: QuantizedMoment, new: QuantizedMoment, block: jax.Array | int) -> QuantizedMoment:
        return QuantizedMoment(
            jax.lax.dynamic_update_slice_in_dim(moment.codes, new.codes, block * block_size, 0),
            jax.lax.dynamic_update_slice_in_dim(moment.absmax, new.absmax, block, 0),
        )

    flat = grad.reshape(-1)
    whole = flat.size // block_size  # whole blocks
    per_chunk = max(1, min(chunk_blocks, whole // 2))
    probe = (jax.ShapeDtypeStruct((block_size,), flat.dtype), jax.ShapeDtypeStruct((block_size,), jnp.float32))
    dtype = jax.eval_shape(lambda g, m, c: adam.update(g, optax.ScaleByAdamState(c, m, m))[0], *probe, count).dtype
    in_place = dtype == flat.dtype  # the update overwrites the gradient chunk by chunk (a float32 gradient)
    out = flat if in_place else jnp.zeros(flat.shape, dtype)

    def chunk(i: jax.Array, carry: tuple[jax.Array, QuantizedMoment, QuantizedMoment]):
        out, m, v = carry
        block = i * per_chunk
        g = jax.lax.dynamic_slice_in_dim(out if in_place else flat, block * block_size, per_chunk * block_size)
        update, new_m, new_v = piece(g, part(m, block, per_chunk), part(v, block, per_chunk))
        out = jax.lax.dynamic_update_slice_in_dim(out, update, block * block_size, 0)
        return out, put(m, new_m, block), put(v, new_v, block)

    chunks = whole // per_chunk
    if chunks:
        out, mu, nu = jax.lax.fori_loop(0, chunks, chunk, (out, mu, nu))
    block = chunks * per_chunk
    if block * block_size < flat.size:
        g = (out if in_place else flat)[block * block_size :]
        update, new_mu, new_nu = piece(g, part(mu, block), part(nu, block))
        out, mu, nu = out.at[block * block_size :].set(update), put(mu, new_mu, block), put(nu, new_nu, block)
    return out.reshape(grad.shape), mu, nu


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    block_size: int = INT8_BLOCK_SIZE,
    min_8bit_size: int = INT8_MIN_SIZE,
    chunk_size: int = UPDATE_CHUNK_SIZE,
) -> optax.GradientTransformation:
    """optax.scale_by_adam with its moments stored block-wise quantized (the paper's 8-bit Adam).

    Each step dequantizes mu (signed map) and nu (unsigned map), runs optax.scale_by_adam's update on them in
    float32 (so the update is Adam's on the dequantized moments), and quantizes the new moments again, one
    quantized parameter after another and `chunk_size` elements (whole blocks) at a time (_update_leaf), so the
    float32 moments of one chunk exist at a time, not the whole tree's. Parameters under `min_8bit_size` take
    optax's update together, their moments float32 as in optax.

    Args:
      b1, b2, eps, eps_root: Adam's, as optax.scale_by_adam.
      block_size: elements per block sharing one absmax (the paper's 2048, INT8_BLOCK_SIZE).
      min_8bit_size: parameters with fewer elements keep float32 moments (bitsandbytes' min_8bit_size, 4096:
        INT8_MIN_SIZE).
      chunk_size: elements a step's loop dequantizes and updates at a time, rounded down to whole blocks (at
        least one): UPDATE_CHUNK_SIZE. It changes the program's memory and loop trip count, not the values.
    Returns:
      A GradientTransformation whose state is optax.ScaleByAdamState(count, mu, nu) with each mu / nu leaf a
      QuantizedMoment, or a float32 array for a parameter under min_8bit_size.
    """
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    chunk_blocks = max(1, chunk_size // block_size)

    def quantized(x: jax.Array, code: np.ndarray) -> QuantizedMoment | jax.Array:
        return quantize_blockwise(x, code, block_size) if x.size >= min_8bit_size else x

    def store(moments: Any, code: np.ndarray) -> Any:
        return jax.tree_util.tree_map(lambda x: quantized(x, code), moments)

    def init_fn(params: Any) -> optax.ScaleByAdamState:
        state = adam.init(params)
        return state._replace(mu=store(state.mu, signed), nu=store(state.nu, unsigned))

    def update_fn(updates: Any, state: optax.ScaleByAdamState, params: Any = None):
        del params  # as optax.scale_by_adam
        grads, treedef = jax.tree_util.tree_flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        out, new_mu, new_nu = list(grads), list(mus), list(nus)
        small = [i for i, m in enumerate(mus) if not isinstance(m, QuantizedMoment)]
        if small:
            moments = optax.ScaleByAdamState(state.count, [mus[i] for i in small], [nus[i] for i in small])
            updated, moments = adam.update([grads[i] for i in small], moments)
            for j, i in enumerate(small):
                out[i], new_mu[i], new_nu[i] = updated[j], moments.mu[j], moments.nu[j]
        for i, m in enumerate(mus):
            if isinstance(m, QuantizedMoment):
                out[i], new_mu[i], new_nu[i] = _update_leaf(
                    adam, grads[i], state.count, m, nus[i], block_size, chunk_blocks
                )
        count = adam.update([], optax.ScaleByAdamState(state.count, [], []))[1].count  # optax's own increment
        moments = optax.ScaleByAdamState(count, treedef.unflatten(new_mu), treedef.unflatten(new_nu))
        return treedef.unflatten(out), moments

    return optax.GradientTransformation(init_fn, update_fn)


def adam_8bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float | None = None,
    block_size: int = INT8_BLOCK_SIZE,
    min_8bit_size: int = INT8_MIN_SIZE,
    chunk_size: int = UPDATE_CHUNK_SIZE,
) -> optax.GradientTransformation:
    """Adam (weight_decay None) or AdamW (decoupled weight decay, optax.adamw's chain and order) with 8-bit moments:
    scale_by_adam_8bit, then optax.add_decayed_weights for AdamW, then the learning rate."""
    adam = scale_by_adam_8bit(
        b1=b1, b2=b2, eps=eps, block_size=block_size, min_8bit_size=min_8bit_size, chunk_size=chunk_size
    )
    parts = [adam]
    if weight_decay is not None:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)

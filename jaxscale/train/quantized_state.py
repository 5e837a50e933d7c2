"""8-bit optimizer state by block-wise dynamic quantization: Adam / AdamW whose two moments are stored in 8 bits.

Dettmers, Lewis, Shleifer, Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR 2022 (arXiv
2110.02861). A moment tensor is cut into blocks of `block_size` consecutive (row-major) elements (section 2.1,
block-wise quantization: 2048). Each block is divided by its largest magnitude (its absmax, kept in float32), and each
normalized element is stored as the uint8 index of the nearest of 256 values of the dynamic quantization map
(section 1.3, dynamic tree quantization: a sign bit, an exponent given by the number of leading zero bits, an
indicator bit, a linear fraction; section 2.2, dynamic quantization: for the strictly positive second moment the
sign bit becomes a fraction bit). Dequantization is a table lookup times the block's absmax. Every step the moments
are dequantized, updated in float32 by optax's own Adam (`optax.scale_by_adam`) and quantized again, as the paper's
8-bit Adam does and bitsandbytes' `Adam8bit` (bitsandbytes/optim/optimizer.py, `Optimizer2State`): the first
moment with the signed map, the second with the unsigned one.

bitsandbytes' fused kernel updates one tensor at a time, so its float32 moments never exist for the whole model.
Here a step updates one quantized parameter after another, in a loop over chunks of whole blocks (at most
`chunk_size` elements, UPDATE_CHUNK_SIZE, where the axes' divisors allow), whose float32 moments are the only ones
live: written over the whole tree at once, XLA's plan held every parameter's float32 moments together (and the
quantization's temporaries), which undid most of the saving in a model's peak. Adam and the quantization are per
element and per block, so the chunks change no formula: a parameter's update and state are bit for bit the
unchunked step's on that parameter where XLA does not fuse a multiply-add differently (its CPU backend forms fused
multiply-adds by fusion, at its default optimization level; optax's own Adam on a tree moves by an ulp when another
parameter joins the tree).

As in bitsandbytes, a parameter of fewer than `min_8bit_size` elements (its default 4096) keeps float32 moments:
biases and norm scales cost little and are the most sensitive. The block size defaults to the paper's 2048, which
bitsandbytes' 8-bit optimizers used until its commit aa57bd8 (2024-09, PR #1365) moved them to 256 (more absmax
per element: 4/256 bytes instead of 4/2048); both are the `block_size` argument.

Optax (0.2.8) has no 8-bit optimizer; `adam_8bit` is the lab's, built by `jaxscale.train.step.make_optimizer` for
`optimizer.state_dtype=int8`.

The codes keep the parameter's shape, so that a device mesh splits them as it splits the parameter
(jaxscale.train.sharding.state_specs gives them the parameter's logical names: fsdp, tensor and expert splits, and
the ZeRO stages' rules, as for float32 moments). The blocks are cut along the smallest trailing run of the parameter's
axes whose elements are a whole number of blocks (jaxscale.config.quantization.moment_blocks: for a [layers, embed,
mlp] kernel the mlp axis when it is a multiple of 2048, else embed x mlp): the axes before it (the prefix) index whole
runs, and the absmax has the prefix's axes and names and one unnamed axis of the run's blocks (absmax_layout). Those
blocks are exactly the flattened tensor's cut every `block_size` elements, so the values are those of a flat layout
bit for bit, on one device or any mesh. A mesh that splits an axis of the run splits blocks between devices: each
then holds part of a block's codes, its absmax is a maximum over the devices (a small float32 collective) and its
codes stay where they are. Where no run is a whole number of blocks (GPT-2's 50257 x 768 embedding, a stacked bias
of 12 x 2304) the moment is stored flat as before, codes [n] and absmax [ceil(n / block_size)], the last block
partial, and the layout replicates it on every device.

The update's loop takes its chunks strided, not contiguous (`_chunk_counts`): chunk (i0, i1, ...) holds the indices
i0, i0 + k0, i0 + 2 k0, ... of the first axis of the blocked view, and so on, so a device's slice of a split axis
(contiguous) holds its share of every chunk, and the loop reads and writes each device's own codes in place, with
no gather of the codes where a device's share of the run is whole blocks (tests/train/test_sharding_devices.py
lists the uint8 collectives on 8 simulated devices: the tiny model's fused qkv kernel, whose fsdp shares are not,
is gathered).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxscale.config.defaults import INT8_BLOCK_SIZE, INT8_MIN_SIZE
from jaxscale.config.quantization import (  # the map's and the blocks' one home (the 4-bit base, the memory model)
    absmax_layout,
    dynamic_map,
    moment_blocks,
)
from jaxscale.config.spec import MESH_AXES
from jaxscale.model.axes import mesh_axis_size

# Elements of a quantized parameter that one iteration of the update's loop dequantizes, updates and quantizes
# (whole blocks: 2048 of INT8_BLOCK_SIZE): 16 MiB per float32 array of the chunk, so a step's float32 temporaries
# are a few such arrays, not the whole tree's moments.
UPDATE_CHUNK_SIZE = 2**22


class QuantizedMoment(NamedTuple):
    """One parameter's moment in 8 bits: each element's code and each block's normalization constant.

    Blocked (jaxscale.config.quantization.moment_blocks gives the run's first axis s): codes uint8 of the parameter's
    shape, absmax float32 [*shape[:s], prod(shape[s:]) / block_size]. Flat (no run is whole blocks): codes uint8 [n],
    absmax float32 [ceil(n / block_size)]. Either way element i of the flattened tensor is
    code[codes.flat[i]] * absmax.flat[i // block_size] (an all-zero block has absmax 0)."""

    codes: jax.Array
    absmax: jax.Array


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """`x` viewed as its blocks, [*prefix, blocks, *block] (a reshape; the blocks' axes are _lead's): blocked, where
    the run's later axes divide a block (moment_blocks' run shape[s:], L = prod(shape[s + 1:]) divides block_size),
    [*prefix, shape[s] / c, c, *shape[s + 1:]] with c = block_size / L, a block c indices of the run's first axis and
    the whole of the later axes, which keep their own axes (a mesh's split of one of them stays a split of the view,
    and a block's maximum a reduction over it); else [*prefix, blocks, block_size]; flat, [ceil(n / block_size),
    block_size], the last block padded with zeros. The shape of `x` decides (a parameter's, or its codes')."""
    start = moment_blocks(x.shape, block_size)
    if start is None:
        count = -(-x.size // block_size)
        return jnp.pad(x.reshape(-1), (0, count * block_size - x.size)).reshape(count, block_size)
    later = math.prod(x.shape[start + 1 :])
    if block_size % later == 0:
        c = block_size // later
        return x.reshape(*x.shape[:start], x.shape[start] // c, c, *x.shape[start + 1 :])
    return x.reshape(*x.shape[:start], -1, block_size)


def _lead(shape: tuple[int, ...], block_size: int) -> int:
    """How many leading axes of _blocks' view of a tensor of `shape` index its blocks (the absmax's axes): the
    prefix's and the blocks' axis."""
    start = moment_blocks(shape, block_size)
    return 1 if start is None else start + 1


def _per_block(absmax: jax.Array, view: jax.Array) -> jax.Array:
    """The absmax [*prefix, blocks] broadcast against _blocks' view (trailing unit axes)."""
    return absmax.reshape(*absmax.shape, *(1,) * (view.ndim - absmax.ndim))


def _stored(blocks: jax.Array, shape: tuple[int, ...], block_size: int) -> jax.Array:
    """_blocks' inverse for a tensor of `shape`: its shape (blocked), or its n flattened elements (flat)."""
    if moment_blocks(shape, block_size) is None:
        return blocks.reshape(-1)[: math.prod(shape)]
    return blocks.reshape(shape)


def quantize_blockwise(x: jax.Array, code: np.ndarray, block_size: int = INT8_BLOCK_SIZE) -> QuantizedMoment:
    """`x` (any shape) in 8 bits: per block of `block_size` consecutive elements N_b = max |x_b|, and per element the
    index of the code nearest x / N_b (the paper's quantization, section 1.2: argmin_j |code_j - x / N_b|; ties
    go to the lower code). The nearest code is found by binary search over the 255 midpoints between neighbouring
    codes (ascending): jnp.searchsorted's unrolled scan, 8 steps (its compare_all method holds an n x 255
    comparison in XLA's CPU plan). An all-zero block has absmax 0 and the codes of 0. The layout is
    QuantizedMoment's: blocked where a trailing run of axes is whole blocks, else flat."""
    blocks = _blocks(x.astype(jnp.float32), block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=tuple(range(_lead(x.shape, block_size), blocks.ndim)))
    normalized = blocks / _per_block(jnp.where(absmax > 0, absmax, 1.0), blocks)
    midpoints = (code[1:] + code[:-1]) / np.float32(2)
    codes = jnp.searchsorted(midpoints, normalized, side="left", method="scan_unrolled").astype(jnp.uint8)
    return QuantizedMoment(codes=_stored(codes, x.shape, block_size), absmax=absmax)


def dequantize_blockwise(
    moment: QuantizedMoment, code: np.ndarray, shape: tuple[int, ...], block_size: int = INT8_BLOCK_SIZE
) -> jax.Array:
    """The float32 tensor of `shape` that `moment` stores: code[codes] (a table lookup) times its block's absmax."""
    values = jnp.asarray(code)[moment.codes]
    blocks = _blocks(values, block_size)
    scaled = blocks * _per_block(moment.absmax, blocks)
    return _stored(scaled, shape, block_size).reshape(shape)


def moment_specs(moment: QuantizedMoment, param_shape: tuple[int, ...], names: PartitionSpec) -> QuantizedMoment:
    """The logical names of a QuantizedMoment (arrays or shapes) kept for a parameter of `param_shape` named `names`
    (jaxscale.train.sharding.state_specs): blocked at INT8_BLOCK_SIZE (the optimizer's, make_optimizer's), the codes
    the parameter's names and the absmax absmax_layout's; flat, or of another block size, replicated."""
    layout = absmax_layout(tuple(param_shape), tuple(names), INT8_BLOCK_SIZE)
    if layout is None or moment.codes.shape != tuple(param_shape) or moment.absmax.shape != layout[0]:
        return QuantizedMoment(codes=PartitionSpec(), absmax=PartitionSpec())
    return QuantizedMoment(codes=names, absmax=PartitionSpec(*layout[1]))


def _piece(
    adam: optax.GradientTransformation,
    count: jax.Array,
    g: jax.Array,
    m: QuantizedMoment,
    v: QuantizedMoment,
    block_size: int,
) -> tuple[jax.Array, QuantizedMoment, QuantizedMoment]:
    """Adam on whole blocks (a flat run's last block maybe partial): the gradient `g` and its moments in
    QuantizedMoment's layout for g's shape. Returns its update, new mu, new nu."""
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    mu_f32 = dequantize_blockwise(m, signed, g.shape, block_size)
    nu_f32 = dequantize_blockwise(v, unsigned, g.shape, block_size)
    update, moments = adam.update(g, optax.ScaleByAdamState(count, mu_f32, nu_f32))
    new_mu = quantize_blockwise(moments.mu, signed, block_size)
    return update, new_mu, quantize_blockwise(moments.nu, unsigned, block_size)


def _update_dtype(adam: optax.GradientTransformation, grad: jax.Array, count: jax.Array, block_size: int) -> Any:
    """The dtype of Adam's update of a gradient of grad's dtype (float32 moments)."""
    probe = (jax.ShapeDtypeStruct((block_size,), grad.dtype), jax.ShapeDtypeStruct((block_size,), jnp.float32))
    return jax.eval_shape(lambda g, m, c: adam.update(g, optax.ScaleByAdamState(c, m, m))[0], *probe, count).dtype


def _chunk_counts(dims: tuple[int, ...], chunks: int, ways: int = 1) -> tuple[int, ...]:
    """Into how many strided chunks each axis of a blocked view [*dims, block] is cut, so that there are at least
    `chunks` in all where the axes' divisors allow: greedily from the first axis, each takes the divisor k of
    d / gcd(d, ways) that is at least what is still needed with the fewest factors of two, then the smallest (the
    largest such divisor where none is); 1 once enough are cut.

    A chunk holds d / k of the axis (indices i, i + k, ...), and a device's contiguous slice of an axis split w
    ways holds its share of every chunk where w divides d / k. `ways` is the most devices that split the model
    state in the mesh in context (`_state_ways`); any split w of the axis divides gcd(d, ways), which every d / k
    keeps, so no chunk is indexed across the devices of a split axis (where it was, the partitioner gathered the
    whole tensor every iteration: Mixtral 8x7B's experts, 8 an axis over 8 expert devices, planned 138.5 GiB a
    GPU against float32 Adam's 110.8). Within that, k keeps as many of d's factors of two in d / k as it can
    (the vocabulary's 32000 x 4096 embedding in 125 chunks of 256 rows, not 128 of 250)."""
    counts = []
    for d in dims:
        if chunks <= 1:
            counts.append(1)
            continue
        free = d // math.gcd(d, ways)  # the part of the axis no split of the state can take
        allowed = [k for k in range(1, free + 1) if free % k == 0]
        enough = [k for k in allowed if k >= chunks]
        k = min(enough, key=lambda k: (k & -k, k)) if enough else max(allowed)
        counts.append(k)
        chunks = -(-chunks // k)
    return tuple(counts)


def _state_ways() -> int:
    """The most devices of the mesh in context that split a parameter's optimizer state (every axis but data, which
    the state never splits: jaxscale.config.layout_rules); 1 without a mesh."""
    return math.prod(mesh_axis_size(axis) for axis in MESH_AXES if axis != "data")


def _update_blocked(
    adam: optax.GradientTransformation,
    grad: jax.Array,
    count: jax.Array,
    mu: QuantizedMoment,
    nu: QuantizedMoment,
    block_size: int,
    chunk_blocks: int,
) -> tuple[jax.Array, QuantizedMoment, QuantizedMoment]:
    """_update_leaf for a blocked moment: a fori_loop over strided chunks of the blocked view [*dims, *block]
    (_blocks; _chunk_counts: at least two, and at most `chunk_blocks` blocks each where the axes' divisors allow).
    Every axis d cut k ways is viewed as [d / k, k] (a reshape) and a chunk takes one index of each k: a dynamic
    slice of the loop's carry (the update, over the gradient where it has its dtype, and the moments' codes and
    absmax), written back in place. No axis a mesh splits is indexed dynamically; where a device's share of the
    blocks' run is whole blocks it updates its own codes (tensors whose blocks straddle the shares are gathered:
    tests/train/test_sharding_devices.py lists them)."""
    g = _blocks(grad, block_size)
    dims = g.shape[: _lead(grad.shape, block_size)]
    ways = _state_ways()  # a chunk of about `chunk_blocks` blocks a device where the state is split that many ways
    counts = _chunk_counts(dims, max(2, -(-math.prod(dims) // (chunk_blocks * ways))), ways)
    cut = [n for d, k in zip(dims, counts, strict=True) for n in (d // k, k)]
    sizes = [n for d, k in zip(dims, counts, strict=True) for n in (d // k, 1)]

    def strided(x: jax.Array) -> jax.Array:  # [*dims, *rest] -> [d0 / k0, k0, d1 / k1, k1, ..., *rest]
        return x.reshape(*cut, *x.shape[len(dims) :])

    def starts(index: tuple[jax.Array, ...], rest: int) -> list:
        return [s for i in index for s in (0, i)] + [0] * rest

    def take(x: jax.Array, index: tuple[jax.Array, ...]) -> jax.Array:
        """Chunk `index` of a strided array: [d0 / k0, d1 / k1, ..., *rest]."""
        rest = x.shape[len(cut) :]
        chunk = jax.lax.dynamic_slice(x, starts(index, len(rest)), [*sizes, *rest])
        return chunk.reshape(*sizes[::2], *rest)

    def put(x: jax.Array, chunk: jax.Array, index: tuple[jax.Array, ...]) -> jax.Array:
        rest = x.shape[len(cut) :]
        return jax.lax.dynamic_update_slice(x, chunk.reshape(*sizes, *rest), starts(index, len(rest)))

    dtype = _update_dtype(adam, grad, count, block_size)
    in_place = dtype == grad.dtype  # the update overwrites the gradient chunk by chunk (a float32 gradient)
    g = strided(g)
    moments = (_blocks(mu.codes, block_size), mu.absmax, _blocks(nu.codes, block_size), nu.absmax)
    carry = (g if in_place else jnp.zeros(g.shape, dtype), *(strided(x) for x in moments))

    def chunk(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out, m_codes, m_absmax, v_codes, v_absmax = carry
        index = jnp.unravel_index(i, counts)
        # a chunk [*sizes, *block] is a tensor whose run is one block: its absmax [*sizes, 1]
        m = QuantizedMoment(take(m_codes, index), take(m_absmax, index)[..., None])
        v = QuantizedMoment(take(v_codes, index), take(v_absmax, index)[..., None])
        update, new_m, new_v = _piece(adam, count, take(out if in_place else g, index), m, v, block_size)
        return (put(out, update, index), put(m_codes, new_m.codes, index), put(m_absmax, new_m.absmax, index),
                put(v_codes, new_v.codes, index), put(v_absmax, new_v.absmax, index))  # fmt: skip

    out, m_codes, m_absmax, v_codes, v_absmax = jax.lax.fori_loop(0, math.prod(counts), chunk, carry)
    shape = grad.shape
    return (out.reshape(shape), QuantizedMoment(m_codes.reshape(shape), m_absmax.reshape(dims)),
            QuantizedMoment(v_codes.reshape(shape), v_absmax.reshape(dims)))  # fmt: skip


def _update_flat(
    adam: optax.GradientTransformation,
    grad: jax.Array,
    count: jax.Array,
    mu: QuantizedMoment,
    nu: QuantizedMoment,
    block_size: int,
    chunk_blocks: int,
) -> tuple[jax.Array, QuantizedMoment, QuantizedMoment]:
    """_update_leaf for a flat moment: a fori_loop over contiguous chunks of whole blocks reads each chunk's
    gradient, codes and absmax from its carry (the flattened gradient, the old moments) and writes the update and
    the new codes and absmax back in place; the blocks after the last whole chunk (the last block partial) are one
    piece after the loop."""

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
    dtype = _update_dtype(adam, grad, count, block_size)
    in_place = dtype == flat.dtype  # the update overwrites the gradient chunk by chunk (a float32 gradient)
    out = flat if in_place else jnp.zeros(flat.shape, dtype)

    def chunk(i: jax.Array, carry: tuple[jax.Array, QuantizedMoment, QuantizedMoment]):
        out, m, v = carry
        block = i * per_chunk
        g = jax.lax.dynamic_slice_in_dim(out if in_place else flat, block * block_size, per_chunk * block_size)
        update, new_m, new_v = _piece(adam, count, g, part(m, block, per_chunk), part(v, block, per_chunk), block_size)
        out = jax.lax.dynamic_update_slice_in_dim(out, update, block * block_size, 0)
        return out, put(m, new_m, block), put(v, new_v, block)

    chunks = whole // per_chunk
    if chunks:
        out, mu, nu = jax.lax.fori_loop(0, chunks, chunk, (out, mu, nu))
    block = chunks * per_chunk
    if block * block_size < flat.size:
        g = (out if in_place else flat)[block * block_size :]
        update, new_mu, new_nu = _piece(adam, count, g, part(mu, block), part(nu, block), block_size)
        out, mu, nu = out.at[block * block_size :].set(update), put(mu, new_mu, block), put(nu, new_nu, block)
    return out.reshape(grad.shape), mu, nu


def _update_leaf(
    adam: optax.GradientTransformation,
    grad: jax.Array,
    count: jax.Array,
    mu: QuantizedMoment,
    nu: QuantizedMoment,
    block_size: int,
    chunk_blocks: int,
) -> tuple[jax.Array, QuantizedMoment, QuantizedMoment]:
    """One quantized parameter's Adam step, about `chunk_blocks` blocks at a time: (its update, new mu, new nu).

    Each chunk's gradient, codes and absmax are read from the loop's carry, dequantized, updated by `adam.update`,
    quantized and written back in place (_update_blocked, _update_flat). A parameter of fewer than 2 x
    `chunk_blocks` blocks takes at least two chunks: a loop of at least two iterations stays a loop in XLA's program
    (a loop of one iteration was inlined), so no parameter's float32 moments are live beside another's. Without loops
    XLA's scheduler held every parameter's at once, and an optimization barrier between parameters did not change
    that, in the CPU plan or the GPU target's (XLA's CPU pipeline removes the barrier before scheduling). Adam and
    the quantization are per element and per block, and every chunk is whole blocks, so the values are the whole
    tensor's.
    """
    blocked = moment_blocks(grad.shape, block_size) is not None
    return (_update_blocked if blocked else _update_flat)(adam, grad, count, mu, nu, block_size, chunk_blocks)


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
    quantized parameter after another and about `chunk_size` elements (whole blocks) at a time (_update_leaf), so the
    float32 moments of one chunk exist at a time, not the whole tree's. Parameters under `min_8bit_size` take
    optax's update together, their moments float32 as in optax.

    Args:
      b1, b2, eps, eps_root: Adam's, as optax.scale_by_adam.
      block_size: elements per block sharing one absmax (the paper's 2048, INT8_BLOCK_SIZE).
      min_8bit_size: parameters with fewer elements keep float32 moments (bitsandbytes' min_8bit_size, 4096:
        INT8_MIN_SIZE).
      chunk_size: elements a step's loop dequantizes and updates at a time, rounded down to whole blocks (at
        least one; more where a blocked moment's axes have no divisor that fits, _chunk_counts): UPDATE_CHUNK_SIZE.
        It changes the program's memory and loop trip count, not the values.
    Returns:
      A GradientTransformation whose state is optax.ScaleByAdamState(count, mu, nu) with each mu / nu leaf a
      QuantizedMoment (blocked in the parameter's shape, or flat), or a float32 array for a parameter under
      min_8bit_size.
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

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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale.config.defaults import INT8_BLOCK_SIZE, INT8_MIN_SIZE


@functools.cache
def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """The 2**total_bits values of the dynamic quantization map, ascending, float32 (read-only).

    The values of bitsandbytes' `create_dynamic_map(signed, max_exponent_bits, total_bits)` (bitsandbytes/
    functional.py, bitsandbytes-foundation/bitsandbytes @95f9af3): for each exponent e = 0 ... max_exponent_bits - 1
    the midpoints of 2**(e + total_bits - 1 - max_exponent_bits) equal bins of [0.1, 1] (twice as many unsigned),
    times 10**(e - max_exponent_bits + 1), negated too when signed; then 0 and 1. At 8 bits: signed, 127 positive
    values, 127 negative ones (the most negative -0.99297), 0 and 1; unsigned, 254 positive values, 0 and 1.
    Computed in float64 and rounded once to float32 (bitsandbytes computes in float32: a value may differ by an
    ulp).
    """
    non_sign_bits = total_bits - 1  # bitsandbytes' count, signed or not: unsigned, the sign bit adds fraction bins
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1  # bins of the exponent-less case (0 at 8 bits, 7 exponents)
    values: list[float] = []

    def bins(count: int, scale: float) -> None:
        edges = np.linspace(0.1, 1.0, count + 1)
        means = scale * (edges[:-1] + edges[1:]) / 2
        values.extend(means)
        if signed:
            values.extend(-means)

    for e in range(max_exponent_bits):
        bins(2 ** (e + non_sign_bits - max_exponent_bits + (0 if signed else 1)), 10.0 ** (e - max_exponent_bits + 1))
    if extra > 0:
        bins(extra, 1.0)  # bitsandbytes' loop variable left at its last exponent: 10**0
    values += [0.0, 1.0]
    values += [0.0] * (2**total_bits - len(values))
    code = np.sort(np.asarray(values, np.float64)).astype(np.float32)
    code.setflags(write=False)
    return code


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


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    block_size: int = INT8_BLOCK_SIZE,
    min_8bit_size: int = INT8_MIN_SIZE,
) -> optax.GradientTransformation:
    """optax.scale_by_adam with its moments stored block-wise quantized (the paper's 8-bit Adam).

    Each step dequantizes mu (signed map) and nu (unsigned map), runs optax.scale_by_adam's update on them in
    float32 (so the update is Adam's on the dequantized moments), and quantizes the new moments again.

    Args:
      b1, b2, eps, eps_root: Adam's, as optax.scale_by_adam.
      block_size: elements per block sharing one absmax (the paper's 2048, INT8_BLOCK_SIZE).
      min_8bit_size: parameters with fewer elements keep float32 moments (bitsandbytes' min_8bit_size, 4096:
        INT8_MIN_SIZE).
    Returns:
      A GradientTransformation whose state is optax.ScaleByAdamState(count, mu, nu) with each mu / nu leaf a
      QuantizedMoment, or a float32 array for a parameter under min_8bit_size.
    """
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    signed, unsigned = dynamic_map(True), dynamic_map(False)

    def quantized(x: jax.Array, code: np.ndarray) -> QuantizedMoment | jax.Array:
        return quantize_blockwise(x, code, block_size) if x.size >= min_8bit_size else x

    def store(moments: Any, code: np.ndarray) -> Any:
        return jax.tree_util.tree_map(lambda x: quantized(x, code), moments)

    def load(moments: Any, like: Any, code: np.ndarray) -> Any:
        def one(ref: jax.Array, moment: Any) -> jax.Array:
            if isinstance(moment, QuantizedMoment):
                return dequantize_blockwise(moment, code, ref.shape, block_size)
            return moment

        return jax.tree_util.tree_map(one, like, moments, is_leaf=lambda x: isinstance(x, QuantizedMoment))

    def init_fn(params: Any) -> optax.ScaleByAdamState:
        state = adam.init(params)
        return state._replace(mu=store(state.mu, signed), nu=store(state.nu, unsigned))

    def update_fn(updates: Any, state: optax.ScaleByAdamState, params: Any = None):
        full = state._replace(mu=load(state.mu, updates, signed), nu=load(state.nu, updates, unsigned))
        updates, full = adam.update(updates, full, params)
        return updates, full._replace(mu=store(full.mu, signed), nu=store(full.nu, unsigned))

    return optax.GradientTransformation(init_fn, update_fn)


def adam_8bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float | None = None,
    block_size: int = INT8_BLOCK_SIZE,
    min_8bit_size: int = INT8_MIN_SIZE,
) -> optax.GradientTransformation:
    """Adam (weight_decay None) or AdamW (decoupled weight decay, optax.adamw's chain and order) with 8-bit moments:
    scale_by_adam_8bit, then optax.add_decayed_weights for AdamW, then the learning rate."""
    parts = [scale_by_adam_8bit(b1=b1, b2=b2, eps=eps, block_size=block_size, min_8bit_size=min_8bit_size)]
    if weight_decay is not None:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)

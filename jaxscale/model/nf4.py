"""A 4-bit frozen base (QLoRA): projection kernels and stacked experts stored as NF4 codes, dequantized at use.

Dettmers, Pagnoni, Holtzman, Zettlemoyer, "QLoRA: Efficient Finetuning of Quantized LLMs", NeurIPS 2023 (arXiv
2305.14314), section 3, as bitsandbytes implements it (`quantize_4bit(..., quant_type="nf4",
compress_statistics=True)`, bitsandbytes/functional.py):

- **NF4 codes**: a kernel is flattened (row-major) and cut into blocks of 64 weights (NF4_BLOCK_SIZE); each block
  keeps its largest magnitude (absmax) and each weight the 4-bit index of the NF4 value
  (jaxscale.config.quantization.nf4_map) nearest to weight / absmax, two indices a byte (the even element in the high
  nibble, as bitsandbytes packs them).
- **Double quantization**: the float32 absmaxes, less their mean (one float32 offset per kernel), are quantized
  block-wise again: blocks of 256 (ABSMAX_BLOCK_SIZE), a float32 scale (the block's absmax) each and a uint8 index
  of the signed 8-bit dynamic map (bitsandbytes' `quantize_blockwise` default) per absmax. Per weight: 4 bits +
  8/64 + 32/(64 · 256) = 4.127 bits, the paper's 0.127 bits of constants (0.5 of 4 without it).
- **Dequantization** is two table lookups and two multiplies, in float32, cast to the compute dtype.

`Nf4Weight` is what `TrainState.frozen` holds at a projection's `kernel` (jaxscale.train.step.split_params, with
finetune.frozen_dtype=nf4). Flax hands a stored parameter to its module through `AxisMetadata.unbox` (and checks
its shape there), so `Nf4Weight` is such a box: its `unbox` returns an `Nf4Kernel`, a view with the kernel's shape,
which nn.DenseGeneral passes untouched through `precision.keep_kernel_dtype` to its `dot_general`; there
`precision.weight_dot_general` hands it to `dot_general` below, which dequantizes the kernel inside the layer (under
nn.scan one layer's bf16 kernel at a time) and whose backward pass keeps the 4-bit codes, not the dequantized
kernel, as its residual (bitsandbytes' MatMul4Bit does the same), dequantizing again for the input's gradient. A
frozen kernel has no gradient. A mixture of experts' stacked weights [E, H, F] (jaxscale.model.moe.Experts) are NF4
too, each expert quantized apart as each layer is (a leading dim of the arrays: jaxscale.config.finetune.nf4_stacked);
Experts returns their view as it is and each expert matmul (an einsum, ragged_dot) goes through `linear`, the same
custom VJP as `dot_general`. nn.scan stacks the codes of every layer on a leading axis like any parameter
(`remove_axis` / `add_axis` keep the box's static kernel shape in step). On a mesh the arrays' leading dims carry
the logical names of the kernel's stacked dims (`names`: "layers" under nn.scan, "expert" for stacked experts), so
the layout splits a mixture of experts' codes over mesh.expert as it splits its bf16 twin's experts: each device
holds its own experts' codes. A kernel's own axes are not split (its blocks cut across them): every device that
holds a kernel holds its codes whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxscale.config.quantization import ABSMAX_BLOCK_SIZE, NF4_BLOCK_SIZE, dynamic_map, nf4_map


def _midpoints(code: np.ndarray) -> np.ndarray:
    """The boundaries between neighbouring values of an ascending map: the nearest value to x is the number of
    boundaries below it (ties to the lower value, as bitsandbytes' kernels' `x > threshold` tests)."""
    return (code[1:] + code[:-1]) / np.float32(2)


def _nearest(normalized: jax.Array, code: np.ndarray) -> jax.Array:
    """uint8 index of the value of `code` nearest each element (binary search over the midpoints)."""
    return jnp.searchsorted(_midpoints(code), normalized, side="left", method="scan_unrolled").astype(jnp.uint8)


def _blockwise(flat: jax.Array, block_size: int, code: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """[n] float32 -> (uint8 indices [n], float32 absmax [ceil(n / block_size)]): each block divided by its largest
    magnitude (an all-zero block by 1), each element the index of its nearest value of `code`."""
    count = -(-flat.size // block_size)
    blocks = jnp.pad(flat, (0, count * block_size - flat.size)).reshape(count, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    normalized = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    return _nearest(normalized.reshape(-1)[: flat.size], code), absmax


def _per_block(values: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
    """[n] values times the scale of their block of `block_size`: [n] float32."""
    count = scales.size
    blocks = jnp.pad(values, (0, count * block_size - values.size)).reshape(count, block_size)
    return (blocks * scales[:, None]).reshape(-1)[: values.size]


class Nf4Weight(struct.PyTreeNode, nn.meta.AxisMetadata):
    """A kernel in NF4 with double-quantized absmax (arrays per kernel; a leading [experts] for stacked experts, and
    under nn.scan a leading [layers] before it).

    Attributes:
      codes: uint8 [..., ceil(n / 64) · 32]: two NF4 indices a byte, element 2i in the high nibble (n the kernel's
        elements; the last block padded with zeros).
      absmax_codes: uint8 [..., ceil(n / 64)]: each block's absmax, less `absmax_offset`, as an index of the signed
        dynamic map, scaled by its group's `absmax_scales`.
      absmax_scales: float32 [..., ceil(n / 64 / 256)]: each group of 256 blocks' largest |absmax - offset|.
      absmax_offset: float32 [...]: the mean of the kernel's block absmaxes.
      shape: the kernel's shape (with the leading [layers] while stacked), static.
      names: the logical axis names of the leading stacked dims (as many as `stacked`; jaxscale.config.finetune
        .nf4_stacked_names), which the layout splits every array's leading dims by; static.
    """

    codes: jax.Array
    absmax_codes: jax.Array
    absmax_scales: jax.Array
    absmax_offset: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    names: tuple[str | None, ...] = struct.field(pytree_node=False, default=())

    @property
    def stacked(self) -> int:
        """Leading dims the arrays carry beyond one kernel's (nn.scan's stacked layers, a stacked experts' E)."""
        return self.absmax_offset.ndim

    @property
    def sharding(self) -> Any:
        """Where the codes lie (every array alike: split by the stacked dims' `names`), so a float kernel loaded for
        this one goes to the same devices."""
        return self.codes.sharding

    def unbox(self) -> Nf4Kernel:
        return Nf4Kernel(self)

    def partition_specs(self) -> Nf4Weight:
        """This weight with a PartitionSpec of logical names in place of each array: its leading stacked dims named
        (`names`), the rest of each array unsplit."""
        spec = jax.sharding.PartitionSpec(*self.names)
        return self.replace(codes=spec, absmax_codes=spec, absmax_scales=spec, absmax_offset=spec)

    def replace_boxed(self, val: Any) -> Nf4Weight:
        raise TypeError("an NF4 kernel is frozen: nothing replaces its value")

    def add_axis(self, index: int, params: dict[Any, Any]) -> Nf4Weight:
        """nn.scan's stacking of the layers (axis 0): the arrays carry it already, the static shape gains it."""
        if index != 0:
            raise ValueError(f"NF4 kernels stack on axis 0 only (nn.scan's variable_axes), got {index}")
        name = params.get(nn.PARTITION_NAME) if params else None
        return self.replace(shape=(self.absmax_offset.shape[0], *self.shape), names=(name, *self.names))

    def remove_axis(self, index: int, params: dict[Any, Any]) -> Nf4Weight:
        if index != 0:
            raise ValueError(f"NF4 kernels stack on axis 0 only (nn.scan's variable_axes), got {index}")
        return self.replace(shape=self.shape[1:], names=self.names[1:])


class Nf4Kernel:
    """The view of an Nf4Weight a module receives as its kernel: its shape for Flax's check, its arrays for
    `dot_general` (not a pytree: it lives only between the module's parameter lookup and its matmul)."""

    def __init__(self, weight: Nf4Weight):
        self.weight = weight
        self.shape = weight.shape


def _quantize_one(kernel: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One kernel's (codes, absmax_codes, absmax_scales, absmax_offset), as Nf4Weight holds them."""
    flat = kernel.reshape(-1).astype(jnp.float32)
    indices, absmax = _blockwise(flat, NF4_BLOCK_SIZE, nf4_map())
    zero = int(np.flatnonzero(nf4_map() == 0)[0])  # the last block's padding holds the code of 0
    indices = jnp.pad(indices, (0, absmax.size * NF4_BLOCK_SIZE - flat.size), constant_values=zero)
    codes = (indices[0::2] << 4) | indices[1::2]  # [blocks · 32]
    offset = jnp.mean(absmax)
    absmax_codes, absmax_scales = _blockwise(absmax - offset, ABSMAX_BLOCK_SIZE, dynamic_map(True))
    return codes, absmax_codes, absmax_scales, offset


def quantize(kernel: jax.Array, stacked: int = 0, names: tuple[str | None, ...] = ()) -> Nf4Weight:
    """`kernel` [*lead, ...] (float) as NF4 with double-quantized absmax, each of its `stacked` leading dims (nn.scan's
    layers, stacked experts) quantized apart: the frozen base's form (module docstring); `names`: those dims' logical
    names (none: unnamed, every device holds the arrays whole)."""
    if names and len(names) != stacked:
        raise ValueError(f"{len(names)} names {names} for {stacked} stacked dims")
    fn = _quantize_one
    for _ in range(stacked):
        fn = jax.vmap(fn)
    return Nf4Weight(*fn(kernel), shape=tuple(kernel.shape), names=tuple(names) or (None,) * stacked)


def _dequantize_one(leaves: tuple[jax.Array, ...], shape: tuple[int, ...], dtype: Any) -> jax.Array:
    codes, absmax_codes, absmax_scales, offset = leaves
    absmax = _per_block(jnp.asarray(dynamic_map(True))[absmax_codes], absmax_scales, ABSMAX_BLOCK_SIZE) + offset
    indices = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(-1)  # [blocks · 64]
    values = _per_block(jnp.asarray(nf4_map())[indices], absmax, NF4_BLOCK_SIZE)
    return values[: int(np.prod(shape))].reshape(shape).astype(dtype)


def _dequantize_leaves(leaves: tuple[jax.Array, ...], shape: tuple[int, ...], dtype: Any) -> jax.Array:
    stacked = leaves[3].ndim
    fn = functools.partial(_dequantize_one, shape=shape[stacked:], dtype=dtype)
    for _ in range(stacked):
        fn = jax.vmap(fn)
    return fn(leaves)


def dequantize(weight: Nf4Weight, dtype: Any = jnp.float32) -> jax.Array:
    """The kernel `weight` stores, [*shape] in `dtype`: NF4 value x its block's absmax (itself dequantized: dynamic map
    value x its group's scale + the offset), computed in float32."""
    return _dequantize_leaves(_leaves(weight), weight.shape, dtype)


def _leaves(weight: Nf4Weight) -> tuple[jax.Array, ...]:
    return weight.codes, weight.absmax_codes, weight.absmax_scales, weight.absmax_offset


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _linear(fn: Callable, shape: tuple, x_shape: tuple, x_dtype: Any, x: jax.Array, consts: tuple, *leaves: jax.Array):
    return fn(x, _dequantize_leaves(leaves, shape, x.dtype), *consts)


def _linear_fwd(fn, shape, x_shape, x_dtype, x, consts, *leaves):
    return _linear(fn, shape, x_shape, x_dtype, x, consts, *leaves), (consts, leaves)  # the 4-bit codes, not the kernel


def _linear_bwd(fn, shape, x_shape, x_dtype, residuals, g):
    consts, leaves = residuals
    w = _dequantize_leaves(leaves, shape, x_dtype)  # dequantized again, as in the forward pass
    transpose = jax.linear_transpose(lambda x_: fn(x_, w, *consts), jax.ShapeDtypeStruct(x_shape, x_dtype))
    (dx,) = transpose(g.astype(x_dtype))
    return (dx, _no_cotangent(consts), *_no_cotangent(leaves))


def _no_cotangent(tree: Any) -> Any:
    """Zero cotangents for what is not differentiated (the frozen codes, integer operands): float0 for integers."""
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0) if jnp.issubdtype(a.dtype, jnp.integer) else jnp.zeros_like(a)  # noqa: E731
    return jax.tree_util.tree_map(zero, tree)


_linear.defvjp(_linear_fwd, _linear_bwd)


def linear(fn: Callable[..., jax.Array], x: jax.Array, kernel: Nf4Kernel, *consts: jax.Array) -> jax.Array:
    """`fn(x, w, *consts)`, linear in `x`, with `w` the NF4 kernel dequantized to x's dtype inside it (under nn.scan one
    layer's at a time); the backward pass gives x's gradient only (the kernel is frozen; `consts`, e.g. ragged_dot's
    group sizes, are not differentiated), dequantizing again from the 4-bit codes, which are its residual in place of
    the dequantized kernel (bitsandbytes' MatMul4Bit does the same).

    Args:
      fn: the matmul (lax.dot_general with its dims, an einsum, lax.ragged_dot), linear in its first argument.
      x: [...] in the compute dtype.
      kernel: the view of an Nf4Weight a module received.
      consts: further operands of `fn`, not differentiated.
    """
    w = kernel.weight
    return _linear(fn, w.shape, tuple(x.shape), x.dtype, x, consts, *_leaves(w))


def dot_general(x: jax.Array, kernel: Nf4Kernel, dims: Any, precision: Any = None) -> jax.Array:
    """nn.DenseGeneral's matmul with an NF4 kernel: `x` [..., in...] (the compute dtype) times the kernel dequantized
    to x's dtype, [..., out...] (`linear`)."""
    return linear(functools.partial(lax.dot_general, dimension_numbers=dims, precision=precision), x, kernel)


def nbytes(weight: Nf4Weight) -> int:
    """Bytes the kernel holds: its codes, absmax codes, scales and offset."""
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in _leaves(weight))


def unbox(tree: Any) -> Any:
    """nn.meta.unbox (every logical-name box stripped) leaving each Nf4Weight as it is: an NF4 kernel's own `unbox`
    is its use by a module, not its storage."""

    def strip(x: Any) -> Any:
        return x if isinstance(x, Nf4Weight) else nn.meta.unbox(x)

    return jax.tree_util.tree_map(strip, tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))

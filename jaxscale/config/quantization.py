"""The data types of block-wise quantization, one home for the 8-bit optimizer state and the 4-bit frozen base.

- `dynamic_map`: bitsandbytes' 8-bit dynamic (tree) quantization map (Dettmers et al. 2022, arXiv 2110.02861): the
  8-bit Adam's moments (jaxscale.train.quantized_state) and, signed, the second level of QLoRA's double
  quantization.
- `nf4_map`: the 16 values of the 4-bit NormalFloat data type (Dettmers et al. 2023, "QLoRA: Efficient Finetuning
  of Quantized LLMs", arXiv 2305.14314, section 3), the frozen base's codes (jaxscale.model.nf4).
- `moment_blocks`, `absmax_layout`: where the 8-bit Adam's blocks lie in a moment of a given shape, and the shape and
  logical names of its absmax: the optimizer (jaxscale.train.quantized_state), the layout (jaxscale.train.sharding)
  and the analytic memory model (jaxscale.measure.memory) read the one rule from here.

Tables only (NumPy, float32, read-only), with the block sizes QLoRA quantizes in, and the blocks' layout: the model,
the train step and the analytic memory model read them from here.
"""

from __future__ import annotations

import functools
import math
import statistics

import numpy as np

# QLoRA (section 3 and bitsandbytes' quantize_4bit defaults): NF4 codes per block of NF4_BLOCK_SIZE weights, each
# block's absmax double-quantized to 8 bits (the signed dynamic map) per block of ABSMAX_BLOCK_SIZE absmax values,
# with one float32 scale per such block and one float32 offset (the absmaxes' mean) per tensor.
NF4_BLOCK_SIZE = 64
ABSMAX_BLOCK_SIZE = 256
# bitsandbytes' create_normal_map offset: the mean of 1 - 1/(2 * 15) and 1 - 1/(2 * 16), the outermost quantile
# of the 15 and 16 equal-probability bins of the negative and positive halves (QLoRA, section 3).
NF4_OFFSET = 0.9677083


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


@functools.cache
def nf4_map() -> np.ndarray:
    """The 16 NF4 values, ascending from -1 to 1 with an exact 0, float32 (read-only).

    QLoRA's construction (section 3, "4-bit NormalFloat Quantization"), as bitsandbytes' `create_normal_map(offset
    =0.9677083, use_extra_value=True)` builds it: the standard normal quantiles of 8 equally spaced probabilities
    from NF4_OFFSET to 1/2 (the last, 0, dropped) for the positive half and of 7 for the negative half, negated,
    plus one 0, all divided by the largest (each half's extreme becomes 1 or -1). Asymmetric: 8 positive values, 7
    negative ones. The probabilities are float32 and the quantiles rounded to float32 before the division, as
    bitsandbytes computes them (its torch.linspace and torch.Tensor); the quantiles themselves in float64: 15
    values are bitsandbytes' table exactly, -0.6961928 within 4 float32 ulps.
    """
    ppf = statistics.NormalDist().inv_cdf
    positive = [ppf(float(p)) for p in np.linspace(NF4_OFFSET, 0.5, 9, dtype=np.float32)[:-1]]
    negative = [-ppf(float(p)) for p in np.linspace(NF4_OFFSET, 0.5, 8, dtype=np.float32)[:-1]]
    values = np.sort(np.asarray([*positive, 0.0, *negative], np.float32))
    code = values / values.max()
    code.setflags(write=False)
    return code


def moment_blocks(shape: tuple[int, ...], block_size: int) -> int | None:
    """The first axis of the blocks of an 8-bit moment of `shape`: the start of the smallest trailing run of axes whose
    elements are a whole number of blocks of `block_size` (len(shape) - 1 where the last axis is), or None where no
    run is (the moment is stored flat, the last block partial).

    The blocks are cut along that run, row-major, and the axes before it (the prefix) index whole runs: the blocks
    are exactly those of the flattened tensor cut every `block_size` elements, while the codes keep the parameter's
    shape and the prefix its axes, so a mesh splits them as it splits the parameter (jaxscale.train.quantized_state).
    """
    elements = 1
    for start in range(len(shape) - 1, -1, -1):
        elements *= shape[start]
        if elements % block_size == 0:
            return start
    return None


def absmax_layout(
    shape: tuple[int, ...], names: tuple[str | None, ...], block_size: int
) -> tuple[tuple[int, ...], tuple[str | None, ...]] | None:
    """(shape, logical names) of the absmax of an 8-bit moment of a parameter of `shape` named `names`: the prefix's
    axes and names (moment_blocks) and one axis of the run's blocks, unnamed; None where the moment is flat.

    The blocks' axis is unnamed (whole on every device that holds a share of the prefix): a split of it would need
    the mesh's ways to divide the number of blocks, which a logical name cannot promise for every mesh. It is 4 bytes
    per `block_size` elements of the codes (1/512 of float32 moments' bytes at 2048)."""
    start = moment_blocks(shape, block_size)
    if start is None:
        return None
    names = tuple(names) + (None,) * (len(shape) - len(names))
    return (*shape[:start], math.prod(shape[start:]) // block_size), (*names[:start], None)

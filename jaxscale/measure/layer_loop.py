"""What scanned layers keep for the backward pass, read from the compiled program: the stacked outputs of the forward
pass's loop over the layers.

Under nn.scan the forward pass is one while loop over the layers; every value a layer keeps for its backward pass
leaves the loop as a stacked output, [layers, batch, ...positions...] (its weights, also stacked, have no batch
and position dimensions). `saved_bytes` sums those outputs: the bytes all layers keep, exactly as XLA compiled
them, whatever the remat policy (docs/measurements.md, "What a layer keeps"). Unrolled layers have no such loop
(None): their kept bytes are measured from plans at several sizes instead (experiments/layer_bytes.py).
"""

from __future__ import annotations

import math
import re

from jaxscale.measure import hlo


def _forward_layer_loops(module: hlo.Module) -> list[hlo.Instruction]:
    """The while loops of the forward pass over the transformer's layers (a differentiated scan inside the model,
    not its transpose), in every computation."""
    return [
        instruction
        for computation in module.computations.values()
        for instruction in computation.values()
        if instruction.opcode == "while" and "/transformer/" in instruction.op_name
        and "jvp(" in instruction.op_name and "transpose(" not in instruction.op_name
    ]  # fmt: skip


def saved_bytes(text: str, layers: int, batch: int, seq: int, slots: tuple[int, int] | None = None) -> int | None:
    """Bytes the forward layer loop of a compiled step writes out for the backward pass: its results shaped
    [layers, batch, ...] with a dimension of `seq` positions among the rest, or a mixture of experts' slots [layers,
    batch, experts, capacity, ...] (the capacity and scatter dispatches' tokens and the experts' intermediates, which
    have no position dimension) (one per loop; None where there is no such loop, or several).

    Args:
      text: the optimized HLO (compiled.as_text()).
      layers: the layer count the loop runs over.
      batch: sequences per minibatch on one device.
      seq: positions per sequence on one device.
      slots: (experts, capacity) of the slot tensors on one device, None for a model without them.
    """
    loops = _forward_layer_loops(hlo.parse(text))
    if len(loops) != 1:
        return None

    def per_token(dims: tuple[int, ...]) -> bool:
        return seq in dims[2:] or (slots is not None and tuple(dims[2:4]) == slots)

    return sum(
        hlo.DTYPE_BYTES[dtype] * math.prod(dims)
        for dtype, dims in hlo.arrays(loops[0].shape)
        if len(dims) > 2 and dims[0] == layers and dims[1] == batch and per_token(dims)
    )


# jaxscale.model.pipeline's loop: a while under its scope, not inside another while there (its stages' layer loops)
_PIPELINE_LOOP = re.compile(r"/pipeline/(?:(?!while/).)*while$")


def pipeline_iterations(text: str) -> int | None:
    """The trip count of a pipelined stack's forward loop over its iterations (jaxscale.model.pipeline: v·m + p - 1
    with m microbatches, p stages and v visits), read from the compiled program; None without a pipeline (or without a
    known trip count).

    Args:
      text: the optimized HLO (compiled.as_text()).

    Returns:
      The iterations (the largest, should a step hold several pipelines: one per minibatch's accumulation is the
      same loop).
    """
    trips = [
        instruction.trip_count
        for computation in hlo.parse(text).computations.values()
        for instruction in computation.values()
        if instruction.opcode == "while" and _PIPELINE_LOOP.search(instruction.op_name)
        and "transpose(" not in instruction.op_name
    ]  # fmt: skip
    known = [trip for trip in trips if trip is not None]
    return max(known) if known else None


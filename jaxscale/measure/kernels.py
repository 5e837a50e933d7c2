"""The kernels a compiled step launches, read from its optimized HLO: what each does, how often, its FLOPs and bytes.

`kernels(hlo_text)` walks the program as it executes (jaxscale.measure.hlo.executed: loop bodies with their
trip counts) and returns one `Kernel` per sequence step that runs on the device: GEMMs (cuBLAS custom
calls, Triton GEMM fusions, a CPU's dot fusions), fused attention (jaxscale.measure.attention_calls: the Pallas
flash kernels' Triton calls and cuDNN's fMHA calls), other fusions (by their kind), copies, dynamic-update-slices
and collectives. Tuples, bitcasts, parameters, constants and control flow launch
nothing and are left out. For each kernel:

- flops: a GEMM's 2 · output elements · contracted size (the same count as hlo.matmul_flops); a fused
  attention call's matmuls from its shapes (attention_calls); for other kernels one FLOP per element per
  arithmetic op inside (a reduce: per input element);
- flop_dtype: which peak the FLOPs run at: "f8" (FP8 operands), "bf16"/"f16" (tensor cores), "tf32" (a float32
  dot at DEFAULT
  precision), "f32" (a float32 dot at HIGHEST), "vector" (elementwise work, CUDA cores / SIMD units);
- bytes_read, bytes_written: at the kernel's boundary. A fusion reads a parameter in full unless it only
  slices it (dynamic-slice, slice, gather: the slices' bytes) or updates it in place (the buffer of a
  dynamic-update-slice: nothing read; the operand of a scatter: the elements its updates combine with); a
  dynamic-update-slice or a scatter writes only its update. XLA updates both in place: buffer assignment
  gives the fusion's output the operand's buffer (HloDataflowAnalysis::CanShareOperandBufferWithUser), and
  where the operand is still needed it copies it first, a copy listed as its own kernel;
- collective: (kind, devices per group, full buffer bytes) from jaxscale.measure.collectives.launched, the
  parse behind the row's compiled_collective_* columns, so the predictor costs the collectives the row counts.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxscale.measure import attention_calls, collectives, hlo

# Launch nothing: structure, aliasing and control flow (the bodies' kernels are listed themselves), and the
# -done/-update ops of async pairs (the -start or async-start is the kernel: collectives.launched).
_FREE = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional", "after-all",
    "partition-id", "replica-id", "add-dependency", "opt-barrier", "domain",
}  # fmt: skip
_ASYNC_ENDS = ("-done", "-update")
_ARITHMETIC = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "exponential-minus-one", "log",
    "log-plus-one", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "power", "negate", "abs", "compare", "select",
    "clamp", "erf", "sine", "cosine", "atan2", "remainder", "floor", "ceil", "round-nearest-even", "sign",
}  # fmt: skip
_SLICERS = {"dynamic-slice", "slice", "gather"}
_FUSION_KIND = re.compile(r'"kind":"([^"]+)"')
_LEGACY_KIND = re.compile(r"\bkind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_PRECISION = re.compile(r"operand_precision[=:]\{?\[?([^}\]]*)")
CATEGORIES = ("matmul", "attention", "fusion", "copy", "dynamic_update_slice", "collective")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One device kernel of the step (per launch), with how many times one step launches it."""

    name: str
    category: str  # one of CATEGORIES
    detail: str  # what launches it: the custom-call target, the fusion's kind, or the opcode
    trips: tuple[int | None, ...]  # trip counts of the loops that hold it, outermost first
    times: int  # launches per step (the product of trips, unknown ones taken as 1)
    flops: float
    flop_dtype: str  # "bf16", "f16", "tf32", "f32" (matmul peaks) or "vector" (elementwise)
    bytes_read: int
    bytes_written: int
    gemm: tuple[int, int, int, int] | None = None  # (batch, m, n, k) of a GEMM
    collective: tuple[str, int, int] | None = None  # (kind, devices per group, full buffer bytes): collectives.py
    # (matmuls, batch, heads, q_len, kv_len, head_dim, causal) of a fused attention call (attention_calls.Call);
    # causal None: the HLO does not say (resolve_causal)
    attention: tuple | None = None
    # An async collective (a -start or async-start): (first, last) indices into kernels()'s list of the kernels
    # the program runs between its start and its -done, which may hide it (first > last: none); None: the
    # collective is synchronous (or its -done was not found), nothing hides it.
    window: tuple[int, int] | None = None
    # Bytes of its operands and results in host memory (layout S(5): jaxscale.train.offload): what crosses the
    # host link (PCIe) per launch. A host transfer (a copy-start between memory spaces, async like a collective:
    # `window`) moves its array; a kernel that reads a host buffer in place (XLA lets a GPU kernel read pinned host
    # memory) reads it over the link.
    host_bytes: int = 0
    dtype: str = ""  # element type of the kernel's largest result array ("bf16", "f32", ...; "" unknown)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _ints(attributes: str, *keys: str) -> list[int]:
    for key in keys:
        found = hlo._int_list(attributes, key)
        if found or re.search(rf"\b{key}\b", attributes):
            return found
    return []


def gemm_dims(dot: hlo.Instruction, computation: dict[str, hlo.Instruction]) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot or GEMM custom call: batch and contracted sizes, and the free sizes."""
    lhs = hlo.dims(computation[dot.operands[0]].shape) if dot.operands[0] in computation else ()
    rhs = (
        hlo.dims(computation[dot.operands[1]].shape) if len(dot.operands) > 1 and dot.operands[1] in computation else ()
    )
    a = dot.attributes
    lhs_batch = _ints(a, "lhs_batch_dims", "lhs_batch_dimensions")
    lhs_contract = _ints(a, "lhs_contracting_dims", "lhs_contracting_dimensions")
    rhs_batch = _ints(a, "rhs_batch_dims", "rhs_batch_dimensions")
    rhs_contract = _ints(a, "rhs_contracting_dims", "rhs_contracting_dimensions")

    def size(shape: tuple[int, ...], picked: list[int]) -> int:
        return math.prod(shape[i] for i in picked if i < len(shape))

    def free(shape: tuple[int, ...], *used: list[int]) -> int:
        taken = {i for group in used for i in group}
        return math.prod(d for i, d in enumerate(shape) if i not in taken)

    return (size(lhs, lhs_batch), free(lhs, lhs_batch, lhs_contract), free(rhs, rhs_batch, rhs_contract),
            size(lhs, lhs_contract))  # fmt: skip


def gemm_dtype(dot: hlo.Instruction, computation: dict[str, hlo.Instruction]) -> str:
    """The peak a dot runs at: its operand type; float32 is TF32 unless its precision is HIGHEST."""
    lhs = computation.get(dot.operands[0])
    dtype = hlo.element_type(lhs.shape) if lhs is not None else hlo.element_type(dot.shape)
    if dtype in ("bf16", "f16"):
        return dtype
    if dtype.startswith("f8"):
        return "f8"  # e4m3 / e5m2 operands: the FP8 tensor peak (model.fp8)
    precision = _PRECISION.search(dot.attributes)
    if "tf32" in dot.attributes:
        return "tf32"
    return "f32" if precision and "highest" in precision.group(1).lower() else "tf32"


def _users(computation: dict[str, hlo.Instruction]) -> dict[str, list[hlo.Instruction]]:
    users: dict[str, list[hlo.Instruction]] = {}
    for instruction in computation.values():
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)
    return users


def _scatter_updates(instruction: hlo.Instruction, computation: dict[str, hlo.Instruction]) -> int | None:
    """Bytes of a single-operand scatter's updates (operand, indices, updates), else None."""
    if instruction.opcode != "scatter" or len(instruction.operands) != 3:
        return None
    return hlo.shape_bytes(computation[instruction.operands[2]].shape)


def _read_bytes(name: str, users: dict[str, list[hlo.Instruction]], full: int, computation: dict) -> int:
    """Bytes a fused computation reads of value `name`: its slices, nothing if updated in place (what a scatter
    combines its updates with), else all."""
    total = 0
    for user in users.get(name, []):
        updates = _scatter_updates(user, computation)
        if user.opcode in ("bitcast", "reshape"):
            total += _read_bytes(user.name, users, full, computation)
        elif user.opcode in _SLICERS and user.operands[0] == name:
            total += hlo.shape_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == name:
            continue  # the buffer updated in place: only the update moves
        elif updates is not None and user.operands[0] == name:
            total += updates  # updated in place: the elements the updates combine with
        else:
            return full
    return min(total, full)


def _written_bytes(name: str, computation: dict[str, hlo.Instruction]) -> int:
    """Bytes a fused computation writes for value `name`: the update of an in-place update, else all of it."""
    instruction = computation[name]
    if instruction.opcode == "tuple":
        return sum(_written_bytes(o, computation) for o in instruction.operands)
    if instruction.opcode == "bitcast":
        return _written_bytes(instruction.operands[0], computation)
    if instruction.opcode == "dynamic-update-slice":
        return hlo.shape_bytes(computation[instruction.operands[1]].shape)
    updates = _scatter_updates(instruction, computation)
    return hlo.shape_bytes(instruction.shape) if updates is None else updates


def fusion_bytes(fused: dict[str, hlo.Instruction]) -> tuple[int, int]:
    """(bytes read, bytes written) at the boundary of a fused computation (see this module's docstring)."""
    users = _users(fused)
    read = sum(_read_bytes(p.name, users, hlo.shape_bytes(p.shape), fused) for p in fused.values()
               if p.opcode == "parameter")  # fmt: skip
    root = list(fused)[-1]  # the ROOT is the computation's last instruction in XLA's text
    return read, _written_bytes(root, fused)


def vector_flops(fused: dict[str, hlo.Instruction]) -> float:
    """Elementwise FLOPs of a fused computation: one per output element of each arithmetic op, one per
    input element of each reduce."""
    flops = 0
    for instruction in fused.values():
        if instruction.opcode in _ARITHMETIC:
            flops += math.prod(hlo.dims(instruction.shape))
        elif instruction.opcode in ("reduce", "reduce-window") and instruction.operands:
            operand = fused.get(instruction.operands[0])
            flops += math.prod(hlo.dims(operand.shape)) if operand is not None else 0
    return float(flops)


def _fusion_kind(instruction: hlo.Instruction) -> str:
    found = _FUSION_KIND.search(instruction.attributes) or _LEGACY_KIND.search(instruction.attributes)
    return found.group(1) if found else "fusion"


def _dots(fused: dict[str, hlo.Instruction]) -> list[hlo.Instruction]:
    return [i for i in fused.values() if i.opcode == "dot"]


def _gemm_kernel(dot: hlo.Instruction, holder: dict[str, hlo.Instruction], **fields) -> Kernel:
    """A GEMM kernel from its dot (or cuBLAS call) and the computation holding the dot's operands."""
    return Kernel(
        category="matmul",
        flops=float(hlo.matmul_flops(dot, holder)),
        flop_dtype=gemm_dtype(dot, holder),
        gemm=gemm_dims(dot, holder),
        **fields,
    )


def _collective(found: collectives.Collective, num_partitions: int, **fields) -> Kernel:
    """A collective's kernel, from the same parse as the row's compiled_collective_* columns."""
    # A collective-permute names pairs, not groups: the block of devices they reach (collectives.pair_span), else any
    # device of the program.
    group = found.group_size if found.group_size is not None else found.pair_span or num_partitions
    return Kernel(category="collective", detail=found.kind, flops=0.0, flop_dtype="vector",
                  bytes_read=found.operand_bytes, bytes_written=found.result_bytes,
                  collective=(found.kind, group, found.bytes), **fields)  # fmt: skip


def _custom_call(instruction: hlo.Instruction, computation: dict, **fields) -> Kernel:
    target_match = _TARGET.search(instruction.attributes)
    target = target_match.group(1) if target_match else "custom-call"
    # A cuBLAS call returns (result, s8[] workspace); the workspace is scratch, not traffic.
    written = sum(
        hlo.DTYPE_BYTES[t] * math.prod(d)
        for t, d in hlo.arrays(instruction.shape)
        if t != "s8" or not hlo.is_matmul(instruction)
    )
    read = hlo.operand_bytes(instruction, computation)
    if hlo.is_matmul(instruction):
        return _gemm_kernel(instruction, computation, detail=target, bytes_read=read, bytes_written=written, **fields)
    call = attention_calls.parse(instruction, computation)
    if call is not None:
        return Kernel(category="attention", detail=call.kernel, flops=call.flops, flop_dtype=call.dtype,
                      bytes_read=read, bytes_written=written, attention=call.as_tuple(), **fields)  # fmt: skip
    return Kernel(category="fusion", detail=target, flops=0.0, flop_dtype="vector", bytes_read=read,
                  bytes_written=written, **fields)  # fmt: skip


def _fusion(instruction: hlo.Instruction, module: hlo.Module, memo: dict, **fields) -> Kernel:
    callee = next((c for role, c in instruction.callees if role == "calls"), "")
    fused = module.computations.get(callee, {})
    kind = _fusion_kind(instruction)
    read, written = fusion_bytes(fused) if fused else (0, hlo.shape_bytes(instruction.shape))
    dots = _dots(fused)
    if dots:
        largest = max(dots, key=lambda d: hlo.matmul_flops(d, fused))
        gemm = _gemm_kernel(largest, fused, detail=kind, bytes_read=read, bytes_written=written, **fields)
        return dataclasses.replace(gemm, flops=float(sum(hlo.matmul_flops(d, fused) for d in dots)))
    category = hlo.category(instruction, module, memo)
    category = category if category in ("copy", "dynamic_update_slice", "collective") else "fusion"
    return Kernel(category=category, detail=kind, flops=vector_flops(fused), flop_dtype="vector", bytes_read=read,
                  bytes_written=written, **fields)  # fmt: skip


def _plain(instruction: hlo.Instruction, computation: dict, **fields) -> Kernel:
    """An unfused op: a copy or slice moves its result; an update (a dynamic-update-slice, a scatter) moves its
    update; others read all, write all."""
    op = instruction.opcode.removesuffix("-start")
    out = hlo.shape_bytes(instruction.shape)
    if op in ("copy", "transpose", "dynamic-slice", "slice", "reshape"):
        return Kernel(category="copy", detail=op, flops=0.0, flop_dtype="vector", bytes_read=out, bytes_written=out,
                      **fields)  # fmt: skip
    if op == "dynamic-update-slice":
        update = hlo.shape_bytes(computation[instruction.operands[1]].shape)
        return Kernel(category="dynamic_update_slice", detail=op, flops=0.0, flop_dtype="vector",
                      bytes_read=update, bytes_written=update, **fields)  # fmt: skip
    if hlo.is_matmul(instruction):
        read = hlo.operand_bytes(instruction, computation)
        return _gemm_kernel(instruction, computation, detail=op, bytes_read=read, bytes_written=out, **fields)
    updates = _scatter_updates(instruction, computation)
    if updates is not None:  # in place: the updates and indices in, the elements they combine with, the updates out
        indices = hlo.shape_bytes(computation[instruction.operands[1]].shape)
        return Kernel(category="fusion", detail=op, flops=0.0, flop_dtype="vector",
                      bytes_read=2 * updates + indices, bytes_written=updates, **fields)  # fmt: skip
    flops = vector_flops(
        {instruction.name: instruction, **{o: computation[o] for o in instruction.operands if o in computation}}
    )
    return Kernel(category="fusion", detail=op, flops=flops, flop_dtype="vector",
                  bytes_read=hlo.operand_bytes(instruction, computation), bytes_written=out, **fields)  # fmt: skip


def result_dtype(shape: str) -> str:
    """The element type of the largest array in an instruction's result shape ("" for none)."""
    found = hlo.arrays(shape)
    if not found:
        return ""
    return max(found, key=lambda a: hlo.DTYPE_BYTES[a[0]] * math.prod(a[1]))[0]


def kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel one execution of the compiled program launches, in program order.

    Args:
      hlo_text: `compiled.as_text()` (optimized HLO; a GPU target's or this machine's).
    Returns:
      One Kernel per launching instruction of every executed computation, with its loops' trip counts.
    """
    module = hlo.parse(hlo_text)
    memo: dict[str, set[str]] = {}
    found: list[Kernel] = []
    started: dict[tuple[str, str], int] = {}  # (computation, -start's name) -> its collective's index in found
    for step in hlo.executed(module):
        instruction = step.instruction
        if instruction.opcode.endswith("-done"):
            for operand in instruction.operands:
                index = started.pop((step.computation, operand), None)
                if index is not None:  # the kernels launched since the start run while the collective does
                    found[index] = dataclasses.replace(found[index], window=(index + 1, len(found) - 1))
            continue
        if instruction.opcode in _FREE or instruction.opcode.endswith(_ASYNC_ENDS):
            continue
        computation = module.computations[step.computation]
        fields = dict(name=instruction.name, trips=step.trips, times=step.times, dtype=result_dtype(instruction.shape))
        collective = collectives.launched(step, module)
        if instruction.opcode == "copy-start" and hlo.host_bytes(instruction.shape):
            started[(step.computation, instruction.name)] = len(found)  # async: hidden by what runs until its -done
            found.append(_host_transfer(instruction, **fields))
        elif instruction.opcode == "fusion-start" and hlo.host_bytes(instruction.shape):
            started[(step.computation, instruction.name)] = len(found)  # an async slice of a host buffer
            found.append(_host_slice(instruction, **fields))
        elif collective is not None:
            if instruction.opcode.endswith("-start"):  # async: its -done comes later in this computation
                started[(step.computation, instruction.name)] = len(found)
            found.append(_collective(collective, module.num_partitions, **fields))
        elif instruction.opcode == "custom-call":
            found.append(_custom_call(instruction, computation, **fields))
        elif instruction.opcode == "fusion":
            found.append(_fusion(instruction, module, memo, **fields))
        else:
            found.append(_plain(instruction, computation, **fields))
        if not found[-1].host_bytes:  # a kernel that reads or writes host buffers in place
            found[-1] = _in_place_host_access(found[-1], instruction, computation)
    return found


def _host_slice(instruction: hlo.Instruction, **fields) -> Kernel:
    """An async fusion that slices a host buffer (XLA's offload of a saved activation under nn.scan: a
    dynamic-update-slice-start writing a layer's slice into the stacked host buffer, a dynamic-slice-start reading
    it back), shaped ((operands), result, context): it moves its device-side arrays (the update, or the slice read,
    and the indices) over the host link, never the whole host buffer."""
    moved = hlo.shape_bytes(instruction.shape) - hlo.host_bytes(instruction.shape)
    depth, operands_end = 0, 0
    for index, char in enumerate(instruction.shape):  # the operands' group: the first balanced (...) in the tuple
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 1 and char == ")":
            operands_end = index
            break
    detail = "device_to_host" if hlo.host_bytes(instruction.shape[operands_end + 1 :]) else "host_to_device"
    return Kernel(category="copy", detail=detail, flops=0.0, flop_dtype="vector", bytes_read=moved,
                  bytes_written=moved, host_bytes=moved, **fields)  # fmt: skip


def _in_place_host_access(kernel: Kernel, instruction: hlo.Instruction, computation: dict) -> Kernel:
    """`kernel` with the bytes it moves over the host link reading or writing host buffers in place: what it writes
    when its result is a host buffer (an update writes only its slice: the kernel's bytes_written), and what it reads
    of host operands (at most their size, and at most the kernel's bytes_read, which counts a slice's bytes only);
    the host buffer a host result updates in place (the operand of the result's shape) is not read."""
    if 'custom_call_target="AllocateBuffer"' in instruction.attributes:
        return dataclasses.replace(kernel, bytes_read=0, bytes_written=0)  # reserves a buffer, moves nothing
    result_on_host = bool(hlo.host_bytes(instruction.shape))
    read_from = [computation[o].shape for o in instruction.operands if o in computation]
    read_from = [s for s in read_from if hlo.host_bytes(s) and not (result_on_host and s == instruction.shape)]
    read = min(kernel.bytes_read, sum(map(hlo.host_bytes, read_from)))
    moved = (kernel.bytes_written if result_on_host else 0) + read
    return dataclasses.replace(kernel, host_bytes=int(moved)) if moved else kernel


_FIRST_ARRAY = re.compile(r"\(\s*(\w+\[[\d,]*\]\{[^}]*\})")


def _host_transfer(instruction: hlo.Instruction, **fields) -> Kernel:
    """A copy between host and device memory (a copy-start, whose result is (destination, source, context)): the
    destination's memory space names the direction; it moves one array, all of it over the host link."""
    destination = _FIRST_ARRAY.match(instruction.shape).group(1)
    size = hlo.shape_bytes(destination)
    detail = "device_to_host" if hlo.host_bytes(destination) else "host_to_device"
    return Kernel(category="copy", detail=detail, flops=0.0, flop_dtype="vector", bytes_read=size,
                  bytes_written=size, host_bytes=size, **fields)  # fmt: skip


def resolve_causal(found: list[Kernel], causal: bool) -> list[Kernel]:
    """The kernels with every attention call whose causality the HLO does not say (the Pallas kernels' Triton
    calls) taken as `causal` (the run's model.causal) where its queries and keys are equally long, and its
    FLOPs counted accordingly. A causal model's unequal call is one of the context-parallel ring's unmasked
    pairs (2c queries x c keys, or c x 2c: jaxscale.model.ring_attention); its square calls are the causal ones."""
    resolved = []
    for k in found:
        if k.attention is not None and k.attention[-1] is None:
            square = k.attention[3] == k.attention[4]  # as_tuple: (matmuls, batch, heads, q_len, kv_len, ...)
            call = attention_calls.Call.from_tuple(k.attention, k.detail, k.flop_dtype, causal=causal and square)
            k = dataclasses.replace(k, flops=call.flops, attention=call.as_tuple())
        resolved.append(k)
    return resolved


def summary(found: list[Kernel]) -> dict[str, dict[str, float]]:
    """Per category: launches, FLOPs and bytes per step (each kernel times its launches)."""
    table: dict[str, dict[str, float]] = {c: {"launches": 0, "flops": 0.0, "bytes": 0.0} for c in CATEGORIES}
    for k in found:
        row = table[k.category]
        row["launches"] += k.times
        row["flops"] += k.times * k.flops
        row["bytes"] += k.times * k.bytes
    return table


def as_dicts(found: list[Kernel]) -> list[dict]:
    """The kernels as plain dicts (JSON-ready), e.g. to send from a compile's child process."""
    return [dataclasses.asdict(k) for k in found]


def from_dicts(rows: list[dict]) -> list[Kernel]:
    """Kernels back from as_dicts' output (JSON turns tuples into lists)."""

    def maybe_tuple(value):
        return tuple(value) if value is not None else None

    return [
        Kernel(
            **{
                **r,
                "trips": tuple(r["trips"]),
                "gemm": maybe_tuple(r["gemm"]),
                "collective": maybe_tuple(r["collective"]),
                "attention": maybe_tuple(r.get("attention")),
                "window": maybe_tuple(r.get("window")),
            }
        )
        for r in rows
    ]

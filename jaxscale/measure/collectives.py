"""The collectives of a compiled step, read once from its optimized HLO, and the result row's columns of them.

`launched(step, module)` parses the collective one executed step launches (jaxscale.measure.hlo.executed:
the program as it runs, each instruction with its loops' trip counts): its kind, its buffer bytes per
device, its replica group size and how many times it runs per step. `count_collectives` lists them for the
row's columns, and jaxscale.measure.kernels builds the step-time predictor's collective kernels from the
same parse, so the predictor costs exactly the collectives the row reports.

Per kind (all_reduce, all_gather, reduce_scatter, all_to_all, collective_permute):

- `compiled_collective_<kind>_count`: executions per optimizer step (a collective inside the scanned layers'
  loop counts once per layer and minibatch);
- `compiled_collective_<kind>_bytes`: the sum over those executions of the buffer each works on, per device:
  an all-reduce's operand (= result), an all-gather's gathered result, a reduce-scatter's operand, an
  all-to-all's or collective-permute's operand (see Collective). It is a size, not the wire traffic;
- `compiled_collective_<kind>_f32_bytes`: the float32 part of those bytes (mixed precision on a mesh: FSDP's
  all-gathers move bf16 weights and gradients are summed in float32, jaxscale.model.precision).

Totals: `compiled_collective_count`, `compiled_collective_bytes`, and `compiled_collective_ring_bytes`: what
each device sends if every collective runs as a ring over its replica group of n devices, 2(n-1)/n · bytes
for an all-reduce, (n-1)/n · bytes for all-gather, reduce-scatter and all-to-all, bytes for a
collective-permute. The CPU backend has no reduce-scatter: there FSDP's gradient reduction compiles to an
all-reduce followed by a slice (2x the ring traffic of a reduce-scatter); GPU targets compile reduce-scatters.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from jaxscale.measure import hlo

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
KIND_COLUMNS = {kind: kind.replace("-", "_") for kind in COLLECTIVE_KINDS}
# Each collective op of hlo.COLLECTIVES as a row kind: ragged-all-to-all counts as all-to-all, the rest as other.
_KIND_OF = {
    op: op if op in COLLECTIVE_KINDS else "all-to-all" if op == "ragged-all-to-all" else "other"
    for op in hlo.COLLECTIVES
}
_WRAPPERS = ("async-start", "fusion")  # run the collective of the computation they call
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?=(\d+)")  # 'axis_0'=8 (JAX 0.10) or axis_0=8
_GROUP_AXIS = re.compile(r"\s*'?([^':\s]+)'?(?::\((\d+)\)(\d+))?\s*")  # 'axis_0', or a sub-axis 'axis_0':(1)2
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the compiled program runs, and its sizes on one device.

    `bytes` is the whole buffer the collective works on, per device and execution: the operand of an
    all-reduce (= its result), the gathered result of an all-gather, the operand of a reduce-scatter
    (before scattering), the operand of an all-to-all or collective-permute, i.e. max(operand, result).
    `ring_bytes` is what a ring algorithm sends from each device for it (ring_factor · bytes).
    """

    name: str  # the instruction that launches it (the -start of an async pair, an async-start, a fusion)
    kind: str  # one of COLLECTIVE_KINDS, or "other"
    executions: int  # per step: the trip counts of the loops around it multiplied in
    operand_bytes: int
    result_bytes: int
    group_size: int | None  # devices per replica group (None for collective-permute's pairs)
    operand_f32_bytes: int = 0  # the float32 arrays' part of operand_bytes
    result_f32_bytes: int = 0  # ... and of result_bytes
    pair_span: int | None = None  # a collective-permute's: the aligned block of devices its pairs reach (pair_span)

    @property
    def bytes(self) -> int:
        return max(self.operand_bytes, self.result_bytes)

    @property
    def f32_bytes(self) -> int:
        """The float32 part of `bytes` (of the side `bytes` measures)."""
        return self.operand_f32_bytes if self.operand_bytes >= self.result_bytes else self.result_f32_bytes

    @property
    def ring_bytes(self) -> float:
        return ring_factor(self.kind, self.group_size) * self.bytes


def ring_factor(kind: str, group_size: int | None) -> float:
    """Bytes each device sends per byte of the full buffer, for a ring over a group of n devices (NCCL's
    bus bandwidth): 2(n-1)/n for an all-reduce, (n-1)/n for all-gather, reduce-scatter, all-to-all and
    collective-broadcast, 1 for a collective-permute (one send to its pair; group None), 0 for one device."""
    if group_size is not None and group_size <= 1:
        return 0.0
    if kind == "collective-permute":
        return 1.0
    n = group_size or 1
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def pair_span(attributes: str) -> int | None:
    """The devices a collective-permute's pairs reach: for each pair (a, b), the smallest aligned block of 2^k
    consecutive devices holding both (2^bit_length(a XOR b)), the largest over its pairs; None without pairs.

    With the mesh's devices consecutive (one host's, one NVLink domain's), a block of at most an NVLink domain's
    devices stays on NVLink and one larger than a host crosses the network: a pipeline's stage hop (0 -> 8 on 8 GPUs a
    host) reaches 16, a hop within a host (0 -> 1) 2. Exact for power-of-two domains and hosts, the targets' sizes.

    Args:
      attributes: the instruction's attributes (HLO text after its operands).

    Returns:
      The block's size in devices, or None when the instruction names no pairs.
    """
    found = _PAIRS.search(attributes)
    if not found:
        return None
    pairs = [tuple(int(d) for d in pair.split(",")) for pair in re.findall(r"\{(\d+,\d+)\}", found.group(1))]
    return max((1 << (a ^ b).bit_length() for a, b in pairs), default=1)


def _mesh_group_size(attributes: str, found: re.Match) -> int | None:
    """Devices per group of the mesh form `mesh['a'=2,'b'=4][, device_ids=(...)] {'a'}`: the product of the
    grouped axes' sizes (a sub-axis `'a':(1)2` counts its own size); None if it does not read."""
    sizes = {name: int(size) for name, size in _MESH_AXIS.findall(found.group(1))}
    rest = attributes[found.end() :]
    if rest.startswith(", device_ids=("):  # a permuted mesh, e.g. ([2,2,2]T(1,0,2)): same group sizes
        rest = hlo._split_balanced(rest.removeprefix(", device_ids="))[1]
    axes = re.match(r"\s*\{([^}]*)\}", rest)
    if not axes:
        return None
    product = 1
    for text in axes.group(1).split(","):
        axis = _GROUP_AXIS.fullmatch(text)
        if not axis or (axis.group(3) is None and axis.group(1) not in sizes):
            return None
        product *= int(axis.group(3)) if axis.group(3) else sizes[axis.group(1)]
    return product


def group_size(attributes: str, num_partitions: int) -> int:
    """Devices per replica group, from the forms XLA prints.

    Args:
      attributes: the instruction's attribute text.
      num_partitions: the devices the program runs on (the module's num_partitions).
    Returns:
      The mesh form `mesh['a'=2,'b'=4] {'a'}` (2), also with the mesh's devices permuted
      (`mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}`); the iota form `[2,4]<=[8]` (2 groups
      of 4); an explicit list `{{0,1},{2,3}}` (its largest group); every device for `{}`, no groups, or
      a form that does not read.
    """
    mesh = _MESH_GROUPS.search(attributes)
    if mesh:
        return _mesh_group_size(attributes, mesh) or num_partitions
    iota = _IOTA_GROUPS.search(attributes)
    if iota:
        return int(iota.group(2))
    listed = _LIST_GROUPS.search(attributes)
    groups = re.findall(r"\{([\d,]*)\}", listed.group(1)) if listed else []
    sizes = [len([d for d in group.split(",") if d]) for group in groups]
    return max(sizes) if sizes and max(sizes) > 0 else num_partitions


def _wrapped(instruction: hlo.Instruction, module: hlo.Module) -> tuple[hlo.Instruction, dict] | None:
    """The collective an async-start or a fusion runs (its computation's root, else the last collective
    there; XLA wraps one collective per async computation), with that computation; else None."""
    callee = next((c for role, c in instruction.callees if role == "calls"), "")
    body = module.computations.get(callee, {})
    inside = [i for i in reversed(body.values()) if i.opcode.removesuffix("-start") in _KIND_OF]
    return (inside[0], body) if inside else None


def launched(step: hlo.Executed, module: hlo.Module) -> Collective | None:
    """The collective an executed step launches, or None.

    A collective, the -start of an async pair (sized by its -done: a combined all-gather's result is the
    whole tuple the -done returns), or an async-start or fusion around a collective; a -done is not one
    (its -start is). Per-device sizes and the replica group come from the collective's own instruction.
    """
    instruction, computation = step.instruction, module.computations[step.computation]
    if instruction.opcode in _WRAPPERS:
        wrapped = _wrapped(instruction, module)
        if wrapped is None:
            return None
        instruction, computation = wrapped
    opcode = instruction.opcode
    base = opcode.removesuffix("-start")
    if base not in _KIND_OF:
        return None
    operands, operands_f32 = (hlo.operand_bytes(instruction, computation, only) for only in (None, "f32"))
    result, result_f32 = (hlo.shape_bytes(instruction.shape, only) for only in (None, "f32"))
    if opcode.endswith("-start"):  # the -done's shape is the result; the -start's tuple also holds the operands
        done = next((i for i in computation.values() if i.opcode == f"{base}-done" and instruction.name in i.operands),
                    None)  # fmt: skip
        if done is not None:
            result, result_f32 = (hlo.shape_bytes(done.shape, only) for only in (None, "f32"))
        else:
            result, result_f32 = max(result - operands, 0), max(result_f32 - operands_f32, 0)
    kind = _KIND_OF[base]
    group = None if kind == "collective-permute" else group_size(instruction.attributes, module.num_partitions)
    span = pair_span(instruction.attributes) if kind == "collective-permute" else None
    return Collective(step.instruction.name, kind, step.times, operands, result, group, operands_f32, result_f32, span)


def count_collectives(module: hlo.Module) -> list[Collective]:
    """Every collective one execution of the module runs, with how often it runs and its sizes per device.

    Args:
      module: the parsed optimized HLO (hlo.parse).
    Returns:
      One Collective per launching step of hlo.executed (a loop body's with its trip counts multiplied in;
      an async pair counted once, at its start).
    """
    return [found for step in hlo.executed(module) if (found := launched(step, module)) is not None]


def summarize(collectives: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Per kind (and "other"): {"count", "bytes", "f32_bytes", "ring_bytes"} per step, each collective times
    its executions.

    This is the reusable part: a step-time model can cost each kind with its own bandwidth.
    """
    totals = {
        kind: {"count": 0, "bytes": 0, "f32_bytes": 0, "ring_bytes": 0.0} for kind in (*COLLECTIVE_KINDS, "other")
    }
    for collective in collectives:
        entry = totals[collective.kind]
        entry["count"] += collective.executions
        entry["bytes"] += collective.executions * collective.bytes
        entry["f32_bytes"] += collective.executions * collective.f32_bytes
        entry["ring_bytes"] += collective.executions * collective.ring_bytes
    return totals


def collective_columns(hlo_text: str) -> dict[str, int | float]:
    """The compiled_collective_* columns (module docstring) of one compiled step's HLO text."""
    totals = summarize(count_collectives(hlo.parse(hlo_text)))
    row: dict[str, int | float] = {}
    for kind, column in KIND_COLUMNS.items():
        row[f"compiled_collective_{column}_count"] = totals[kind]["count"]
        row[f"compiled_collective_{column}_bytes"] = totals[kind]["bytes"]
        row[f"compiled_collective_{column}_f32_bytes"] = totals[kind]["f32_bytes"]
    row["compiled_collective_count"] = sum(t["count"] for t in totals.values())
    row["compiled_collective_bytes"] = sum(t["bytes"] for t in totals.values())
    row["compiled_collective_ring_bytes"] = round(sum(t["ring_bytes"] for t in totals.values()))
    return row


def summary_line(row: dict) -> str | None:
    """One line for the run summary: collectives per step and bytes per device, by kind (None without any)."""
    if not row.get("compiled_collective_count"):
        return None
    parts = [
        f"{row[f'compiled_collective_{c}_count']} {kind} {row[f'compiled_collective_{c}_bytes'] / 2**20:.2f} MiB"
        f" ({row.get(f'compiled_collective_{c}_f32_bytes', 0) / max(row[f'compiled_collective_{c}_bytes'], 1):.0%} f32)"
        for kind, c in KIND_COLUMNS.items()
        if row.get(f"compiled_collective_{c}_count")
    ]
    return (
        f"  collectives per step (compiled HLO, per device): {', '.join(parts)}; ring traffic "
        f"{row['compiled_collective_ring_bytes'] / 2**20:.2f} MiB sent per device"
    )

"""Reads a compiled step's HLO text: its instructions, matmul FLOPs and the executed program with loop trip counts.

XLA's cost analysis counts a while-loop body once. This module walks the call graph of the optimized HLO
(`compiled.as_text()`), multiplies each loop body by its `known_trip_count`, and counts the FLOPs of every
dot (2 · output elements · contracted size), so a scanned step's matmul FLOPs can be counted in full.
`executed` is the one walk of the program as it runs, each instruction with its loops' trip counts: the
kernel list (jaxscale.measure.kernels) and the collective counts (jaxscale.measure.collectives) both read
it. It also names what each op does (matmul, dynamic-update-slice, copy, ...) for trace analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"^\w+\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COMMENT = re.compile(r"/\*.*?\*/")
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
_ATTENTION_TARGET = re.compile(r"fmha", re.IGNORECASE)  # cuDNN fused attention (__cudnn$fmha...): its matmuls

# Every collective op XLA emits (jaxscale.measure.collectives maps them to the row's kinds).
COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all",
    "collective-broadcast",
)  # fmt: skip
_MOVES = {"parameter", "copy", "bitcast", "transpose", "reshape", "tuple", "get-tuple-element"}
CATEGORIES = ("matmul", "fusion", "dynamic_update_slice", "copy", "control_flow", "collective", "other")


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: its name, opcode, result shape text, operand names and attribute text."""

    name: str
    opcode: str
    shape: str
    operands: list[str]
    attributes: str

    @functools.cached_property
    def callees(self) -> tuple[tuple[str, str], ...]:
        """(role, computation) pairs this instruction calls: calls=, body=, to_apply=, branches... (read once: the
        walks of a program ask every instruction many times)."""
        found = [(m.group(1), m.group(2)) for m in _CALLEE.finditer(self.attributes)]
        for m in _CALLEE_LIST.finditer(self.attributes):
            found += [(m.group(1), c.strip().lstrip("%")) for c in m.group(2).split(",") if c.strip()]
        return tuple(found)

    @property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.attributes)
        return match.group(1) if match else ""

    @property
    def trip_count(self) -> int | None:
        match = _TRIP_COUNT.search(self.attributes)
        return int(match.group(1)) if match else None


@dataclasses.dataclass
class Module:
    """Computations by name (each an ordered dict of instructions) and the entry computation's name."""

    computations: dict[str, dict[str, Instruction]]
    entry: str
    num_partitions: int = 1  # devices one SPMD program runs on (the HloModule header's num_partitions)


_PARENS = re.compile(r"[()]")
_OPERAND_MARKS = re.compile(r"[,()\[\]{}]")


def _split_balanced(text: str) -> tuple[str, str]:
    """Splits '(a, (b), c) rest' into ('a, (b), c', 'rest')."""
    depth = 0
    for match in _PARENS.finditer(text):
        depth += 1 if match.group() == "(" else -1
        if depth == 0:
            i = match.start()
            return text[1:i], text[i + 1 :]
    return text[1:], ""


def _parse_instruction(name: str, text: str) -> Instruction | None:
    if text.startswith("("):
        inner, rest = _split_balanced(text)
        shape = f"({inner})"
    else:
        shape, _, rest = text.partition(" ")
    match = _OPCODE.match(rest)
    if not match:
        return None
    operand_text, attributes = _split_balanced(rest[match.end() - 1 :])
    operand_text = _COMMENT.sub("", operand_text) + ","  # '/*index=5*/%x' names x
    operands, depth, start = [], 0, 0
    for found in _OPERAND_MARKS.finditer(operand_text):  # each operand: '<shape> %name', split at top-level commas
        mark = found.group()
        if mark != ",":
            depth += 1 if mark in "([{" else -1
        elif depth == 0:
            operand = operand_text[start : found.start()].strip()
            if operand:
                operands.append(operand.split(" ")[-1].lstrip("%"))
            start = found.end()
    return Instruction(name, match.group(1), shape, operands, attributes)


@functools.lru_cache(maxsize=4)
def parse(text: str) -> Module:
    """Parses `compiled.as_text()` (optimized HLO) into computations of instructions.

    One plan's text is read by several measures (kernels, collectives, FLOPs, expert FLOPs, host memory): the last
    few parses are kept, so each text is parsed once. The Module is shared between them: read it, never change it."""
    computations: dict[str, dict[str, Instruction]] = {}
    entry, current, partitions = "", None, 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            found = _NUM_PARTITIONS.search(line)
            partitions = int(found.group(1)) if found else 1
        if not line.startswith(" "):
            header = _HEADER.match(line)
            current = None
            if header and not line.startswith("HloModule"):
                current = computations.setdefault(header.group(2), {})
                entry = header.group(2) if header.group(1) else entry
            continue
        match = _INSTRUCTION.match(line)
        if current is not None and match:
            instruction = _parse_instruction(match.group(2), match.group(3))
            if instruction is not None:
                current[instruction.name] = instruction
    return Module(computations, entry, partitions)


# Bytes per element of each HLO element type (sub-byte types rounded up to a byte; token and tuples hold none).
DTYPE_BYTES: dict[str, int] = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
    "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
_ARRAYS = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dimensions) of every array in a shape ('(bf16[8,32]{1,0}, s8[16])' -> two arrays)."""
    return [
        (dtype, tuple(int(d) for d in text.split(",") if d))
        for dtype, text in _ARRAYS.findall(shape)
        if dtype in DTYPE_BYTES
    ]


def shape_bytes(shape: str, only: str | None = None) -> int:
    """Bytes of every array in a shape (a tuple's elements summed); of its `only` arrays (e.g. "f32") if given."""
    return sum(DTYPE_BYTES[dtype] * math.prod(d) for dtype, d in arrays(shape) if only in (None, dtype))


HOST_MEMORY_SPACE = "S(5)"  # the layout mark of an array in host memory (XLA's memory space 5, pinned_host)
_LAID_OUT = re.compile(r"(\w+)\[([\d,]*)\]\{([^}]*)\}")


def host_bytes(shape: str) -> int:
    """Bytes of the arrays of a shape whose layout puts them in host memory ('f32[8]{0:S(5)}' -> 32)."""
    return sum(DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims, layout in _LAID_OUT.findall(shape)
               if dtype in DTYPE_BYTES and HOST_MEMORY_SPACE in layout)  # fmt: skip


def operand_bytes(instruction: Instruction, computation: dict[str, Instruction], only: str | None = None) -> int:
    """Bytes of an instruction's operands that its computation defines (each operand's whole shape; see
    shape_bytes for `only`)."""
    return sum(shape_bytes(computation[o].shape, only) for o in instruction.operands if o in computation)


def element_type(shape: str) -> str:
    """The element type of an array shape, or of a tuple's first array ('' when there is none)."""
    found = arrays(shape)
    return found[0][0] if found else ""


def dims(shape: str) -> tuple[int, ...]:
    """Dimensions of an array shape ('bf16[8,32]{1,0}' -> (8, 32)); a tuple shape gives its first element."""
    match = _ARRAY.match(shape.lstrip("(").strip())
    return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def _int_list(attributes: str, key: str) -> list[int]:
    match = re.search(rf"\b{key}=\{{([\d,]*)\}}", attributes)
    if match:
        return [int(d) for d in match.group(1).split(",") if d]
    match = re.search(rf'"{key}":\[([^\]]*)\]', attributes)  # GPU gemm backend_config (JSON)
    return [int(d.strip().strip('"')) for d in match.group(1).split(",") if d.strip()] if match else []


def is_matmul(instruction: Instruction) -> bool:
    """A dot, a convolution, or a library GEMM custom call (cuBLAS on GPU)."""
    if instruction.opcode in ("dot", "convolution"):
        return True
    target = _TARGET.search(instruction.attributes) if instruction.opcode == "custom-call" else None
    return bool(target and _GEMM_TARGET.search(target.group(1)))


def matmul_flops(instruction: Instruction, computation: dict[str, Instruction]) -> int:
    """2 · output elements · contracted elements of one dot or GEMM custom call (0 for anything else).

    Convolutions are not counted (the GPT has none); they are still categorised as matmul work.
    """
    if not is_matmul(instruction) or instruction.opcode == "convolution" or not instruction.operands:
        return 0
    lhs = computation.get(instruction.operands[0])
    if lhs is None:
        return 0
    key = "lhs_contracting_dims" if instruction.opcode == "dot" else "lhs_contracting_dimensions"
    lhs_dims = dims(lhs.shape)
    contracted = math.prod(lhs_dims[i] for i in _int_list(instruction.attributes, key) if i < len(lhs_dims))
    return 2 * math.prod(dims(instruction.shape)) * contracted


@dataclasses.dataclass
class LoopCount:
    """Matmul FLOPs of a module counted with loop bodies once (as XLA's cost analysis) and in full."""

    matmul_flops_once: int
    matmul_flops: int
    while_loops: int  # every while loop in the module
    matmul_loops: int  # while loops whose body runs matmuls more than once
    unknown_trip_counts: int  # while loops without a known_trip_count (their bodies counted once)


def count_matmul_flops(module: Module, only: Callable[[Instruction], bool] | None = None) -> LoopCount:
    """Matmul FLOPs of one execution of the module, each while body multiplied by its trip count; of the matmuls
    `only` accepts where given (jaxscale.measure.expert_flops: those of a named scope).

    A loop without a known_trip_count is counted once (and reported); a conditional runs one of its n
    branches, so each is counted 1/n times: exact where the branches do the same work (the context-parallel
    ring's two, jaxscale.model.ring_attention), their mean otherwise.
    """
    stats = {"while": 0, "matmul_loops": 0, "unknown": 0}
    seen: set[str] = set()

    @functools.cache
    def total(name: str, full: bool) -> float:
        computation = module.computations.get(name, {})
        flops = sum(matmul_flops(i, computation) for i in computation.values() if only is None or only(i))
        for instruction in computation.values():
            for role, callee in instruction.callees:
                times = 1 / len(instruction.callees) if instruction.opcode == "conditional" else 1
                if instruction.opcode == "while" and role == "body":
                    trip = instruction.trip_count
                    if full and instruction.name not in seen:
                        seen.add(instruction.name)
                        stats["while"] += 1
                        stats["unknown"] += trip is None
                        stats["matmul_loops"] += (trip or 1) > 1 and total(callee, False) > 0
                    times = (trip or 1) if full else 1
                flops += times * total(callee, full)
        return flops

    full = round(total(module.entry, True))
    once = round(total(module.entry, False))
    return LoopCount(once, full, stats["while"], stats["matmul_loops"], stats["unknown"])


@dataclasses.dataclass(frozen=True)
class Executed:
    """An instruction of a computation that runs as a sequence (not inside a fusion), with its loops.

    trips: the multipliers of the loops that hold it, outermost first: a while body runs known_trip_count
    times and its condition once more, as HLO defines a while loop (None where the loop has no
    known_trip_count; counted once). XLA's CPU and GPU runtimes run a loop of known trip count without
    evaluating its condition at all (their WhileThunks), so a condition's count is an upper bound.
    """

    instruction: Instruction
    computation: str
    trips: tuple[int | None, ...]
    share: float = 1.0  # inside a conditional of n branches: 1/n (nested: their product), see executed

    @property
    def times(self) -> float:
        """How many times it runs per execution of the module (unknown trip counts taken as 1; a conditional's
        branch its share)."""
        runs = math.prod(t or 1 for t in self.trips)
        return runs if self.share == 1 else runs * self.share


def executed(module: Module) -> list[Executed]:
    """Every instruction the module executes as a sequence step, in program order, with its loop trips.

    Follows while bodies and conditions, calls and conditional branches from the entry; fused computations,
    the scalar computations of reduces and the computation an async-start runs are left to their caller (one
    step: the fusion, the reduce, the async-start). A conditional runs one of its n branches: each branch's
    instructions carry share 1/n (exact where the branches do the same work, as the context-parallel ring's
    two do; their mean otherwise), so `times` may be fractional there.
    """
    found: list[Executed] = []

    def walk(name: str, trips: tuple[int | None, ...], path: tuple[str, ...], share: float = 1.0) -> None:
        for instruction in module.computations.get(name, {}).values():
            found.append(Executed(instruction, name, trips, share))
            if instruction.opcode not in ("while", "call", "conditional"):
                continue
            n = instruction.trip_count
            for role, callee in instruction.callees:
                if callee in path:
                    continue  # HLO has no recursion; a malformed module must not loop forever
                if role == "body":
                    walk(callee, (*trips, n), (*path, callee), share)
                elif role == "condition":
                    walk(callee, (*trips, None if n is None else n + 1), (*path, callee), share)
                elif instruction.opcode == "conditional":
                    walk(callee, trips, (*path, callee), share / len(instruction.callees))
                elif instruction.opcode != "while":
                    walk(callee, trips, (*path, callee), share)

    walk(module.entry, (), (module.entry,))
    return found


def _opcodes(module: Module, name: str, memo: dict[str, set[str]]) -> set[str]:
    """Opcodes used in a computation and everything it calls ('gemm' marks a GEMM custom call)."""
    if name in memo:
        return memo[name]
    memo[name] = set()
    found: set[str] = set()
    for instruction in module.computations.get(name, {}).values():
        found.add("gemm" if is_matmul(instruction) else instruction.opcode)
        for _, callee in instruction.callees:
            found |= _opcodes(module, callee, memo)
    memo[name] = found
    return found


def category(instruction: Instruction, module: Module, memo: dict[str, set[str]]) -> str:
    """What an executed op does, one of CATEGORIES; fusions are named by the work inside them."""
    opcode = instruction.opcode
    if opcode in ("while", "call", "conditional"):
        return "control_flow"
    target = _TARGET.search(instruction.attributes) if opcode == "custom-call" else None
    if target and _ATTENTION_TARGET.search(target.group(1)):
        return "matmul"  # a fused attention kernel: QK^T and AV with the softmax between them
    inside = {"gemm" if is_matmul(instruction) else opcode}
    if opcode == "fusion":
        for _, callee in instruction.callees:
            inside |= _opcodes(module, callee, memo)
    base = {op.removesuffix("-start").removesuffix("-done") for op in inside}
    if "gemm" in inside:
        return "matmul"
    if base & set(COLLECTIVES):
        return "collective"
    if "dynamic-update-slice" in inside:
        return "dynamic_update_slice"
    if opcode in ("copy", "copy-start", "copy-done") or (
        opcode == "fusion" and inside <= _MOVES | {"fusion"} and inside & {"copy", "transpose"}
    ):
        return "copy"
    return "fusion" if opcode == "fusion" else "other"


def is_rematerialized(instruction: Instruction) -> bool:
    """Recomputed forward work: JAX's checkpoint ('rematted_computation') or XLA's own remat ('.remat')."""
    return "rematted_computation" in instruction.op_name or ".remat" in instruction.name


def op_table(module: Module) -> dict[str, tuple[str, bool]]:
    """instruction name -> (category, rematerialized) for every instruction outside fused computations."""
    memo: dict[str, set[str]] = {}
    fused = {c for comp in module.computations.values() for i in comp.values() for r, c in i.callees if r == "calls"}
    table = {}
    for name, computation in module.computations.items():
        if name in fused:
            continue
        for instruction in computation.values():
            table[instruction.name] = (category(instruction, module, memo), is_rematerialized(instruction))
    return table

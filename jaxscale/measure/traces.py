"""Trace analysis: device time per annotated step, top ops and time shares by category, from a captured trace.

Reads the `*.xplane.pb` that jax.profiler wrote with `jax.profiler.ProfileData` (offline, no protobuf
parsing here). Where the ops are, by backend (the XPlane conventions of TSL/xprof):

- CPU: XLA's CPU executable runs its ops on host threads (`/host:CPU` plane, Eigen and XLA thread lines);
  each op event is named after its HLO instruction and carries `hlo_op`, `hlo_module` and `run_id` stats.
  An execution is the span of the ops sharing a run_id.
- GPU: a `/device:GPU:<n>` plane. Raw CUPTI lines are CUDA streams, `Stream #<id>(Kernel,MemcpyD2D,...)`,
  whose events are named after the *kernel* (`loop_add_fusion`, `nvjet_hsh_...`, `sm90_xmma_gemm_...`,
  `MemcpyD2D`) and carry XLA's annotation as stats: `hlo_op` (the HLO instruction, e.g. `fusion.12`,
  `custom-call.3`), `hlo_module`, `correlation_id`. xprof's derived lines, where present, are
  `XLA Modules` (one event per execution of a program) and `XLA Ops` (one per HLO op, named after it).
  Where XLA ran ops as a CUDA graph (its command buffers, on by default from JAX 0.11: seen on an H200),
  every kernel of the graph carries the thunk's `hlo_op` (`command_buffer_184`), so such an op is named after
  its kernel instead: XLA names a kernel after its HLO instruction with `.` and `-` made `_`
  (`gemm_fusion_dot_51` for `gemm_fusion_dot.51`; XLA's `llvm_ir::SanitizeFunctionName`), which
  `op_table` maps back to the instruction.
  Ops are taken from `XLA Ops` when the plane has it, else from the stream lines (an event without
  `hlo_op`, such as a memcpy, is named after its kernel); executions from `XLA Modules`, else, per
  annotated step, the span of the device ops that started inside it (jaxscale.profiling waits for each
  step inside its annotation).
- TPU: a `/device:TPU:<n>` plane with `XLA Ops` and `XLA Modules` lines.

With the compiled step's HLO text (jaxscale.hlo) each op is put in a category and marked when it is
recomputed by remat; without it, categories fall back to the op's name and then its kernel's name
(`_name_category`), and the remat share is null.
CLI: `python -m jaxscale.measure.traces RUN_DIR [--top N]` prints the summary and top ops, writes RUN_DIR/ops.csv.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import gzip
import pathlib
import re
import statistics
import sys

from absl import flags
from jax.profiler import ProfileData

from jaxscale.cli import Usage, UsageError, fail, one_argument, print_help, wants_help
from jaxscale.measure import hlo

_CONTAINER = re.compile(r"^(while|call|conditional)\b")
STEP_ANNOTATION = "train"  # name of the StepTraceAnnotation that jaxscale.profiling puts around each step
HLO_FILE = "step.hlo.txt.gz"  # the compiled step's HLO text, which jaxscale.run keeps beside the trace
DEVICE_PLANE = "/device:"  # /device:GPU:0, /device:TPU:0
HOST_PLANE = "/host:"  # /host:CPU
OPS_LINE, MODULES_LINE, STREAM_LINE = "XLA Ops", "XLA Modules", "Stream #"
_COMMAND_BUFFER = re.compile(r"command_buffer_\d+")  # the hlo_op of every kernel of one of XLA's CUDA graphs


@dataclasses.dataclass
class OpEvent:
    """One executed XLA op: HLO instruction name, start and duration, time not spent in nested ops."""

    name: str
    start_ns: float
    duration_ns: float
    self_ns: float
    run_id: int | None
    kernel: str | None = None  # the event's own name where it differs (a GPU kernel's)


@dataclasses.dataclass
class Trace:
    """What read_trace finds: the ops, the executions, the annotated steps and where the ops came from."""

    ops: list[OpEvent]
    executions: list[tuple[float, float]]  # (start_ns, end_ns) of each execution of a compiled program
    steps: list[tuple[int, float, float]]  # (step_num, start_ns, end_ns) of each StepTraceAnnotation
    source: str  # "device:XLA Ops", "device:streams" or "host threads"


def trace_file(trace_dir: pathlib.Path) -> pathlib.Path:
    """The newest `plugins/profile/<timestamp>/*.xplane.pb` under trace_dir."""
    files = sorted(pathlib.Path(trace_dir).glob("plugins/profile/*/*.xplane.pb"))
    if not files:
        raise FileNotFoundError(f"no plugins/profile/*/*.xplane.pb under {trace_dir}")
    return files[-1]


def _with_self_time(events: list[tuple[str, float, float, int | None, str | None]]) -> list[OpEvent]:
    """Self time of nested events on one thread: a while op contains its body's ops, a call its callee's."""
    ops: list[OpEvent] = []
    stack: list[OpEvent] = []
    for name, start, duration, run_id, kernel in sorted(events, key=lambda e: (e[1], -e[2])):
        while stack and start >= stack[-1].start_ns + stack[-1].duration_ns:
            stack.pop()
        op = OpEvent(name, start, duration, duration, run_id, kernel)
        if stack:
            stack[-1].self_ns -= duration
        stack.append(op)
        ops.append(op)
    return ops


def _line_events(line, named_by_line: bool) -> list[tuple[str, float, float, int | None, str | None]]:
    """(HLO op name, start, duration, run_id, event name) of a line's op events: those with an `hlo_op`
    stat, or every event of a line that holds only ops (`named_by_line`), named by hlo_op where given."""
    found = []
    for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats or named_by_line:
            name = str(stats.get("hlo_op") or event.name)
            name = event.name if _COMMAND_BUFFER.fullmatch(name) else name  # a kernel of a CUDA graph: its own name
            kernel = event.name if event.name != name else None
            found.append((name, event.start_ns, event.duration_ns, stats.get("run_id"), kernel))
    return found


def _device_plane(plane) -> tuple[list[OpEvent], list[tuple[float, float]], str]:
    """(ops, executions, source) of a /device: plane: the XLA Ops line if there is one, else the streams.
    Ops of the XLA Ops line get the kernel name a stream shows for the same hlo_op (for the category)."""
    lines = list(plane.lines)
    derived = [line for line in lines if line.name == OPS_LINE]
    streams = [line for line in lines if line.name.startswith(STREAM_LINE)]
    ops = [op for line in derived or streams for op in _with_self_time(_line_events(line, named_by_line=True))]
    kernel_of = {name: kernel for line in streams for name, *_, kernel in _line_events(line, False) if kernel}
    for op in ops:
        op.kernel = op.kernel or kernel_of.get(op.name)
    modules = [
        (e.start_ns, e.start_ns + e.duration_ns) for line in lines if line.name == MODULES_LINE for e in line.events
    ]
    return ops, modules, f"device:{OPS_LINE}" if derived else "device:streams"


def read_trace(path: pathlib.Path) -> Trace:
    """The XLA ops, executions and annotated steps of a trace (see this module's docstring for where
    each backend puts them): device planes' ops when there are any, else the host threads'."""
    profile = ProfileData.from_file(str(path))
    device_ops, host_ops, modules, steps, source = [], [], [], [], "host threads"
    for plane in profile.planes:
        if plane.name.startswith(DEVICE_PLANE):
            ops, executions, found = _device_plane(plane)
            device_ops, modules = device_ops + ops, modules + executions
            source = found if ops else source
        elif plane.name.startswith(HOST_PLANE):
            for line in plane.lines:
                host_ops += _with_self_time(_line_events(line, named_by_line=False))
                steps += [
                    (int(dict(e.stats).get("step_num", -1)), e.start_ns, e.start_ns + e.duration_ns)
                    for e in line.events
                    if e.name == STEP_ANNOTATION
                ]
    steps.sort(key=lambda s: s[1])
    ops = _container_self_time(device_ops or host_ops)
    executions = sorted(modules) or _executions_by_run_id(ops) or _executions_by_step(ops, steps)
    return Trace(ops, executions, steps, source if device_ops else "host threads")


def _container_self_time(ops: list[OpEvent]) -> list[OpEvent]:
    """Self time of while/call/conditional ops: the part of their span that no other op of the same
    execution covers, on any thread (a CPU loop hands its body's ops to a thread pool and waits)."""
    by_run: dict[object, list[OpEvent]] = collections.defaultdict(list)
    for op in ops:
        by_run[op.run_id].append(op)
    for members in by_run.values():
        for container in (op for op in members if _CONTAINER.match(op.name)):
            begin, end = container.start_ns, container.start_ns + container.duration_ns
            inside = sorted(
                (max(op.start_ns, begin), min(op.start_ns + op.duration_ns, end))
                for op in members
                if op is not container and op.start_ns < end and op.start_ns + op.duration_ns > begin
            )
            covered, reach = 0.0, begin
            for lo, hi in inside:
                covered += max(0.0, hi - max(lo, reach))
                reach = max(reach, hi)
            container.self_ns = max(0.0, container.duration_ns - covered)
    return ops


def _executions_by_run_id(ops: list[OpEvent]) -> list[tuple[float, float]]:
    runs: dict[int, list[float]] = {}
    for op in ops:
        if op.run_id is not None:
            span = runs.setdefault(op.run_id, [op.start_ns, op.start_ns + op.duration_ns])
            span[0], span[1] = min(span[0], op.start_ns), max(span[1], op.start_ns + op.duration_ns)
    return sorted((start, end) for start, end in runs.values())


def _executions_by_step(ops: list[OpEvent], steps: list[tuple[int, float, float]]) -> list[tuple[float, float]]:
    """Per annotated step, the span of the ops that started inside it (device ops without run ids)."""
    spans = []
    for _, begin, end in steps:
        inside = [op for op in ops if begin <= op.start_ns < end]
        if inside:
            spans.append((min(op.start_ns for op in inside), max(op.start_ns + op.duration_ns for op in inside)))
    return spans


def step_times(executions: list[tuple[float, float]], steps: list[tuple[int, float, float]]) -> dict[int, float]:
    """Device seconds per annotated step: the summed spans of the executions each step launched.

    Dispatch is asynchronous, so an execution can start after its step's annotation has closed; the
    executions after the first annotation are therefore dealt to the steps in order, evenly when their
    number is a multiple of the steps' (one jitted step per annotation), else each to the latest
    annotation that began before it.
    """
    if not steps:
        return {}
    launched = [e for e in executions if e[0] >= steps[0][1]]
    seconds: dict[int, float] = collections.defaultdict(float)
    per_step, remainder = divmod(len(launched), len(steps))
    for index, (start, end) in enumerate(launched):
        if remainder == 0:
            step = steps[index // per_step][0]
        else:
            step = [s[0] for s in steps if s[1] <= start][-1]
        seconds[step] += (end - start) / 1e9
    return dict(seconds)


# Category from a name alone, first match wins: HLO op names (CPU and GPU: fusion.12, dot.3, copy.1,
# dynamic-update-slice.4, loop_add_fusion, gemm_fusion_dot.2, wrapped_reduce) and GPU kernel names
# (cuBLAS sm90_xmma_gemm_*, nvjet_*, cutlass_*, cuDNN attention cudnn_*/fmha*, Triton triton_*, MemcpyD2D).
_NAME_RULES = (
    ("control_flow", r"^(while|call|conditional)\b"),
    ("collective", "|".join((*hlo.COLLECTIVES, *(c.replace("-", "_") for c in hlo.COLLECTIVES), "nccl"))),
    ("matmul", r"dot|gemm|matmul|convolution|cublas|cutlass|xmma|nvjet|cudnn|fmha|flash"),
    ("dynamic_update_slice", r"dynamic[-_]update[-_]slice"),
    ("copy", r"^copy|transpose|memcpy|memset"),
    ("fusion", r"fusion|^wrapped_|^loop_|^input_|^triton"),
)


def kernel_name(instruction: str) -> str:
    """The name XLA's GPU backend gives the kernel of an HLO instruction: `.` and `-` made `_`."""
    return re.sub(r"[.-]", "_", instruction)


def _name_category(name: str) -> str:
    """Category from a name alone (no HLO at hand): XLA names fusions after what they contain."""
    return next((c for c, pattern in _NAME_RULES if re.search(pattern, name, re.IGNORECASE)), "other")


def op_table(ops: list[OpEvent], num_steps: int, hlo_text: str | None) -> list[dict[str, object]]:
    """Per-op rows (name, category, rematerialized, count, self seconds per step, share), largest first.

    The category comes from the HLO (by instruction name) where given, else from the op's name, else, for
    a GPU op whose name says nothing (custom-call.3), from its kernel's name (the first seen)."""
    table = hlo.op_table(hlo.parse(hlo_text)) if hlo_text else {}
    by_kernel_name = {kernel_name(instruction): instruction for instruction in table}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    kernels: dict[str, str] = {}
    for op in ops:
        totals[op.name][0] += 1
        totals[op.name][1] += op.self_ns / 1e9
        if op.kernel:
            kernels.setdefault(op.name, op.kernel)
    everything = sum(total for _, total in totals.values()) or 1.0
    rows = []
    for name, (count, total) in totals.items():
        category, remat = table.get(name) or table.get(by_kernel_name.get(name, ""), (_name_category(name), None))
        if name not in table and category == "other" and name in kernels:
            category = _name_category(kernels[name])
        rows.append(
            {
                "op": name,
                "kernel": kernels.get(name),
                "category": category,
                "rematerialized": remat,
                "occurrences_per_step": count / max(num_steps, 1),
                "self_s_per_step": total / max(num_steps, 1),
                "share": total / everything,
            }
        )
    return sorted(rows, key=lambda r: -r["self_s_per_step"])


def write_ops_csv(path: pathlib.Path, rows: list[dict[str, object]]) -> None:
    """Writes the per-op table as CSV (one row per HLO op, largest self time first)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["op"])
        writer.writeheader()
        writer.writerows(rows)


def summarize(rows: list[dict[str, object]], step_seconds: dict[int, float]) -> dict[str, object]:
    """Result-row columns: median step time, op time per step, category and remat shares, top op."""
    shares = {category: 0.0 for category in hlo.CATEGORIES}
    for row in rows:
        shares[row["category"]] += row["share"]
    known = [r for r in rows if r["rematerialized"] is not None]
    summary: dict[str, object] = {
        "trace_steps": len(step_seconds),
        "trace_step_s": statistics.median(step_seconds.values()) if step_seconds else None,
        "trace_op_s_per_step": sum(r["self_s_per_step"] for r in rows),
        **{f"trace_{'dus' if c == 'dynamic_update_slice' else c}_share": s for c, s in shares.items()},
        "trace_remat_share": sum(r["share"] for r in known if r["rematerialized"]) if known else None,
        "trace_top_op": rows[0]["op"] if rows else None,
    }
    return summary


def analyze(
    trace_dir: pathlib.Path, hlo_text: str | None = None, write_csv: bool = True
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """Reads the trace under trace_dir; returns (summary columns, per-op rows) and writes trace_dir/ops.csv.

    Args:
      trace_dir: a run directory holding plugins/profile/<timestamp>/*.xplane.pb.
      hlo_text: the compiled step's `as_text()`, for categories and the remat share (optional).
      write_csv: write ops.csv beside the trace.
    """
    trace = read_trace(trace_file(trace_dir))
    step_seconds = step_times(trace.executions, trace.steps)
    rows = op_table(trace.ops, len(step_seconds) or 1, hlo_text)
    summary = {**summarize(rows, step_seconds), "trace_op_source": trace.source}
    if write_csv:
        path = pathlib.Path(trace_dir) / "ops.csv"
        write_ops_csv(path, rows)
        summary["trace_ops_csv"] = str(path)
    return summary, rows


USAGE = Usage(
    command="python -m jaxscale.measure.traces RUN_DIR [--top N]",
    summary="Analyses a captured trace: device time per annotated step, time shares by op category (matmul, "
    "fusion, dynamic-update-slice, copy, control flow, collective, remat) and the top ops; writes RUN_DIR/ops.csv.",
    examples=(
        "python -m jaxscale.measure.traces traces/bf16_remat_cpu_20261121-101500",
        "python -m jaxscale.measure.traces traces/seed_table_cpu/bf16_scan --top 30",
    ),
    notes=(
        "RUN_DIR is a run's directory (holding plugins/profile/<timestamp>/*.xplane.pb and, from jaxscale.run, "
        "step.hlo.txt.gz for categories and the remat share). CPU and GPU traces alike; the columns are "
        "described in docs/measurements.md, 'Trace analysis'.",
    ),  # fmt: skip
)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_integer("top", 15, "How many of the ops with the most self time to print.", lower_bound=0,
                         flag_values=fv)  # fmt: skip
    return fv


def main(argv: list[str]) -> int:
    """`python -m jaxscale.measure.traces RUN_DIR [--top N]`: summary, top ops and ops.csv of a captured trace."""
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        hint = "give one RUN_DIR, e.g. python -m jaxscale.measure.traces traces/<run> [--top N]"
        run_dir = pathlib.Path(one_argument(fv, argv, hint))
    except UsageError as error:
        return fail(str(error))
    hlo_path = run_dir / HLO_FILE
    try:
        hlo_text = gzip.decompress(hlo_path.read_bytes()).decode() if hlo_path.exists() else None
        summary, rows = analyze(run_dir, hlo_text)
    except FileNotFoundError as error:
        return fail(f"RUN_DIR: {error}")
    for key, value in summary.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"\n{'op':48s} {'category':22s} {'remat':>5s} {'ms/step':>9s} {'share':>6s}")
    for row in rows[: fv.top]:
        print(
            f"{row['op'][:48]:48s} {row['category']:22s} {str(row['rematerialized'])[:5]:>5s} "
            f"{row['self_s_per_step'] * 1e3:9.3f} {row['share']:6.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Predicts a train step's time from the kernels of its compiled program: a roofline per kernel, summed.

Each kernel of the compiled step (jaxscale.measure.kernels: GEMMs, fused attention, fusions, copies, dynamic-update-
slices, collectives, each with the trip counts of its loops) takes

    time = max(FLOPs / (peak · efficiency), bytes / (bandwidth · MEMORY_EFFICIENCY)) + LAUNCH_S

where the peak is the one its dtype runs at (bf16/fp16 tensor cores, TF32 for a float32 dot at DEFAULT precision,
float32 CUDA cores for elementwise work; a fused attention kernel's matmuls at the tensor peak times
ATTENTION_EFFICIENCY instead of GEMM_EFFICIENCY, with no tile quantization), and a collective moves its ring-algorithm
bytes over the slowest link its group crosses (NVLink within the target's NVLink domain, PCIe beyond it, the network
across hosts: with a NIC per GPU, all of a host's NICs together, as NCCL spreads its rings over them, capped by the
links inside the host; `link_bytes_per_s`). Within an H100, H200 or A100 NVLink domain an all-reduce, all-gather or
reduce-scatter instead takes the time published nccl-tests runs measured for its buffer size, latency included
(jaxscale.plan.collective_rates); the pure roofline keeps the link rate. The step is the sum over kernels times their
launches (XLA runs one compute kernel at a time on one stream), except what async collectives overlap: a collective
compiled as a -start/-done pair runs on its own stream, and only the part of it that outlasts the compute kernels the
program launches between its start and its -done counts (`exposed`; predicted_collective_hidden_s is the rest). A
synchronous collective counts whole. `predicted_step_lower_bound_s` is the same sum with no efficiency and no launch
cost: the pure roofline. The constants and their sources:

- GEMM_EFFICIENCY 0.80: a GEMM's share of its dtype's dense peak on a card without a measured share (gemm_rates.MAMF):
  the H100 SXM's cuBLAS best-shape 80.3% rounded; assumed for the Ampere workstation and Ada cards (no figure found).
- GEMM_TILE 128: the output tile of a cuBLAS kernel for large GEMMs; with the SM count it gives NVIDIA's tile and wave
  quantization (Matrix Multiplication Background User's Guide, ch. 3): a GEMM of `batch · ceil(m/128) · ceil(n/128)`
  tiles runs in `ceil(tiles / SMs)` waves, and only the useful share of those waves' work counts.
- MEMORY_EFFICIENCY 0.85: sustained share of the datasheet bandwidth in a kernel that reads one array and writes
  another, as most fusions do: STREAM "scale" on an H100 PCIe at full occupancy, 1704 GB/s of 2.0 TB/s
  (te42kyfo/gpu-benches, cuda-stream/h100_pcie.txt); assumed for every other card.
- LAUNCH_S 5.8 µs: the smallest GEMMs of OpenXLA's measured H100 table take 5.9 µs whatever their size (67 MFLOP at
  11.5 TFLOP/s): a fixed cost per kernel of about 5.8 µs once the work (~0.1 µs) is taken out.
- ATTENTION_EFFICIENCY, by GPU generation (compute capability major): the fraction of the tensor peak that
  FlashAttention-2 reaches, its FLOPs counted as its benchmark counts them (causal halved, backward 2.5x the forward:
  the 5 matmuls it runs), so the fraction is the rate of its matmul work; a kernel's matmuls are counted by
  jaxscale.measure.attention_calls (JAX's Pallas backward runs 7, 3.5x the forward). Ampere (8.x; also Ada, 8.9, no
  figure found) 0.50: the low end of "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023, FlashAttention-2,
  arXiv 2307.08691, abstract): JAX's Triton kernel is a re-implementation. Hopper (9.x) 0.35: "FlashAttention-2
  achieving only 35% utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, abstract);
  the Pallas kernel is FlashAttention-2-like (no warp specialization, no TMA pipelining). cuDNN's fused attention gets
  the same figure (none of its own was found). Blackwell (10.x) 0.35: Hopper's, assumed. Not fitted to any step time.
  Where a card's kernels were measured by sequence (jaxscale.plan.attention_rates: the B200's cuDNN and
  FlashAttention-2), its shares replace these.
- FP8 GEMMs (flop_dtype "f8") run at the FP8 dense peak (peaks) x the card's FP8 share (above) x tile quantization;
  the scaling work (amax reductions, casts, scale multiplies) is priced as the memory-bound fusions it compiles to.
- Collective bytes: NCCL's bus-bandwidth factors (nccl-tests doc/PERFORMANCE.md): all-reduce 2(n-1)/n, all-gather,
  reduce-scatter and all-to-all (n-1)/n, collective-permute 1, of the full buffer.

On a CPU the rooflines are this machine's measurements (jaxscale.measure.peaks: the jitted 2048³ matmul in the run's
dtype, float32 for elementwise work, a STREAM-like memory bandwidth), with efficiency 1, no tile quantization and no
launch cost. Nothing here is fitted to a measured step time, unless a run asks for it: `--calibrate RUN_DIR`
(jaxscale.plan.calibrate) fits per-group efficiencies and a launch cost to one measured run's trace and sets them as
Roofline.fitted_efficiency and launch_s; the row then says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import ml_collections

from jaxscale.config import mesh_shape
from jaxscale.config.spec import tokens_per_step
from jaxscale.measure import collectives, flops, kernels, peaks
from jaxscale.plan import attention_rates, collective_rates, gemm_rates, targets

GEMM_EFFICIENCY = 0.80
ATTENTION_EFFICIENCY = {8: 0.50, 9: 0.35, 10: 0.35}  # by compute capability major: Ampere/Ada, Hopper, Blackwell
GEMM_TILE = 128
MEMORY_EFFICIENCY = 0.85
LAUNCH_S = 5.8e-6
BREAKDOWN = ("matmul", "attention", "fusion", "copy_dus", "collective", "launch")  # predicted_<name>_s columns
_GROUP = {"matmul": "matmul", "attention": "attention", "fusion": "fusion", "copy": "copy_dus",
          "dynamic_update_slice": "copy_dus", "collective": "collective"}  # fmt: skip


def breakdown_group(category: str) -> str:
    """The BREAKDOWN group (predicted_<group>_s) a kernel category counts in: copies and updates in copy_dus."""
    return _GROUP[category]


CELL_BASE = 4  # a calibration cell spans a factor of 4 in bytes per launch


def calibration_cell(kernel: kernels.Kernel) -> tuple[str, str, int]:
    """(group, precision, size) of a kernel, the unit a calibration fits one efficiency for (jaxscale.plan.calibrate).

    precision: "16" for 16-bit (or narrower) floating-point work: the matmul's input dtype (flop_dtype), else the
    kernel's result dtype; "32" otherwise. size: floor(log4(bytes per launch)), so a cell holds kernels whose
    working sets are within 4x of each other: a cache level holds them or does not alike.
    """
    dtype = kernel.flop_dtype if kernel.category in ("matmul", "attention") else kernel.dtype
    precision = "16" if dtype in ("bf16", "f16") or dtype.startswith("f8") else "32"
    return breakdown_group(kernel.category), precision, int(math.log(max(kernel.bytes, 1), CELL_BASE))


def fitted_cell(kernel: kernels.Kernel, roof: Roofline) -> tuple[str, str, int] | None:
    """The fitted cell (Roofline.fitted_cells) whose efficiency a kernel takes: its own cell, else the nearest size
    fitted for its group and precision (the larger on a tie: caches are the larger sizes' trouble); None where
    no cell of its group and precision was fitted (it takes its group's efficiency) or none was fitted at all."""
    if not roof.fitted_cells:
        return None
    group, precision, size = calibration_cell(kernel)
    sizes = [s for g, p, s in roof.fitted_cells if (g, p) == (group, precision)]
    return (group, precision, min(sizes, key=lambda s: (abs(s - size), -s))) if sizes else None


def fitted_efficiency(kernel: kernels.Kernel, roof: Roofline) -> float | None:
    """The calibrated efficiency a kernel runs at on `roof` (its fitted_cell's, else its group's
    Roofline.fitted_efficiency), or None on an uncalibrated roofline or for a group the calibration did not fit."""
    cell = fitted_cell(kernel, roof)
    if cell is not None:
        return roof.fitted_cells[cell]
    return (roof.fitted_efficiency or {}).get(breakdown_group(kernel.category))


def calibration_reach(found: Iterable[kernels.Kernel], roof: Roofline) -> dict[str, float | None]:
    """How far a calibrated prediction of a program lies from what its calibration run measured, as shares of the
    program's pure-roofline seconds per step (kernels of a group the calibration did not fit left out):

    - calibration_unseen_share: in kernels whose own cell (calibration_cell) the calibration did not fit, so
      they borrow the nearest size's efficiency or their group's;
    - calibration_above_share: in kernels larger than every size fitted for their group and precision, the
      calibration's efficiency carried to working sets it never measured (on a CPU with glibc's malloc, buffers
      past 32 MiB are faulted in afresh every step: docs/predict.md, "Sizes a calibration did not see").

    Both None on a roofline not calibrated by cell.
    """
    if not roof.fitted_cells:
        return {"calibration_unseen_share": None, "calibration_above_share": None}
    largest: dict[tuple[str, str], int] = {}
    for group, precision, size in roof.fitted_cells:
        largest[group, precision] = max(size, largest.get((group, precision), size))
    total = unseen = above = 0.0
    for kernel in found:
        if fitted_efficiency(kernel, roof) is None:
            continue
        seconds = kernel.times * _roofline_seconds(kernel, roof)[1]
        total += seconds
        cell = calibration_cell(kernel)
        if cell not in roof.fitted_cells:
            unseen += seconds
            if cell[2] > largest.get(cell[:2], cell[2]):
                above += seconds
    share = (lambda part: part / total) if total else (lambda part: 0.0)
    return {"calibration_unseen_share": share(unseen), "calibration_above_share": share(above)}


def collective_factor(op: str, n: int) -> float:
    """Bytes each GPU sends per byte of the full buffer, for a ring over n GPUs (NCCL's bus bandwidth): the
    factor of the row's compiled_collective_ring_bytes (jaxscale.measure.collectives.ring_factor)."""
    return collectives.ring_factor(op, n)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What one device can do, and the efficiencies below it that the prediction assumes."""

    name: str
    matmul_flops_per_s: dict[str, float]  # by kernels.Kernel.flop_dtype: bf16, f16, tf32, f32
    vector_flops_per_s: float  # elementwise work
    memory_bytes_per_s: float
    link_bytes_per_s: float  # collectives within a group of up to link_devices GPUs (NVLink, else PCIe)
    link_devices: int  # GPUs that link joins: the NVLink domain (a bridge: 2), else a host's
    host_bytes_per_s: float  # collectives beyond the link's GPUs within one host (PCIe)
    network_bytes_per_s: float  # collectives that span hosts: one network link (a GPU's NIC, else PCIe)
    devices_per_host: int
    cores: int | None  # SMs, for tile and wave quantization (None: none, a CPU)
    gemm_efficiency: float  # a GEMM's share of its dtype's dense peak, before tile quantization
    attention_efficiency: float  # fused attention kernels' share of the tensor peak
    memory_efficiency: float
    launch_s: float
    source: str
    network_rails: int = 1  # network links per host a collective spreads over (NCCL: one ring per NIC)
    # Fitted on a measured run (jaxscale.plan.calibrate), by BREAKDOWN group: a kernel of a group listed here
    # takes its pure-roofline seconds / this efficiency (+ launch_s) instead of the formula above. None: none.
    fitted_efficiency: dict[str, float] | None = None
    # Fitted per calibration_cell (group, precision, size): a kernel takes the efficiency of its own cell, else of
    # the nearest size of its group and precision, else its group's (fitted_efficiency). None: none.
    fitted_cells: dict[tuple[str, str, int], float] | None = None
    # The host link (a GPU's PCIe slot, per direction): a kernel's bytes in host memory (kernels.Kernel.host_bytes,
    # jaxscale.train.offload) cross it. None: host memory is the device's own (a CPU), priced as memory.
    host_link_bytes_per_s: float | None = None
    # Published nccl-tests times by buffer size (jaxscale.plan.collective_rates), by collective: a collective of one of
    # these kinds within the NVLink domain takes its table's time for its size instead of the datasheet link rate.
    collective_tables: dict[str, collective_rates.SizeTable] | None = None
    # GEMMs at the rate measured for their shape (gemm_rates: OpenXLA's H100 table) where it has one. False: the formula
    gemm_table: bool = False
    # The card's sustained compute over the rates above (targets.GpuTarget.compute_scale: a power-limited card):
    # every kernel's compute time is divided by it, its memory and link time are not.
    compute_scale: float = 1.0
    # the card's measured GEMM shares by dtype (gemm_rates.best_shape_efficiencies), over gemm_efficiency
    gemm_efficiency_by_dtype: dict[str, float] | None = None
    device_kind: str | None = None  # the GPU's, for the tables measured per card (attention_rates); None: a CPU


def gpu_roofline(
    target: targets.GpuTarget, precision: str | None = None, devices_per_host: int = targets.GPUS_PER_HOST
) -> Roofline:
    """The roofline of a GPU target: datasheet peaks (jaxscale.measure.peaks) and the target's bandwidths.

    A collective over up to `target.nvlink_domain` GPUs runs over NVLink; a larger group within one host
    (or any group of a GPU without NVLink) over PCIe; a group that spans hosts over the network.

    Raises:
      ValueError: the peak table has no entry for the target's device_kind, or ATTENTION_EFFICIENCY none for its
        generation.
    """
    peak = peaks.find_peak(target.device_kind)
    if peak is None or peak.bfloat16 is None or peak.float32 is None:
        raise ValueError(f"no datasheet peak for {target.device_kind!r} (add it to jaxscale/measure/peaks.py)")
    generation = target.compute_capability[0]
    if generation not in ATTENTION_EFFICIENCY:
        known = ", ".join(f"{g}.x" for g in ATTENTION_EFFICIENCY)
        raise ValueError(f"no flash-attention efficiency for compute capability {generation}.x (known: {known})")
    attention = ATTENTION_EFFICIENCY[generation]
    full_fp32 = (precision or "").lower() in ("highest", "float32", "fp32")
    nvlink = target.nvlink_bandwidth is not None and target.nvlink_domain is not None
    measured_shares = gemm_rates.best_shape_efficiencies(target.device_kind)
    shares = ", ".join(f"{dtype} {share:.1%}" for dtype, share in measured_shares.items())
    return Roofline(
        name=target.name,
        matmul_flops_per_s={
            "bf16": peak.bfloat16,
            "f16": peak.float16 or peak.bfloat16,
            "tf32": peak.float32 if full_fp32 or peak.tf32 is None else peak.tf32,
            "f32": peak.float32,
            "f8": peak.fp8 or peak.bfloat16,  # a GPU without FP8 (none is planned: model.fp8 is refused there)
        },
        vector_flops_per_s=peak.float32,
        memory_bytes_per_s=float(target.memory_bandwidth),
        link_bytes_per_s=float(target.nvlink_bandwidth if nvlink else target.pcie_bandwidth),
        link_devices=min(target.nvlink_domain, devices_per_host) if nvlink else devices_per_host,
        host_bytes_per_s=float(target.pcie_bandwidth),
        network_bytes_per_s=float(target.network_bandwidth or target.pcie_bandwidth),
        devices_per_host=devices_per_host,
        cores=target.core_count,
        gemm_efficiency=GEMM_EFFICIENCY,
        gemm_efficiency_by_dtype=measured_shares or None,
        device_kind=target.device_kind,
        attention_efficiency=attention,
        memory_efficiency=MEMORY_EFFICIENCY,
        launch_s=LAUNCH_S,
        network_rails=devices_per_host if target.network_bandwidth else 1,
        host_link_bytes_per_s=float(target.pcie_bandwidth),
        collective_tables=collective_rates.tables_for(target.name) if nvlink else None,
        gemm_table=generation in gemm_rates.ARCHITECTURES,
        compute_scale=target.planned_compute_scale,
        source=f"{peak.source}; {target.source}; links: {target.interconnect_source}; "
        + (f"compute at {target.planned_compute_scale:.3f} of the rates below (the middle of "
           f"{target.compute_scale[0]:.3f}-{target.compute_scale[1]:.3f}: {target.compute_scale_source}); "
           if target.planned_compute_scale < 1 else "")
        + f"{collective_rates.source_text(target.name if nvlink else '')}; efficiencies: GEMM "
        + (f"bf16/fp16/TF32 at the rate measured for its shape ({gemm_rates.SOURCE}), other dtypes "
           if generation in gemm_rates.ARCHITECTURES else "")
        + (f"the card's measured best-shape share of peak ({shares}; {gemm_rates.MAMF_SOURCE}), else "
           if measured_shares else "")
        + f"{GEMM_EFFICIENCY:.0%} of peak with {GEMM_TILE}x{GEMM_TILE} tile/wave quantization, fused attention "
        + (f"by kernel and sequence as measured ({attention_rates.SOURCE}), else "
           if target.device_kind in attention_rates.CARD else "")
        + f"{attention:.0%} (published FlashAttention-2 figure for compute capability {generation}.x), memory "
        f"{MEMORY_EFFICIENCY:.0%}, launch {LAUNCH_S * 1e6:.1f} us per kernel (jaxscale/plan/predict.py)",
    )


def cpu_roofline(shared_by: int = 1) -> Roofline:
    """This machine's measured rooflines (cached per machine, see jaxscale.measure.peaks).

    Simulated CPU devices (--xla_force_host_platform_device_count) run their programs at once on the same
    cores and memory: each of `shared_by` devices gets that share of the machine's FLOP/s and bandwidth.
    """
    f32, f32_source = peaks.measured_peak("float32")
    bf16, _ = peaks.measured_peak("bfloat16")
    bandwidth, bandwidth_source = peaks.measured_bandwidth()
    share = 1 / max(1, shared_by)
    shared = f"; one of {shared_by} simulated devices sharing them (1/{shared_by} each)" if shared_by > 1 else ""
    return Roofline(
        name="cpu",
        matmul_flops_per_s={"bf16": bf16 * share, "f16": bf16 * share, "tf32": f32 * share, "f32": f32 * share,
                            "f8": bf16 * share},  # a CPU has no FP8 units: XLA converts and multiplies in bf16
        vector_flops_per_s=f32 * share,
        memory_bytes_per_s=bandwidth * share,
        link_bytes_per_s=bandwidth * share,
        link_devices=1,
        host_bytes_per_s=bandwidth * share,
        network_bytes_per_s=bandwidth * share,
        devices_per_host=1,
        cores=None,
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        memory_efficiency=1.0,
        launch_s=0.0,
        source=f"{f32_source}; {bandwidth_source}{shared}; no efficiency factors, no launch cost",
    )


def quantization(gemm: tuple[int, int, int, int] | None, cores: int | None) -> float:
    """Useful share of the work a GEMM's tiles and waves occupy (1.0 without an SM count)."""
    if gemm is None or cores is None:
        return 1.0
    batch, m, n, _ = gemm
    tiles = max(1, batch) * math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
    waves = math.ceil(tiles / cores)
    return max(1, batch) * m * n / (waves * cores * GEMM_TILE * GEMM_TILE)


def link_bytes_per_s(roof: Roofline, group: int) -> float:
    """The bandwidth a collective over `group` devices runs at: the slowest link its rings cross (NVLink
    within the NVLink domain, PCIe beyond it within a host, the network across hosts).

    Across hosts with one NIC per GPU (a DGX/HGX system), NCCL runs one ring per NIC ("rails"), each carrying
    its share of the buffer and crossing each host boundary on its own NIC, while every GPU still sends its
    whole ring traffic over the links inside its host: the collective runs at the slower of the host's
    `network_rails` NICs together and the link inside the host. A group is taken to fill its hosts (the
    mesh's devices are consecutive), as everywhere in this model.
    """
    if group <= roof.link_devices:
        return roof.link_bytes_per_s
    if group <= roof.devices_per_host:
        return roof.host_bytes_per_s
    inside = roof.link_bytes_per_s if roof.link_devices >= roof.devices_per_host else roof.host_bytes_per_s
    return min(inside, roof.network_rails * roof.network_bytes_per_s)


def kernel_seconds(kernel: kernels.Kernel, roof: Roofline) -> tuple[float, float]:
    """(predicted seconds without launch cost, pure-roofline seconds) of one launch of a kernel.

    On a calibrated roofline (fitted_efficiency: the kernel's cell or group was fitted) the prediction is the
    pure-roofline seconds / the fitted efficiency."""
    seconds, bound = _roofline_seconds(kernel, roof)
    fitted = fitted_efficiency(kernel, roof)
    return (bound / fitted if fitted else seconds), bound


def _roofline_seconds(kernel: kernels.Kernel, roof: Roofline) -> tuple[float, float]:
    """kernel_seconds with the published efficiencies (the uncalibrated formula)."""
    if kernel.collective is not None:
        op, group, payload = kernel.collective
        bandwidth = link_bytes_per_s(roof, group)
        if op == "collective-permute" and group > roof.devices_per_host:  # each GPU sends its buffer on its own NIC
            bandwidth = min(bandwidth, roof.network_bytes_per_s)
        bound = collective_factor(op, group) * payload / bandwidth
        table = (roof.collective_tables or {}).get(op) if 1 < group <= roof.link_devices else None
        return (collective_rates.seconds(table, op, group, payload) if table else bound), bound
    if kernel.category == "matmul":
        peak = roof.matmul_flops_per_s.get(kernel.flop_dtype, roof.matmul_flops_per_s["f32"])
        measured = gemm_rates.rate(kernel.flop_dtype, kernel.gemm) if roof.gemm_table else None
        # the measured rate as a share of the dtype's peak (at most all of it: the pure roofline stays a bound)
        share = (roof.gemm_efficiency_by_dtype or {}).get(kernel.flop_dtype, roof.gemm_efficiency)
        formula = share * quantization(kernel.gemm, roof.cores)
        efficiency = min(1.0, measured / peak) if measured else formula
    elif kernel.category == "attention":
        peak = roof.matmul_flops_per_s.get(kernel.flop_dtype, roof.matmul_flops_per_s["f32"])
        efficiency = attention_rates.share(roof.device_kind, kernel) or roof.attention_efficiency
    else:
        peak, efficiency = roof.vector_flops_per_s, 1.0
    compute = kernel.flops / (peak * roof.compute_scale)
    host = kernel.host_bytes if roof.host_link_bytes_per_s else 0  # over the host link, at its full rate
    link = host / roof.host_link_bytes_per_s if host else 0.0
    memory = (kernel.bytes - host) / roof.memory_bytes_per_s
    return max(compute / efficiency, memory / roof.memory_efficiency, link), max(compute, memory, link)


def exposed(found: list[kernels.Kernel], seconds: list[float]) -> list[float]:
    """Per kernel, the seconds per step it adds to the step: all of a compute kernel's; of a collective, what
    the compute kernels between its start and its -done (Kernel.window) do not hide.

    An async collective runs on its own stream while the compute stream goes on, and the compute stream waits
    at its -done: the collective costs the step only what outlasts the kernels launched in between. One
    collective stream: each compute kernel's time hides one collective at most, given to the collectives in
    program order (two collectives in flight at once share the link, so they cannot hide behind the same
    kernel twice). A synchronous collective (no window) is all exposed.
    """
    out = list(seconds)
    hiding = [0.0 if k.collective is not None or k.window is not None else s  # async kernels hide nothing
              for k, s in zip(found, seconds, strict=True)]  # fmt: skip
    for i, kernel in enumerate(found):
        if kernel.window is None:  # synchronous: nothing hides it
            continue
        left = seconds[i]
        first, last = kernel.window
        for j in range(first, last + 1):
            if left <= 0:
                break
            used = min(left, hiding[j])
            hiding[j] -= used
            left -= used
        out[i] = left
    return out


def predict(found: Iterable[kernels.Kernel], roof: Roofline) -> dict[str, float]:
    """Seconds per step: predicted_step_s, predicted_step_lower_bound_s, predicted_<BREAKDOWN>_s (the
    collectives' exposed seconds; predicted_collective_hidden_s what compute hides of them), and
    predicted_kernel_launches (per step)."""
    found = list(found)
    per_kernel = [kernel_seconds(kernel, roof) for kernel in found]
    predicted = exposed(found, [k.times * s for k, (s, _) in zip(found, per_kernel, strict=True)])
    bound = exposed(found, [k.times * b for k, (_, b) in zip(found, per_kernel, strict=True)])
    totals = dict.fromkeys(BREAKDOWN, 0.0)
    hidden, launches = {"collective": 0.0, "host": 0.0}, 0
    for kernel, (seconds, _), shown in zip(found, per_kernel, predicted, strict=True):
        totals[_GROUP[kernel.category]] += shown
        hidden["collective" if kernel.collective is not None else "host"] += kernel.times * seconds - shown
        totals["launch"] += kernel.times * roof.launch_s
        launches += kernel.times
    return {
        "predicted_step_s": sum(totals.values()),
        "predicted_step_lower_bound_s": sum(bound),
        **{f"predicted_{name}_s": value for name, value in totals.items()},
        "predicted_collective_hidden_s": hidden["collective"],
        "predicted_kernel_launches": launches,
        **host_link_columns(found, roof, hidden["host"]),
    }


def host_link_columns(found: list[kernels.Kernel], roof: Roofline, hidden: float) -> dict[str, float | None]:
    """The host link's share of a step (jaxscale.train.offload): predicted_host_link_bytes, what the kernels move
    between host and device memory per step (transfers, and host buffers read or written in place);
    predicted_host_link_s, those bytes at the link's rate (the target's PCIe, per direction, both directions counted
    one after the other: an upper bound where they overlap); predicted_host_link_hidden_s, what the compute kernels
    run between an async transfer's start and its -done hide of it (the schedule XLA compiled: the optimizer state
    is fetched only once the gradients exist, so its transfers overlap the update's kernels at most). A kernel's
    link time is already inside its group's predicted_<group>_s (a kernel takes the longest of its compute, memory
    and link times); these columns say how much of the step the link is. None on a CPU (no host link)."""
    if not roof.host_link_bytes_per_s:
        return {"predicted_host_link_bytes": None, "predicted_host_link_s": None, "predicted_host_link_hidden_s": None}
    moved = sum(k.times * k.host_bytes for k in found)
    return {"predicted_host_link_bytes": moved, "predicted_host_link_s": moved / roof.host_link_bytes_per_s,
            "predicted_host_link_hidden_s": hidden}  # fmt: skip


def step_columns(
    config: ml_collections.ConfigDict,
    found: list[kernels.Kernel],
    roof: Roofline,
    peak: float | None,
    fp8_peak: float | None = None,
) -> dict[str, object]:
    """The predicted_* columns of a row for one compiled program on one roofline.

    Args:
      config: the run's config (tokens per step, model FLOPs).
      found: the program's kernels (jaxscale.measure.kernels.kernels).
      roof: the device's roofline.
      peak: the peak FLOP/s that MFU divides by (the same as the row's `mfu` uses), or None.
      fp8_peak: with model.fp8, the FP8 tensor peak a second MFU divides by (predicted_mfu_fp8_peak), or None.
    Returns:
      predicted_step_s and its breakdown (see predict), predicted_tokens_per_s, predicted_mfu (the analytic
      model FLOPs, flops.model_flops_per_step, the numerator of the row's `mfu`: attention over the full T x T
      square, whatever the kernels compute),
      predicted_unknown_trip_count_kernels (kernels in a loop of unknown trip count, counted once)
      and predicted_roofline_source.
    """
    found = kernels.resolve_causal(found, bool(config.model.causal))  # the Pallas calls' HLO does not say
    columns: dict[str, object] = dict(predict(found, roof))
    step = columns["predicted_step_s"]
    tokens = tokens_per_step(config)
    model_flops = flops.model_flops_per_step(config)
    columns["predicted_tokens_per_s"] = tokens / step if step else None
    columns["predicted_mfu"] = model_flops / step / peak if step and peak else None
    if config.model.fp8 != "none":  # the same FLOPs against the FP8 peak, labelled (NVIDIA's FP8 tables divide so)
        columns["predicted_mfu_fp8_peak"] = model_flops / step / fp8_peak if step and fp8_peak else None
    columns["predicted_unknown_trip_count_kernels"] = sum(None in k.trips for k in found)
    columns["predicted_roofline_source"] = roof.source
    return columns


def target_columns(
    config: ml_collections.ConfigDict,
    target: targets.GpuTarget,
    by_mode: dict[str, list[kernels.Kernel]],
    devices: int = 1,
) -> dict[str, object]:
    """Predicted columns of a GPU target's plan, from the kernels of each compiled GEMM mode.

    On the GPU, XLA's autotuner picks Triton or cuBLAS per GEMM; the faster of the two whole programs is
    reported (predicted_gemm names it), both are kept as predicted_<mode>_step_s. A target without a
    datasheet peak gets null columns and predicted_error. On `devices` GPUs (a mesh) the program is one
    device's share of the step, run on every device at once: the step's tokens and model FLOPs are the
    whole mesh's, so predicted MFU divides by the mesh's peak (devices x one GPU's), as the row's `mfu` does.
    """
    try:
        roof = gpu_roofline(target)
    except ValueError as error:
        return {"predicted_step_s": None, "predicted_error": str(error)}
    peak, _ = peaks.peak_flops(target.device_kind, config.model.dtype)
    peak = None if peak is None else peak * devices
    fp8_peak, _ = peaks.peak_flops(target.device_kind, peaks.FP8)
    fp8_peak = None if fp8_peak is None else fp8_peak * devices
    per_mode = {mode: step_columns(config, found, roof, peak, fp8_peak) for mode, found in by_mode.items()}
    best = min(per_mode, key=lambda m: per_mode[m]["predicted_step_s"])
    ends = [dataclasses.replace(roof, compute_scale=end) for end in target.compute_scale]  # the step at each end
    bounds = {"predicted_step_s_range": [min(step_columns(config, found, end, peak, fp8_peak)["predicted_step_s"]
              for found in by_mode.values()) for end in ends]} if len(set(target.compute_scale)) > 1 else {}
    return {
        **per_mode[best],
        "predicted_gemm": best,
        **{f"predicted_{mode}_step_s": columns["predicted_step_s"] for mode, columns in per_mode.items()},
        **bounds,
    }


def local_roofline(device: jax.Device, devices: int = 1) -> Roofline | None:
    """The roofline of the device a run executes on: measured on a CPU (shared by the mesh's `devices` simulated
    devices, cpu_roofline); on a GPU the targets-table entry with the same device_kind (None when there is none:
    the row then has no prediction)."""
    if device.platform == "cpu":
        return cpu_roofline(devices)
    match = next((t for t in targets.TARGETS.values() if t.device_kind == device.device_kind), None)
    return gpu_roofline(match) if match is not None else None


def local_peak(config: ml_collections.ConfigDict, device: jax.Device, dtype: str | None = None) -> float | None:
    """The peak predicted MFU divides by, as the row's `mfu` (flops.utilization_columns): a mesh of GPUs has
    devices x one GPU's; simulated CPU devices share the one machine's measured roofline. `dtype`: another
    peak than the compute dtype's (peaks.FP8)."""
    peak, _ = peaks.resolve_peak(dtype or config.model.dtype, device)
    devices = mesh_shape(config).devices
    return peak * devices if peak is not None and device.platform != "cpu" else peak


def local_columns(config: ml_collections.ConfigDict, hlo_text: str, device: jax.Device) -> dict[str, object]:
    """Predicted columns for a program compiled for this machine's device (see local_roofline): one device's
    share of the step, on its share of the machine."""
    roof = local_roofline(device, mesh_shape(config).devices)
    if roof is None:
        return {"predicted_step_s": None, "predicted_error": f"no roofline for device_kind {device.device_kind!r}"}
    fp8_peak = local_peak(config, device, peaks.FP8) if device.platform != "cpu" else None  # a CPU has no FP8 peak
    return step_columns(config, kernels.kernels(hlo_text), roof, local_peak(config, device), fp8_peak)


def over_measured(row: dict) -> float | None:
    """predicted_step_s / step_s_median, where the row has both."""
    predicted, measured = row.get("predicted_step_s"), row.get("step_s_median")
    return predicted / measured if predicted and measured else None


def rank_by_predicted_throughput(rows: Iterable[dict], fitting_only: bool = True) -> list[dict]:
    """Rows ordered by predicted tokens/s, fastest first: for the fit planner to rank variants.

    Args:
      rows: result rows (of --plan --target runs, or of runs on this machine).
      fitting_only: drop rows whose plan does not fit (plan_fits False) or whose status is not ok.
    Returns:
      The rows with a prediction, each with `predicted_rank` (1 = fastest) added.
    """
    kept = [
        dict(r)
        for r in rows
        if r.get("predicted_tokens_per_s")
        and (not fitting_only or (r.get("status", "ok") == "ok" and r.get("plan_fits") is not False))
    ]
    kept.sort(key=lambda r: -r["predicted_tokens_per_s"])
    for rank, row in enumerate(kept, start=1):
        row["predicted_rank"] = rank
    return kept


def summary_line(row: dict) -> str:
    """One line for the run summary: the predicted step, its breakdown, and predicted/measured where measured."""
    where = row.get("plan_target") or row.get("backend") or "?"
    if row.get("prediction_calibrated_on"):
        where += f", calibrated on {row['prediction_calibrated_on']}"
    gemm = f", {row['predicted_gemm']} GEMMs" if row.get("predicted_gemm") else ""
    parts = " + ".join(f"{name.replace('_', '/')} {row.get(f'predicted_{name}_s') or 0:.3g}" for name in BREAKDOWN)
    text = (
        f"  predicted step ({where}{gemm}): {row['predicted_step_s']:.4g} s = {parts} s over "
        f"{row.get('predicted_kernel_launches')} kernels; roofline bound {row['predicted_step_lower_bound_s']:.4g} s"
    )
    if row.get("predicted_collective_hidden_s"):
        text += f"; {row['predicted_collective_hidden_s']:.3g} s of collectives hidden behind compute"
    if row.get("predicted_host_link_bytes"):
        text += (f"; host link (offload) {row['predicted_host_link_bytes'] / 1e9:.3g} GB a step, "
                 f"{row['predicted_host_link_s']:.3g} s at the host link's rate, "
                 f"{row['predicted_host_link_hidden_s']:.3g} s of it hidden behind compute")  # fmt: skip
    if row.get("predicted_mfu") is not None:
        text += f"; MFU {row['predicted_mfu']:.1%}"
    if row.get("calibration_above_share"):
        text += (
            f"; {row['calibration_above_share']:.0%} of its roofline time in kernels larger than any its "
            "calibration run measured (extrapolated)"
        )
    if row.get("predicted_over_measured") is not None:
        text += f"; predicted/measured {row['predicted_over_measured']:.2f}"
        if where == "cpu":  # this machine's own rooflines, uncalibrated
            text += CPU_UNCALIBRATED
    return text


# Why an uncalibrated CPU prediction undershoots the measured step (docs/predict.md, "Check 2: this CPU"), said where
# the ratio is printed so that a first run does not read as the lab doubting itself.
CPU_UNCALIBRATED = (
    " (uncalibrated on a CPU: a lower bound, since the model's small matmuls, its elementwise work and XLA:CPU's "
    "per-op cost run below the measured rooflines it assumes; --calibrate RUN_DIR fits them to one measured run, "
    "docs/predict.md)"
)

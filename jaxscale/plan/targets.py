"""GPU targets for deviceless planning: XLA GpuTargetConfig text protos built from a table of NVIDIA GPUs.

Each `GpuTarget` holds the figures XLA's GPU compiler reads (compute capability, SM count, memory size and
bandwidth, L2, clock) and names their source; the per-architecture limits (threads, shared memory,
registers) come from `ARCH_LIMITS`. `target_config_text` renders one as the text proto that
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` takes.

`device_kind` is the string `jax.devices()[0].device_kind` reports on that GPU (XLA's
`device_description_str`); the peak FLOP/s table (`jaxscale.peaks`) is keyed by it, so the two tables join.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

# The per-architecture limits live on the config floor (the flash kernel's block rule reads them too).
from jaxscale.config.gpu_arch import ARCH_LIMITS, COMMON_LIMITS

MIB = 2**20

# Software versions written into every target: CUDA 12.8 and cuDNN 9.8 (the lowest cuDNN that jax[cuda12]
# 0.10.2 accepts). The memory plan does not depend on them; XLA reads them to decide what libraries exist.
RUNTIME_VERSION = (12, 8, 0)
DNN_VERSION = (9, 8, 0)

TORCHTITAN_H100_BENCHMARK = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ "
                             "820504e20d1149fbf0b98c567af24c4b0433b22d")
_OPENXLA_SPECS = "OpenXLA xla/tools/hlo_opt/gpu_specs/{} (figures read from a real device)"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One NVIDIA GPU as XLA's compiler sees it.

    Attributes:
      name: the short name used on the command line (`--target a5000`).
      device_kind: what `jax.devices()[0].device_kind` reports on this GPU.
      compute_capability: (major, minor), e.g. (8, 6); picks the limits in ARCH_LIMITS.
      core_count: streaming multiprocessors (SMs).
      device_memory_size: bytes of device memory as CUDA reports them (what XLA's memory limit is based on).
      memory_bandwidth: bytes per second.
      l2_cache_size: bytes.
      clock_rate_ghz: SM boost clock.
      source: where the figures come from.
    """

    name: str
    device_kind: str
    compute_capability: tuple[int, int]
    core_count: int
    device_memory_size: int
    memory_bandwidth: int
    l2_cache_size: int
    clock_rate_ghz: float
    source: str
    config_text: str | None = None  # a user's own text proto (from a file); None builds it from the fields
    # Links for collectives, bytes/s per direction per GPU (see INTERCONNECT_SOURCES): NVLink among the GPUs
    # of one NVLink domain of `nvlink_domain` GPUs (None: no NVLink), the host's PCIe slot (among the GPUs of
    # one host beyond the NVLink domain), and the network to other hosts (None: not part of a reference
    # system; a collective across hosts is then costed at PCIe speed, the card's own limit).
    nvlink_bandwidth: int | None = None
    nvlink_domain: int | None = None  # GPUs that NVLink joins: a bridge 2, an HGX/DGX NVSwitch baseboard 8
    pcie_bandwidth: int = 31_500_000_000
    network_bandwidth: int | None = None
    interconnect_source: str = "not given: PCIe 4.0 x16 assumed, no NVLink, no network"
    # The board power limit the card runs at (None: its default). The card's sustained compute over the rates the
    # predictor's GEMM, attention and vector figures are for (the datasheet part at its default limit): a range where
    # the source gives only bounds, planned at its middle and reported at both ends (jaxscale.plan.predict).
    power_limit_w: int | None = None
    compute_scale: tuple[float, float] = (1.0, 1.0)
    compute_scale_source: str = ""

    @property
    def planned_compute_scale(self) -> float:
        """The compute_scale a plan is made at: the middle of the range (1.0 for a card at its datasheet rates)."""
        return sum(self.compute_scale) / 2

    def validate(self) -> None:
        """Raises ValueError naming the first field XLA cannot plan with (zero memory makes its limit 0)."""
        for field in ("device_memory_size", "core_count", "memory_bandwidth", "l2_cache_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"target {self.name}: {field} must be a positive integer, got {value!r}")
        if (self.nvlink_bandwidth is None) != (self.nvlink_domain is None) or (self.nvlink_domain or 2) < 2:
            raise ValueError(f"target {self.name}: nvlink_bandwidth and nvlink_domain (>= 2 GPUs) go together, "
                             f"got {self.nvlink_bandwidth!r} and {self.nvlink_domain!r}")  # fmt: skip
        low, high = self.compute_scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"target {self.name}: compute_scale must be 0 < low <= high <= 1, got "
                             f"{self.compute_scale}")  # fmt: skip
        if self.config_text is not None:
            return
        if not self.clock_rate_ghz > 0:
            raise ValueError(f"target {self.name}: clock_rate_ghz must be > 0, got {self.clock_rate_ghz!r}")
        if self.compute_capability not in ARCH_LIMITS:
            known = ", ".join(f"{a}.{b}" for a, b in ARCH_LIMITS)
            raise ValueError(f"target {self.name}: compute_capability {self.compute_capability}; known: {known}")


# Interconnect figures, bytes/s per direction per GPU (NVIDIA quotes NVLink bidirectionally: halved here).
PCIE4_X16 = 31_500_000_000  # PCI-SIG: 16 GT/s x 16 lanes, 128b/130b encoding = 31.5 GB/s per direction
PCIE5_X16 = 63_000_000_000  # PCI-SIG: 32 GT/s x 16 lanes = 63 GB/s per direction
INTERCONNECT_SOURCES: dict[str, str] = {
    "a5000": "NVIDIA RTX A5000 datasheet: an NVLink bridge connects two RTX A5000 GPUs (NVLink domain of 2), "
    "112.5 GB/s bidirectional; PCIe 4.0 x16; no network",
    "a6000": "NVIDIA RTX A6000 datasheet: an NVLink bridge connects two RTX A6000 GPUs (NVLink domain of 2), "
    "112.5 GB/s bidirectional; PCIe 4.0 x16; no network",
    "a100": "A100 datasheet: NVLink 600 GB/s (bidirectional), PCIe 4.0 x16; DGX A100 datasheet: 8 A100 SXM4 GPUs "
    "joined by 6 NVSwitches (NVLink domain of 8), one 200 Gb/s HDR InfiniBand ConnectX-6 per GPU (25 GB/s)",
    "h100": "H100 datasheet: NVLink 900 GB/s (bidirectional), PCIe 5.0 x16; DGX H100 datasheet: 8 H100 SXM5 GPUs "
    "joined by 4 NVSwitches (NVLink domain of 8), one 400 Gb/s ConnectX-7 per GPU (50 GB/s)",
    "h100-96gb-500w": "torchtitan's benchmark (benchmarks/llama3_h100_202412_torchtitan.md): \"Each host has 8 NVIDIA "
    "H100 GPUs fully connected with NVLink\" (NVLink domain of 8, taken at the H100's NVLink 4, 900 GB/s "
    "bidirectional), PCIe 5.0 x16; \"backend RDMA network with 400 Gb/s per GPU\" (50 GB/s)",
    "h200": "H200 datasheet: NVLink 900 GB/s (bidirectional), PCIe 5.0 x16; HGX H200 (8 GPUs on NVSwitch: "
    "NVLink domain of 8) networked like DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s)",
    "b200": "NVIDIA HGX B200 datasheet: fifth-generation NVLink 1.8 TB/s (bidirectional) per GPU, 8 GPUs on "
    "NVSwitch (NVLink domain of 8), PCIe Gen5 128 GB/s (bidirectional); DGX B200 datasheet: 8 single-port 400 Gb/s "
    "ConnectX-7 for the compute fabric (50 GB/s per GPU)",
    "gb200": "NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs on one NVLink Switch System (NVLink domain of 72), "
    "130 TB/s of NVLink for the rack = 1.8 TB/s (bidirectional) per GPU; each GB200 superchip joins one Grace CPU "
    "and two GPUs over NVLink-C2C, 900 GB/s bidirectional, taken as shared by its two GPUs (225 GB/s per GPU per "
    "direction; NVIDIA gives no per-GPU split): the host link offload and host traffic cross; DGX GB200 datasheet: "
    "72 single-port 400 Gb/s ConnectX-7 for the compute fabric (50 GB/s per GPU)",
    "pcie-only": "datasheet: no NVLink; PCIe 4.0 x16; no network",
}

TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget(
            name="a5000",
            device_kind="NVIDIA RTX A5000",
            compute_capability=(8, 6),
            core_count=64,
            device_memory_size=24564 * MIB,
            memory_bandwidth=768_000_000_000,
            l2_cache_size=6 * MIB,
            clock_rate_ghz=1.695,
            source="NVIDIA RTX A5000 datasheet (8192 CUDA cores = 64 SMs, 768 GB/s, 1695 MHz boost), GA102 L2 6 MB; "
            "memory = nvidia-smi total 24564 MiB on the notebook's reference GPU",
            nvlink_bandwidth=56_250_000_000,
            nvlink_domain=2,
            pcie_bandwidth=PCIE4_X16,
            interconnect_source=INTERCONNECT_SOURCES["a5000"],
        ),
        GpuTarget(
            name="a6000",
            device_kind="NVIDIA RTX A6000",
            compute_capability=(8, 6),
            core_count=84,
            device_memory_size=49140 * MIB,
            memory_bandwidth=768_000_000_000,
            l2_cache_size=6 * MIB,
            clock_rate_ghz=1.8,
            source="NVIDIA RTX A6000 datasheet (10752 CUDA cores = 84 SMs, 48 GB GDDR6, 768 GB/s), GA102 L2 6 MB, "
            "1800 MHz boost (TechPowerUp GPU database); memory = nvidia-smi total 49140 MiB as commonly reported",
            nvlink_bandwidth=56_250_000_000,
            nvlink_domain=2,
            pcie_bandwidth=PCIE4_X16,
            interconnect_source=INTERCONNECT_SOURCES["a6000"],
        ),
        GpuTarget(
            name="a100-40gb",
            device_kind="NVIDIA A100-SXM4-40GB",
            compute_capability=(8, 0),
            core_count=108,
            device_memory_size=42331013120,
            memory_bandwidth=1_555_200_000_000,
            l2_cache_size=40 * MIB,
            clock_rate_ghz=1.41,
            source=_OPENXLA_SPECS.format("a100_sxm_40.txtpb"),
            nvlink_bandwidth=300_000_000_000,
            nvlink_domain=8,
            pcie_bandwidth=PCIE4_X16,
            network_bandwidth=25_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["a100"],
        ),
        GpuTarget(
            name="a100-80gb",
            device_kind="NVIDIA A100-SXM4-80GB",
            compute_capability=(8, 0),
            core_count=108,
            device_memory_size=85100068864,
            memory_bandwidth=2_039_040_000_000,
            l2_cache_size=40 * MIB,
            clock_rate_ghz=1.41,
            source=_OPENXLA_SPECS.format("a100_sxm_80.txtpb"),
            nvlink_bandwidth=300_000_000_000,
            nvlink_domain=8,
            pcie_bandwidth=PCIE4_X16,
            network_bandwidth=25_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["a100"],
        ),
        GpuTarget(
            name="h100",
            device_kind="NVIDIA H100 80GB HBM3",
            compute_capability=(9, 0),
            core_count=132,
            device_memory_size=84978434048,
            memory_bandwidth=3_352_320_000_000,
            l2_cache_size=50 * MIB,
            clock_rate_ghz=1.98,
            source=_OPENXLA_SPECS.format("h100_sxm.txtpb") + "; H100 SXM5",
            nvlink_bandwidth=450_000_000_000,
            nvlink_domain=8,
            pcie_bandwidth=PCIE5_X16,
            network_bandwidth=50_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["h100"],
        ),
        GpuTarget(
            name="h100-96gb-500w",
            device_kind="NVIDIA H100 96GB HBM2e",  # no device string of this card was published: named for it
            compute_capability=(9, 0),
            core_count=132,
            device_memory_size=96_000_000_000,
            memory_bandwidth=2_400_000_000_000,
            l2_cache_size=50 * MIB,
            clock_rate_ghz=1.98,
            source=f"{TORCHTITAN_H100_BENCHMARK}: \"Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak "
            "memory bandwidth\" (96 GB taken as 96e9 bytes, the least the label allows: CUDA's figure for this card is "
            "not published), \"HBM2e-based SXM H100\": an SXM H100's 132 SMs, L2 and clock as the h100 target",
            nvlink_bandwidth=450_000_000_000,
            nvlink_domain=8,
            pcie_bandwidth=PCIE5_X16,
            network_bandwidth=50_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["h100-96gb-500w"],
            power_limit_w=500,
            # the H100 NVL's dense bf16 peak over the H100 SXM5's (NVIDIA datasheets: 1,671 and 1,979 TFLOP/s sparse)
            compute_scale=(835.5 / 989.4, 1.0),
            compute_scale_source=f"{TORCHTITAN_H100_BENCHMARK}: \"We used the default 500W power limit\"; "
            "\"HBM2e-based SXM H100 with lower TDP, the actual peak TFLOPs number is between SXM and NVL, and we don't "
            "know its exact value\": from the H100 NVL's dense bf16 peak over the SXM5's (835.5 / 989.4 TFLOP/s) to "
            "the SXM5's rates",
        ),
        GpuTarget(
            name="h200",
            device_kind="NVIDIA H200",
            compute_capability=(9, 0),
            core_count=132,
            device_memory_size=143771 * MIB,
            memory_bandwidth=4_800_000_000_000,
            l2_cache_size=50 * MIB,
            clock_rate_ghz=1.98,
            source="NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, SXM); SMs, L2 and clock as H100 SXM (same GH100 "
            "configuration); memory = nvidia-smi total 143771 MiB (may exceed what CUDA reports by ~0.5 GiB)",
            nvlink_bandwidth=450_000_000_000,
            nvlink_domain=8,
            pcie_bandwidth=PCIE5_X16,
            network_bandwidth=50_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["h200"],
        ),
        GpuTarget(
            name="b200",
            device_kind="NVIDIA B200",
            compute_capability=(10, 0),
            core_count=148,
            device_memory_size=191514411008,
            memory_bandwidth=7_672_320_000_000,
            l2_cache_size=132644864,
            clock_rate_ghz=1.965,
            source="OpenXLA xla/backends/gpu/target_config/specs/b200.txtpb @ 300ec95 (figures read from a real "
            "device: 148 SMs, 191514411008 B, 7.67 TB/s, 126.5 MiB L2, 1965 MHz); HGX B200 datasheet: 180 GB HBM3e, "
            "7.7 TB/s per GPU",
            nvlink_bandwidth=900_000_000_000,
            nvlink_domain=8,
            pcie_bandwidth=PCIE5_X16,
            network_bandwidth=50_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["b200"],
        ),
        GpuTarget(
            name="gb200",
            device_kind="NVIDIA GB200",
            compute_capability=(10, 0),
            core_count=152,
            device_memory_size=197897748480,
            memory_bandwidth=7_928_064_000_000,
            l2_cache_size=135528448,
            clock_rate_ghz=2.062,
            source="OpenXLA xla/backends/gpu/target_config/specs/gb200.txtpb @ 300ec95 (figures read from a real "
            "device: 152 SMs, 197897748480 B, 7.93 TB/s, 129.25 MiB L2, 2062 MHz); GB200 NVL72 datasheet: up to "
            "13.4 TB HBM3e and 576 TB/s per 72 GPUs (186 GB, 8 TB/s per GPU)",
            nvlink_bandwidth=900_000_000_000,
            nvlink_domain=72,
            pcie_bandwidth=225_000_000_000,
            network_bandwidth=50_000_000_000,
            interconnect_source=INTERCONNECT_SOURCES["gb200"],
        ),
        GpuTarget(
            name="l40s",
            device_kind="NVIDIA L40S",
            compute_capability=(8, 9),
            core_count=142,
            device_memory_size=46068 * MIB,
            memory_bandwidth=864_000_000_000,
            l2_cache_size=96 * MIB,
            clock_rate_ghz=2.52,
            source="NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s, 18,176 CUDA cores = 142 SMs, PCIe Gen4 x16, no "
            "NVLink), Ada whitepaper (AD102: 96 MB L2), 2520 MHz boost; memory = nvidia-smi total 46068 MiB",
            pcie_bandwidth=PCIE4_X16,
            interconnect_source=INTERCONNECT_SOURCES["pcie-only"],
        ),
        GpuTarget(
            name="l4",
            device_kind="NVIDIA L4",
            compute_capability=(8, 9),
            core_count=58,
            device_memory_size=23034 * MIB,
            memory_bandwidth=300_000_000_000,
            l2_cache_size=48 * MIB,
            clock_rate_ghz=2.04,
            source="NVIDIA L4 datasheet (7424 CUDA cores = 58 SMs, 24 GB, 300 GB/s, 2040 MHz boost), Ada whitepaper "
            "(AD104 L2 48 MB); memory = nvidia-smi total 23034 MiB",
            pcie_bandwidth=PCIE4_X16,
            interconnect_source=INTERCONNECT_SOURCES["pcie-only"],
        ),
        GpuTarget(
            name="rtx4090",
            device_kind="NVIDIA GeForce RTX 4090",
            compute_capability=(8, 9),
            core_count=128,
            device_memory_size=24564 * MIB,
            memory_bandwidth=1_008_000_000_000,
            l2_cache_size=72 * MIB,
            clock_rate_ghz=2.52,
            source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 (128 SMs, 72 MB L2, 1008 GB/s, 2520 MHz "
            "boost); memory = nvidia-smi total 24564 MiB",
            pcie_bandwidth=PCIE4_X16,
            interconnect_source=INTERCONNECT_SOURCES["pcie-only"],
        ),
    )
}


class UnknownTargetError(ValueError):
    """A target name that is neither in TARGETS nor a readable .txtpb file."""


def _field(name: str, value: object, indent: str) -> str:
    if isinstance(value, str):
        return f'{indent}{name}: "{value}"'
    if isinstance(value, dict):
        inner = "\n".join(_field(k, v, indent + "  ") for k, v in value.items())
        return f"{indent}{name} {{\n{inner}\n{indent}}}"
    return f"{indent}{name}: {value!r}"


def _version(numbers: tuple[int, ...], names: tuple[str, ...]) -> dict[str, int]:
    return dict(zip(names, numbers, strict=True))


def target_config_text(target: GpuTarget) -> str:
    """The GpuTargetConfig text proto for `target` (validated first)."""
    target.validate()
    if target.config_text is not None:
        return target.config_text
    major, minor = target.compute_capability
    device_info = {
        **COMMON_LIMITS,
        **ARCH_LIMITS[target.compute_capability],
        "core_count": target.core_count,
        "memory_bandwidth": target.memory_bandwidth,
        "l2_cache_size": target.l2_cache_size,
        "clock_rate_ghz": target.clock_rate_ghz,
        "device_memory_size": target.device_memory_size,
        "cuda_compute_capability": {"major": major, "minor": minor},
    }
    message = {
        "gpu_device_info": device_info,
        "platform_name": "CUDA",
        "dnn_version_info": _version(DNN_VERSION, ("major", "minor", "patch")),
        "runtime_version": _version(RUNTIME_VERSION, ("major", "minor", "patch")),
        "device_description_str": target.device_kind,
    }
    return "\n".join(_field(k, v, "") for k, v in message.items()) + "\n"


def _int_field(text: str, name: str) -> int:
    found = re.search(rf"\b{name}\s*:\s*(\d+)", text)
    return int(found.group(1)) if found else 0


def target_from_file(path: pathlib.Path) -> GpuTarget:
    """A user's own GpuTargetConfig text proto; `#` comment lines are dropped. Validated like the table's."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")) + "\n"
    kind = re.search(r'device_description_str\s*:\s*"([^"]*)"', text)
    target = GpuTarget(
        name=str(path),
        device_kind=kind.group(1) if kind else path.stem,
        compute_capability=(_int_field(text, "major"), _int_field(text, "minor")),
        core_count=_int_field(text, "core_count"),
        device_memory_size=_int_field(text, "device_memory_size"),
        memory_bandwidth=_int_field(text, "memory_bandwidth"),
        l2_cache_size=_int_field(text, "l2_cache_size"),
        clock_rate_ghz=0.0,
        source=f"user file {path}",
        config_text=text,
    )
    target.validate()
    return target


def get_target(name: str) -> GpuTarget:
    """The target called `name`, or one read from a `.txtpb` file path.

    Raises:
      UnknownTargetError: one line listing the known targets.
      ValueError: the file's config cannot be planned with (e.g. device_memory_size missing or 0).
    """
    if name in TARGETS:
        return TARGETS[name]
    path = pathlib.Path(name)
    if name.endswith(".txtpb") and path.is_file():
        return target_from_file(path)
    raise UnknownTargetError(
        f"--target: unknown {name!r}; known: {', '.join(TARGETS)} (or a GpuTargetConfig .txtpb file)"
    )


def target_for_device_kind(device_kind: str) -> GpuTarget | None:
    """The planning target whose device_kind is exactly this device's (e.g. 'NVIDIA H100 80GB HBM3' -> h100)."""
    return next((target for target in TARGETS.values() if target.device_kind == device_kind), None)


def device_slug(device_kind: str) -> str:
    """A short name for a device in sweep and file names: the matching target's name (h100, a5000,
    a100-40gb), else the device_kind lower-cased without 'NVIDIA' ('NVIDIA H100 PCIe' -> h100-pcie)."""
    target = target_for_device_kind(device_kind)
    if target is not None:
        return target.name
    words = re.sub(r"^nvidia\s+", "", device_kind.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "device"


GPUS_PER_HOST = 8  # an NVIDIA HGX/DGX node


def topology(devices: int) -> str:
    """The "<slices>x<hosts>x<devices per host>" string of `devices` GPUs for get_topology_desc(platform="cuda"):
    up to 8 on one host ("1x1x4"), else hosts of 8 ("1x2x8" for 16).

    Raises:
      ValueError: a count that is neither at most 8 nor a multiple of 8.
    """
    if devices < 1 or (devices > GPUS_PER_HOST and devices % GPUS_PER_HOST):
        raise ValueError(f"--devices {devices}: plan for 1 to {GPUS_PER_HOST} GPUs on one host, or a multiple of "
                         f"{GPUS_PER_HOST} ({GPUS_PER_HOST} per host)")  # fmt: skip
    per_host = min(devices, GPUS_PER_HOST)
    return f"1x{devices // per_host}x{per_host}"

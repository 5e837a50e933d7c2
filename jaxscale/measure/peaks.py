"""Peak matmul FLOP/s per accelerator: datasheet figures keyed by device_kind, or a measured CPU roofline
(matmul FLOP/s and memory bandwidth, each measured once per machine and cached).

MFU divides achieved model FLOP/s by these. A wrong peak makes every MFU wrong, so: datasheet numbers are
dense (NVIDIA's "with sparsity" figures halved), each carries its source, an unknown accelerator gets None
(and MFU null) rather than a guess, and a CPU, which has no meaningful published peak, gets a measured
matmul roofline that says it is one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import re
import time
import warnings

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Peak:
    """Dense matmul peaks of one accelerator in FLOP/s (None where no figure is published)."""

    pattern: str  # regular expression that the lower-cased device_kind must match (re.search)
    bfloat16: float | None
    float16: float | None
    tf32: float | None  # NVIDIA TensorFloat-32 tensor cores (what XLA uses for float32 dots by default)
    float32: float | None  # full-precision float32 (CUDA cores on NVIDIA)
    source: str
    fp8: float | None = None  # FP8 tensor cores (e4m3/e5m2 inputs, float32 accumulate); None: no FP8 (A100, A5000)

    @property
    def is_tpu(self) -> bool:
        return self.pattern.startswith("^tpu")


_NV = "NVIDIA datasheet"
_TPU = "Google Cloud TPU docs (system architecture)"
# Most specific first: the first entry whose pattern matches device_kind wins. Word boundaries keep an
# L40S from reading as an L4; unknown kinds (GH200, TPU v4 lite, ...) match nothing and get no peak.
PEAKS: tuple[Peak, ...] = (
    Peak(r"\bh100\b.*\bpcie\b", 756.5e12, 756.5e12, 378e12, 51.2e12, f"{_NV}, H100 PCIe (sparse figures / 2)", 1513e12),
    Peak(r"\bh100\b.*\bnvl\b", 835.5e12, 835.5e12, 417.5e12, 60e12, f"{_NV}, H100 NVL (sparse figures / 2)", 1670.5e12),
    Peak(r"\bh100\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12, f"{_NV}, H100 SXM5 (sparse figures / 2)", 1978.9e12),
    Peak(r"\bh200\b.*\bnvl\b", 835.5e12, 835.5e12, 417.5e12, 60e12, f"{_NV}, H200 NVL (sparse figures / 2)", 1670.5e12),
    Peak(r"\bh200\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12, f"{_NV}, H200 SXM (sparse figures / 2)", 1978.9e12),
    Peak(r"\bgb200\b", 2500e12, 2500e12, 1250e12, 90e12, f"{_NV}: GB200 NVL72 per GPU (rack's sparse figures / 72 / "
         "2); FP32: the Blackwell technical brief's GB200 figure at 1,200 W, as quoted at glennklockwood.com/garden/"
         "processors/B200", 5000e12),  # fmt: skip
    Peak(r"\bb200\b", 2250e12, 2250e12, 1100e12, 75e12, f"{_NV}, HGX B200 per GPU (sparse figures / 2)", 4500e12),
    Peak(r"\ba100\b", 312e12, 312e12, 156e12, 19.5e12, f"{_NV}, A100 SXM4/PCIe (dense figures)"),
    Peak(
        r"\ba5000\b",
        111.1e12,
        111.1e12,
        55.6e12,
        27.8e12,
        f"{_NV}, RTX A5000: 222.2 TFLOPS tensor (sparse) / 2; TF32 at half the FP16 tensor rate (GA102)",
    ),
    Peak(
        r"\ba6000\b",
        154.85e12,
        154.85e12,
        77.4e12,
        38.7e12,
        f"{_NV}, RTX A6000: 309.7 TFLOPS tensor (sparse) / 2; TF32 at half the FP16 tensor rate (GA102)",
    ),
    Peak(r"\bl40s\b", 362.05e12, 362.05e12, 183e12, 91.6e12, f"{_NV}, L40S (dense figures)", 733e12),
    Peak(r"\bl4\b", 121e12, 121e12, 60e12, 30.3e12, f"{_NV}, L4 (sparse figures / 2)", 242.5e12),
    Peak(
        r"\brtx 4090\b",
        165.2e12,
        165.2e12,
        82.6e12,
        82.6e12,
        "NVIDIA Ada Lovelace whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate (dense), TF32 dense; FP8 "
        "with FP32 accumulate (dense)",
        330.3e12,
    ),
    Peak(r"^tpu v4$", 275e12, None, None, None, f"{_TPU}, v4: 275 TFLOPS bf16 per chip"),
    Peak(r"^tpu v5( lite|e)$", 197e12, None, None, None, f"{_TPU}, v5e: 197 TFLOPS bf16 per chip"),
    Peak(r"^tpu v5p?$", 459e12, None, None, None, f"{_TPU}, v5p: 459 TFLOPS bf16 per chip"),
    Peak(r"^tpu v6( lite|e)$", 918e12, None, None, None, f"{_TPU}, v6e: 918 TFLOPS bf16 per chip"),
)

_FULL_FP32_PRECISIONS = ("highest", "float32", "fp32")
FP8 = "float8"  # peak_flops' name for the FP8 tensor peak (model.fp8's GEMMs)


def find_peak(device_kind: str) -> Peak | None:
    """The table entry for a jax Device.device_kind (e.g. 'NVIDIA H100 80GB HBM3', 'TPU v5 lite'), or None."""
    kind = device_kind.strip().lower()
    return next((p for p in PEAKS if re.search(p.pattern, kind)), None)


def peak_flops(device_kind: str, dtype: str, precision: str | None = None) -> tuple[float | None, str]:
    """Dense peak matmul FLOP/s for `dtype` on `device_kind`, and where the figure comes from.

    Args:
      device_kind: jax.Device.device_kind.
      dtype: the run's compute dtype name: bfloat16, float16 or float32; or FP8 ("float8"), the FP8 tensor peak.
      precision: jax_default_matmul_precision (None = XLA's DEFAULT). At DEFAULT precision XLA runs
        float32 dots on TF32 tensor cores (NVIDIA Ampere and newer) and as one bfloat16 pass on TPU, so
        those rates are the float32 peak; 'highest' selects the full-float32 rate.

    Returns:
      (FLOP/s or None, source). None where the device is unknown or has no figure for this dtype.
    """
    peak = find_peak(device_kind)
    if peak is None:
        return None, f"no datasheet peak for device_kind {device_kind!r}"
    full = (precision or "").lower() in _FULL_FP32_PRECISIONS
    if dtype == "float32" and peak.is_tpu:
        if full:
            return None, f"{peak.source}; no published full-precision float32 peak"
        return peak.bfloat16, f"{peak.source}; float32 dots run as one bfloat16 pass at DEFAULT precision"
    if dtype == "float32":
        if full:
            return peak.float32, f"{peak.source}; full float32 (CUDA cores)"
        return peak.tf32, f"{peak.source}; TF32 tensor cores (XLA's DEFAULT precision for float32 dots)"
    value = {"bfloat16": peak.bfloat16, "float16": peak.float16, FP8: peak.fp8}.get(dtype)
    return value, peak.source if value is not None else f"{peak.source}; no figure for {dtype}"


MAX_AGE_S = 7 * 24 * 3600  # a cached CPU roofline older than a week is measured again
STALE_MARGIN = 1.10  # a new measurement of the same matmul 10% faster than the cached one: the cache is stale


def cache_path() -> pathlib.Path:
    """JSON cache of measured CPU rooflines: $JAXSCALE_CACHE_DIR or ~/.cache/jaxscale, file peak_flops.json."""
    root = os.environ.get("JAXSCALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jaxscale"
    return pathlib.Path(root) / "peak_flops.json"


def cpu_name() -> str:
    """The CPU a roofline is measured on: its model (/proc/cpuinfo's first `model name`, else what `platform`
    reports) and the cores this process may run on (its affinity, which a container or taskset narrows)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def _machine_key(dtype: str, size: int) -> str:
    device = jax.devices()[0]
    return "|".join((platform.node(), cpu_name(), device.device_kind, f"jax {jax.__version__}", dtype, f"n={size}"))


def _read_cache() -> dict:
    path = cache_path()
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):  # unreadable or half-written: measure again rather than fail a run
        return {}
    return cache if isinstance(cache, dict) else {}


def _fresh(entry: dict | None, field: str) -> bool:
    """A cached measurement that holds `field` and is younger than MAX_AGE_S (an entry without its time is old)."""
    if not isinstance(entry, dict) or field not in entry:
        return False
    age = time.time() - float(entry.get("measured_unix", 0))
    return 0 <= age < MAX_AGE_S


def measure_matmul_flops(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of a jitted [size, size] @ [size, size] matmul in `dtype` (2·size³ FLOPs).

    The best, not the median, because a roofline is what the machine can do; noise only slows it down.
    """
    matmul = jax.jit(lambda a, b: a @ b)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (size, size), dtype=jnp.dtype(dtype))
    b = jax.random.normal(key_b, (size, size), dtype=jnp.dtype(dtype))
    jax.block_until_ready(matmul(a, b))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def matmul_source(dtype: str, size: int, when: str) -> str:
    """Where a measured matmul roofline comes from (the row's peak_flops_source, predicted_roofline_source)."""
    return f"measured: jitted {size}x{size} {dtype} matmul, best of >=5 runs, {when}"


def measured_peak(dtype: str, size: int = 2048, refresh: bool = False) -> tuple[float, str]:
    """This machine's matmul roofline for `dtype`: cached per machine and CPU (see cache_path, cpu_name),
    measured again when the cached one is older than MAX_AGE_S, or when `refresh`.

    Returns:
      (FLOP/s, source) where source names the measurement, its CPU and when it was taken.
    """
    key = _machine_key(dtype, size)
    entry = _read_cache().get(key)
    if refresh or not _fresh(entry, "flops_per_s"):
        entry = _store(key, {"flops_per_s": measure_matmul_flops(dtype, size)})
    when = f"{entry['measured_at']} on {entry.get('cpu', cpu_name())} (cache {cache_path()})"
    return float(entry["flops_per_s"]), matmul_source(dtype, size, when)


def record_matmul(dtype: str, size: int, flops_per_s: float) -> str | None:
    """Files a run's own measurement of the roofline matmul (the same jitted size³ matmul) in the cache.

    The cache keeps the faster of the two, because a roofline is what the machine can do. A measurement more
    than STALE_MARGIN faster than the cached one means the cached one was taken under load (or is from
    before a change to the machine): it is replaced, and the returned note says so; otherwise None.
    """
    key = _machine_key(dtype, size)
    entry = _read_cache().get(key)
    if not _fresh(entry, "flops_per_s"):
        _store(key, {"flops_per_s": flops_per_s})
        return None
    cached = float(entry["flops_per_s"])
    if flops_per_s <= cached:
        return None
    _store(key, {"flops_per_s": flops_per_s})
    if flops_per_s <= cached * STALE_MARGIN:
        return None
    return (
        f"the cached {dtype} matmul roofline was stale: {cached / 1e9:.1f} GFLOP/s (measured {entry['measured_at']}), "
        f"this run measured {flops_per_s / 1e9:.1f}; the cache now holds the new measurement ({cache_path()})"
    )


def measure_memory_bandwidth(size_bytes: int = 2**26, repeats: int = 5) -> float:
    """Best-of-`repeats` bytes/s of a jitted, donated `x * 2` over a float32 array of `size_bytes`: it reads
    and rewrites the array in place, 2 · size_bytes moved (the STREAM "scale" kernel).

    In place, because a fresh output would time the first touch of its pages, not the memory; 64 MiB by
    default, larger than the L2 caches, about the size of the largest activations of the `cpu` preset.
    """
    scale = jax.jit(lambda x: x * 2.0, donate_argnums=0)
    x = jax.block_until_ready(scale(jnp.ones((size_bytes // 4,), jnp.float32)))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(scale(x))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size_bytes / best


def measured_bandwidth(size_bytes: int = 2**26, refresh: bool = False) -> tuple[float, str]:
    """This machine's memory bandwidth (bytes/s), cached and expired like the matmul roofline (measured_peak).

    Returns:
      (bytes/s, source) where source names the measurement, its CPU and when it was taken.
    """
    key = _machine_key("bandwidth", size_bytes)
    entry = _read_cache().get(key)
    if refresh or not _fresh(entry, "bytes_per_s"):
        entry = _store(key, {"bytes_per_s": measure_memory_bandwidth(size_bytes)})
    source = (
        f"measured: jitted in-place x*2 over {size_bytes // 2**20} MiB of float32 (STREAM scale), best of 5, "
        f"{entry['measured_at']} on {entry.get('cpu', cpu_name())} (cache {cache_path()})"
    )
    return float(entry["bytes_per_s"]), source


def _store(key: str, entry: dict) -> dict:
    """Writes one measurement into the cache (atomically), stamped with its time and CPU; returns the entry."""
    path = cache_path()
    cache = _read_cache()
    cache[key] = {**entry, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "measured_unix": time.time(),
                  "cpu": cpu_name()}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1) + "\n")
    tmp.replace(path)
    return cache[key]


def resolve_peak(dtype: str, device: jax.Device | None = None) -> tuple[float | None, str]:
    """The peak to divide by for MFU: the datasheet table, a measured roofline on CPU, else None + a warning."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measured_peak(dtype)
    value, source = peak_flops(device.device_kind, dtype, jax.config.jax_default_matmul_precision)
    if value is None:
        warnings.warn(f"MFU left null: {source}; add the device to jaxscale/peaks.py PEAKS", stacklevel=2)
    return value, source

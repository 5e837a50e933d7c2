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

    @property
    def is_tpu(self) -> bool:
        return self.pattern.startswith("^tpu")


_NV = "NVIDIA datasheet"
_TPU = "Google Cloud TPU docs (system architecture)"
# Most specific first: the first entry whose pattern matches device_kind wins. Word boundaries keep an
# L40S from reading as an L4; unknown kinds (GH200, TPU v4 lite, ...) match nothing and get no peak.
PEAKS: tuple[Peak, ...] = (
    Peak(r"\bh100\b.*\bpcie\b", 756.5e12, 756.5e12, 378e12, 51.2e12, f"{_NV}, H100 PCIe (sparse figures / 2)"),
    Peak(r"\bh100\b.*\bnvl\b", 835.5e12, 835.5e12, 417.5e12, 60e12, f"{_NV}, H100 NVL (sparse figures / 2)"),
    Peak(r"\bh100\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12, f"{_NV}, H100 SXM5 (sparse figures / 2)"),
    Peak(r"\bh200\b.*\bnvl\b", 835.5e12, 835.5e12, 417.5e12, 60e12, f"{_NV}, H200 NVL (sparse figures / 2)"),
    Peak(r"\bh200\b", 989.4e12, 989.4e12, 494.7e12, 66.9e12, f"{_NV}, H200 SXM (sparse figures / 2)"),
    Peak(r"\ba100\b", 312e12, 312e12, 156e12, 19.5e12, f"{_NV}, A100 SXM4/PCIe (dense figures)"),
    Peak(
        r"\ba5000\b",
        111.1e12,
        111.1e12,
        55.6e12,
        27.8e12,
        f"{_NV}, RTX A5000: 222.2 TFLOPS tensor (sparse) / 2; TF32 at half the FP16 tensor rate (GA102)",
    ),
    Peak(r"\bl4\b", 121e12, 121e12, 60e12, 30.3e12, f"{_NV}, L4 (sparse figures / 2)"),
    Peak(
        r"\brtx 4090\b",
        165.2e12,
        165.2e12,
        82.6e12,
        82.6e12,
        "NVIDIA Ada Lovelace whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate (dense), TF32 dense",
    ),
    Peak(r"^tpu v4$", 275e12, None, None, None, f"{_TPU}, v4: 275 TFLOPS bf16 per chip"),
    Peak(r"^tpu v5( lite|e)$", 197e12, None, None, None, f"{_TPU}, v5e: 197 TFLOPS bf16 per chip"),
    Peak(r"^tpu v5p?$", 459e12, None, None, None, f"{_TPU}, v5p: 459 TFLOPS bf16 per chip"),
    Peak(r"^tpu v6( lite|e)$", 918e12, None, None, None, f"{_TPU}, v6e: 918 TFLOPS bf16 per chip"),
)

_FULL_FP32_PRECISIONS = ("highest", "float32", "fp32")


def find_peak(device_kind: str) -> Peak | None:
    """The table entry for a jax Device.device_kind (e.g. 'NVIDIA H100 80GB HBM3', 'TPU v5 lite'), or None."""
    kind = device_kind.strip().lower()
    return next((p for p in PEAKS if re.search(p.pattern, kind)), None)


def peak_flops(device_kind: str, dtype: str, precision: str | None = None) -> tuple[float | None, str]:
    """Dense peak matmul FLOP/s for `dtype` on `device_kind`, and where the figure comes from.

    Args:
      device_kind: jax.Device.device_kind.
      dtype: the run's compute dtype name: bfloat16, float16 or float32.
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
    value = {"bfloat16": peak.bfloat16, "float16": peak.float16}.get(dtype)
    return value, peak.source if value is not None else f"{peak.source}; no figure for {dtype}"


def cache_path() -> pathlib.Path:
    """JSON cache of measured CPU rooflines: $JAXSCALE_CACHE_DIR or ~/.cache/jaxscale, file peak_flops.json."""
    root = os.environ.get("JAXSCALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jaxscale"
    return pathlib.Path(root) / "peak_flops.json"


def _machine_key(dtype: str, size: int) -> str:
    device = jax.devices()[0]
    return "|".join(
        (platform.node(), platform.processor() or platform.machine(), str(os.cpu_count()), device.device_kind)
        + (f"jax {jax.__version__}", dtype, f"n={size}")
    )


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


def measured_peak(dtype: str, size: int = 2048, refresh: bool = False) -> tuple[float, str]:
    """This machine's matmul roofline for `dtype`, measured once and cached per machine (see cache_path).

    Args:
      dtype: the run's compute dtype name.
      size: matrix side of the measured matmul.
      refresh: measure again and overwrite the cached value.

    Returns:
      (FLOP/s, source) where source names the measurement and when it was taken.
    """
    path, key = cache_path(), _machine_key(dtype, size)
    cache = json.loads(path.read_text()) if path.exists() else {}
    if refresh or key not in cache:
        cache = store_peak(dtype, size, measure_matmul_flops(dtype, size))
    entry = cache[key]
    source = f"measured: jitted {size}x{size} {dtype} matmul, best of >=5 runs, {entry['measured_at']} (cache {path})"
    return float(entry["flops_per_s"]), source


def store_peak(dtype: str, size: int, flops_per_s: float) -> dict:
    """Writes a measured roofline into the cache (atomically); returns the whole cache."""
    return _store(_machine_key(dtype, size), {"flops_per_s": flops_per_s})


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
    """This machine's memory bandwidth (bytes/s), measured once and cached per machine like the matmul roofline.

    Returns:
      (bytes/s, source) where source names the measurement and when it was taken.
    """
    path, key = cache_path(), _machine_key("bandwidth", size_bytes)
    cache = json.loads(path.read_text()) if path.exists() else {}
    if refresh or key not in cache or "bytes_per_s" not in cache[key]:
        cache = _store(key, {"bytes_per_s": measure_memory_bandwidth(size_bytes)})
    entry = cache[key]
    source = (
        f"measured: jitted in-place x*2 over {size_bytes // 2**20} MiB of float32 (STREAM scale), best of 5, "
        f"{entry['measured_at']} (cache {path})"
    )
    return float(entry["bytes_per_s"]), source


def _store(key: str, entry: dict) -> dict:
    """Writes one measurement into the cache (atomically); returns the whole cache."""
    path = cache_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    cache[key] = {**entry, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1) + "\n")
    tmp.replace(path)
    return cache


def resolve_peak(dtype: str, device: jax.Device | None = None) -> tuple[float | None, str]:
    """The peak to divide by for MFU: the datasheet table, a measured roofline on CPU, else None + a warning."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measured_peak(dtype)
    value, source = peak_flops(device.device_kind, dtype, jax.config.jax_default_matmul_precision)
    if value is None:
        warnings.warn(f"MFU left null: {source}; add the device to jaxscale/peaks.py PEAKS", stacklevel=2)
    return value, source

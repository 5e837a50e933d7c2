"""Compiled programs reused across processes: JAX's persistent compilation cache, and a plan cache for
deviceless GPU-target compiles, in one per-user directory; and whether a given compile was served from it.

- Where: `$JAXSCALE_CACHE_DIR` or `~/.cache/jaxscale` (the directory jaxscale.measure.peaks uses too):
  `xla/` holds JAX's cache (executables of compiles for this machine's backend, CPU or GPU), `plans/` the
  GPU-target plans.
- Off: `JAXSCALE_COMPILATION_CACHE=0` (or `--nocompilation_cache` on run, sweep and bench, which set it
  for their child processes too).
- Why two caches: JAX's cache serves compiles on a real backend, but a deviceless compile for a GPU target
  (jaxscale.plan.target_compile) cannot load an executable back ("PjRtCompiler must be constructed with a
  Client to call DeserializeLoadedExecutable", JAX 0.10.2), so there the lab keeps what the plan needs
  (XLA's memory figures and its warnings) under a key of the lowered program, the target, XLA_FLAGS and
  the JAX, jaxlib and CUDA plugin versions.
- A hit is read from JAX's monitoring events (`/jax/compilation_cache/cache_hits`, `.../cache_misses`,
  `.../compile_time_saved_sec`), so `compile_s` stays the wall time the compile took in this process
  (the cache read, on a hit) and `compile_cache_saved_s` says what the cache saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
from collections.abc import Iterator

import jax
from jax import monitoring

ENV_ROOT = "JAXSCALE_CACHE_DIR"
ENV_SWITCH = "JAXSCALE_COMPILATION_CACHE"
_OFF = ("0", "false", "off", "no")
_EVENT = "/jax/compilation_cache/"
_CUDA_PLUGIN_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
# What a cached plan holds (jaxscale.plan.target_compile's result); bump it when that changes, so entries
# written by an older lab are not read as complete (2: the kernel list for the step-time prediction;
# 3: collective columns and the topology; 4: the kernel list's collectives parsed as the columns' are;
# 5: fused attention calls, the Pallas flash and cuDNN fMHA kernels, costed by their shapes; 7: each async
# collective's window of kernels between its start and its -done; 8: a scatter's bytes, in place: its updates;
# 9: host memory, the host columns of the plan and each kernel's host-link bytes, a slice's for an in-place access;
# 10: compiled_scan_saved_bytes counts a mixture of experts' slot tensors).
PLAN_FORMAT = 10


def cache_root() -> pathlib.Path:
    """$JAXSCALE_CACHE_DIR, else ~/.cache/jaxscale."""
    return pathlib.Path(os.environ.get(ENV_ROOT) or pathlib.Path.home() / ".cache" / "jaxscale")


def enabled() -> bool:
    """Whether compiled programs are reused (JAXSCALE_COMPILATION_CACHE is not 0/false/off/no)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def set_enabled(on: bool) -> None:
    """Turns the cache on or off for this process and the processes it starts (an environment variable)."""
    os.environ[ENV_SWITCH] = "1" if on else "0"


def xla_dir() -> pathlib.Path:
    """JAX's persistent compilation cache directory."""
    return cache_root() / "xla"


def plan_dir() -> pathlib.Path:
    """The GPU-target plan cache directory."""
    return cache_root() / "plans"


def configure() -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at xla_dir() (or turns it off); call before compiling.

    Returns:
      The directory in use, or None when the cache is off.
    """
    from jax.experimental.compilation_cache import compilation_cache

    on = enabled()
    jax.config.update("jax_enable_compilation_cache", on)
    if on:
        jax.config.update("jax_compilation_cache_dir", str(xla_dir()))
    compilation_cache.reset_cache()  # JAX decides at its first compile whether to use a cache: decide again
    return xla_dir() if on else None


@dataclasses.dataclass
class CompileWatch:
    """What JAX's persistent cache did during a block: see `watch()`."""

    requests: int = 0  # compiles that consulted the cache
    hits: int = 0
    misses: int = 0
    saved_s: float = 0.0  # JAX's compile_time_saved_sec, summed over the hits

    @property
    def hit(self) -> bool | None:
        """True when every compile in the block was served from the cache; None when none consulted it."""
        return None if self.requests == 0 else self.hits > 0 and self.misses == 0

    def columns(self) -> dict[str, object]:
        """Result-row fields: compile_cache_hit (None: cache off) and compile_cache_saved_s (None unless hit)."""
        return {"compile_cache_hit": self.hit, "compile_cache_saved_s": self.saved_s if self.hit else None}


_WATCHES: list[CompileWatch] = []


def _on_event(event: str, **_: object) -> None:
    for watch in _WATCHES:
        if event == _EVENT + "compile_requests_use_cache":
            watch.requests += 1
        elif event == _EVENT + "cache_hits":
            watch.hits += 1
        elif event == _EVENT + "cache_misses":
            watch.misses += 1


def _on_duration(event: str, duration_secs: float, **_: object) -> None:
    if event == _EVENT + "compile_time_saved_sec":
        for watch in _WATCHES:
            watch.saved_s += duration_secs


monitoring.register_event_listener(_on_event)
monitoring.register_event_duration_secs_listener(_on_duration)


@contextlib.contextmanager
def watch() -> Iterator[CompileWatch]:
    """Counts JAX's persistent-cache requests, hits and misses of the compiles inside the block."""
    found = CompileWatch()
    _WATCHES.append(found)
    try:
        yield found
    finally:
        _WATCHES.remove(found)


# ---------------------------------------------------------------------------------------------------------
# The GPU-target plan cache (written and read by jaxscale.plan.target_compile, in a child or in process).


def _versions() -> str:
    """jax, jaxlib and CUDA plugin versions (whichever are installed as distributions)."""
    found = [f"jax {jax.__version__}"]
    for name in ("jaxlib", *_CUDA_PLUGIN_DISTRIBUTIONS):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def plan_key(
    lowered_text: str,
    target_config_text: str,
    xla_flags: str,
    topology: str = "1x1x1",
    compiler_options: dict | None = None,
) -> str:
    """Key of a deviceless plan: the lowered program (StableHLO text), the target, its topology (slices x
    hosts x GPUs), XLA_FLAGS, the compile's options (the GEMM mode), versions and the plan format."""
    digest = hashlib.sha256()
    options = json.dumps(compiler_options or {}, sort_keys=True)
    parts = (lowered_text, target_config_text, topology, xla_flags, options, _versions(), f"plan format {PLAN_FORMAT}")
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def read_plan(key: str) -> dict | None:
    """The cached plan entry {"result", "stderr"} under `key`, or None (cache off, absent or unreadable)."""
    if not enabled():
        return None
    try:
        entry = json.loads((plan_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and {"result", "stderr"} <= set(entry) else None


def plan_hlo_path(key: str) -> pathlib.Path:
    """Where the cache keeps the compiled HLO text (gzipped) of the plan under `key`."""
    return plan_dir() / f"{key}.hlo.txt.gz"


def write_plan(key: str, result: dict, stderr: str) -> None:
    """Stores a plan (the compile's result and its stderr, whose XLA warnings planning parses), atomically."""
    if not enabled():
        return
    directory = plan_dir()
    directory.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "versions": _versions(), "result": result, "stderr": stderr}
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
        json.dump(entry, handle)
    os.replace(handle.name, directory / f"{key}.json")

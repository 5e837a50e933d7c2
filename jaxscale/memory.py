"""Memory figures, each named by its source: XLA's compiled plan, the device's allocator and the host."""

from __future__ import annotations

import resource
import sys

import jax


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int | None]:
    """XLA's buffer plan for one call of the compiled step, in bytes.

    compiled_peak_bytes = argument + output - alias + temp: the inputs and outputs live at once except
    where an output reuses a donated input's buffer (alias), plus XLA's scratch for intermediates (temp).
    It is the plan of the backend that compiled it (a CPU plan is only a proxy for a GPU's), and it
    leaves out the runtime's own overheads (allocator fragmentation, CUDA context, preallocation).
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {f"compiled_{k}_bytes": None for k in ("argument", "output", "temp", "alias", "peak")}
    row = {
        "compiled_argument_bytes": int(analysis.argument_size_in_bytes),
        "compiled_output_bytes": int(analysis.output_size_in_bytes),
        "compiled_temp_bytes": int(analysis.temp_size_in_bytes),
        "compiled_alias_bytes": int(analysis.alias_size_in_bytes),
    }
    row["compiled_peak_bytes"] = (
        row["compiled_argument_bytes"]
        + row["compiled_output_bytes"]
        - row["compiled_alias_bytes"]
        + row["compiled_temp_bytes"]
    )
    return row


def device_peak_bytes(device: jax.Device | None = None) -> tuple[int | None, str | None]:
    """The allocator's peak_bytes_in_use, or (None, why) where the backend keeps no statistics (CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None, f"not available on the {device.platform} backend (memory_stats() has no peak_bytes_in_use)"
    return int(stats["peak_bytes_in_use"]), None


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process (getrusage; kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)

"""Host and device bytes of a compiled step whose state is partly in host memory (jaxscale.train.offload).

A program marks an array in host memory by its layout's memory space, `S(5)` (`f32[256]{0:S(5)}`): the entry
computation's parameters and results that live on the host, and the transfers between the spaces. What XLA's
`memory_analysis()` makes of them depends on the backend (measured here, JAX 0.10.2):

- a deviceless GPU compile (the lab's `--plan --target`) separates them: the host arguments and outputs are in
  `host_argument_size_in_bytes` / `host_output_size_in_bytes` / `host_alias_size_in_bytes`, not in the device's
  `argument_size_in_bytes`, so `compiled_peak_bytes` is the device's. (The earlier finding that it does not was
  of a program that never had a host argument: the compile-only devices have no memories, and a sharding's
  `memory_kind="pinned_host"` is silently dropped there; jaxscale.train.offload marks the spaces in the program.)
- the CPU backend marks the entry computation's layout with S(5) but counts those arrays in argument_size_in_bytes
  and keeps every host_* field 0: the host bytes are read from the program's memory spaces instead, and the
  device's peak is the plan's minus them.

`compiled_host_bytes_source` says which: "compiled" (XLA's analysis) or "hlo_memory_space" (the program's S(5)
marks); None where the program has no host arrays. The analytic model counts the offloaded parts apart whatever
the program says (jaxscale.measure.memory: analytic_host_offload_bytes, left out of analytic_peak_bytes).
"""

from __future__ import annotations

import re
from typing import Any

from jaxscale.measure import hlo

_ENTRY_LAYOUT = re.compile(r"entry_computation_layout=\{\((.*?)\)->(.*?)\}(?:,\s*\w+=|\s*$)")


def entry_host_bytes(hlo_text: str) -> tuple[int, int]:
    """(bytes of the entry computation's parameters in host memory, bytes of its results there), from the memory
    spaces the program marks: the module's entry_computation_layout (where the CPU backend marks them) or the
    ENTRY computation's parameter and ROOT shapes (where a GPU compile does), whichever says more."""
    header = next((line for line in hlo_text.splitlines() if line.startswith("HloModule")), "")
    layout = _ENTRY_LAYOUT.search(header)
    arguments, results = (hlo.host_bytes(layout.group(1)), hlo.host_bytes(layout.group(2))) if layout else (0, 0)
    module = hlo.parse(hlo_text)
    entry = module.computations.get(module.entry, {})
    params = sum(hlo.host_bytes(i.shape) for i in entry.values() if i.opcode == "parameter")
    root = hlo.host_bytes(list(entry.values())[-1].shape) if entry else 0  # the ROOT is the last instruction
    return max(arguments, params), max(results, root)


def host_columns(analysis: Any, hlo_text: str) -> dict[str, Any]:
    """The compiled_host_* columns of a compiled step, and the device's own peak.

    Args:
      analysis: `compiled.memory_analysis()` (None: no plan).
      hlo_text: `compiled.as_text()`.
    Returns:
      compiled_host_argument_bytes, compiled_host_output_bytes, compiled_host_bytes_source (see the module
      docstring) and compiled_device_peak_bytes: argument + output - alias + temp of the device alone (XLA's peak
      where it separates the host; else the peak less the host arguments, which the donated host outputs reuse).
    """
    if analysis is None:
        return {"compiled_host_argument_bytes": None, "compiled_host_output_bytes": None,
                "compiled_host_bytes_source": None, "compiled_device_peak_bytes": None}  # fmt: skip
    peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)  # fmt: skip
    xla = (int(analysis.host_argument_size_in_bytes), int(analysis.host_output_size_in_bytes))
    marked = entry_host_bytes(hlo_text) if hlo.HOST_MEMORY_SPACE in hlo_text else (0, 0)
    if any(xla):
        (arguments, outputs), source, device_peak = xla, "compiled", peak
    elif any(marked):
        (arguments, outputs), source = marked, "hlo_memory_space"
        device_peak = peak - max(marked)
    else:
        (arguments, outputs), source, device_peak = (0, 0), None, peak
    return {"compiled_host_argument_bytes": arguments, "compiled_host_output_bytes": outputs,
            "compiled_host_bytes_source": source, "compiled_device_peak_bytes": int(device_peak)}  # fmt: skip

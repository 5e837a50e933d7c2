"""What a target GPU's runtime gives the program's buffers: the fit planner's default memory budget per device.

On a GPU, JAX's allocator takes a fraction of the device's total memory (75% by default) and every buffer of the
compiled program (XLA's plan: arguments, outputs, temporaries) lives in that pool. The CUDA context (modules,
local memory, the driver's own reservations) and the libraries' handles live outside it, in the rest. So a plan
runs as printed when its peak is at most fraction x memory and the rest holds the context
(`CONTEXT_RESERVE_BYTES`); a budget above JAX's default needs the fraction set in the environment, and the
`Budget` says which setting (`run_env`). Sources, and what is assumed, in docs/fit.md ("The budget").
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from jaxscale.plan.errors import PlanFlagError

GIB = 2**30
# JAX preallocates this fraction of the GPU's total memory for its allocator (JAX's documentation, "GPU memory
# allocation": "JAX will preallocate 75% of the total GPU memory"); the environment variables below change it
# (jaxlib's xla_client.py reads XLA_CLIENT_MEM_FRACTION, and XLA_PYTHON_CLIENT_MEM_FRACTION, deprecated, when the
# first is unset). With XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows on demand up to the same fraction.
DEFAULT_MEM_FRACTION = 0.75
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
# Memory kept outside JAX's pool for the CUDA context and the libraries' handles. An ASSUMPTION, not measured in
# this lab (no GPU here): 1 GiB. Beside it, PyTorch measured a CUDA context with its kernels loaded at 0.27 GiB
# with lazy loading and 0.62 GiB without (pytorch/pytorch#86509; lazy loading is CUDA's default on Linux since
# 12.2), and cuBLAS recommends a 32 MiB workspace per handle on Hopper, 4 MiB on earlier GPUs (cuBLAS
# documentation, cublasSetWorkspace). XLA's own cuBLAS workspaces are buffers of the compiled program, so they
# are in the plan. The reserve bounds how high a fraction the fit accepts; at JAX's 75% it is far from binding.
CONTEXT_RESERVE_BYTES = GIB


@dataclasses.dataclass(frozen=True)
class Budget:
    """The budget per device and its parts, as the fit's row columns (`columns`)."""

    bytes: int  # what the program's buffers may use
    source: str  # where it comes from, in words
    mem_fraction: float | None = None  # JAX's allocator fraction the answer runs with (None: not a GPU target)
    mem_fraction_source: str | None = None
    reserve_bytes: int | None = None  # kept outside the pool for the CUDA context (an assumption, above)
    run_env: str | None = None  # the setting the answer needs to run ("XLA_CLIENT_MEM_FRACTION=0.9"); None: none

    def columns(self) -> dict[str, object]:
        return {
            "fit_budget_bytes": self.bytes,
            "fit_budget_source": self.source,
            "fit_mem_fraction": self.mem_fraction,
            "fit_mem_fraction_source": self.mem_fraction_source,
            "fit_context_reserve_bytes": self.reserve_bytes,
            "fit_run_env": self.run_env,
        }


def environment_fraction(environ: Mapping[str, str]) -> tuple[str, float] | None:
    """(variable, value) of the allocator fraction set in `environ`, as jaxlib reads it; None when unset.

    Raises:
      PlanFlagError: the value is not a number.
    """
    for name in MEM_FRACTION_ENV:
        text = environ.get(name, "")
        if text:
            try:
                return name, float(text)
            except ValueError:
                raise PlanFlagError(f"{name}: {text!r} is not a fraction (e.g. {name}=0.9)") from None
    return None


def largest_fraction(device_bytes: int, reserve: int = CONTEXT_RESERVE_BYTES) -> float:
    """The largest allocator fraction (two decimals) that leaves `reserve` bytes outside JAX's pool."""
    return math.floor(100 * (1 - reserve / device_bytes)) / 100


def _fraction(mem_fraction: float | None, environ: Mapping[str, str]) -> tuple[float, str, str | None]:
    """(fraction, its source, the flag or variable that set it)."""
    if mem_fraction is not None:
        return mem_fraction, "--mem_fraction", "--mem_fraction"
    found = environment_fraction(environ)
    if found is not None:
        return found[1], f"{found[0]} in the environment", found[0]
    return DEFAULT_MEM_FRACTION, "JAX's default", None


def for_target(
    target: str,
    device_bytes: int,
    mem_fraction: float | None = None,
    memory: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Budget:
    """The budget per device on a GPU target: `memory` (--memory) if given, else its allocator's pool.

    The pool is fraction x `device_bytes`: the fraction is `mem_fraction` (--mem_fraction), else the one set in
    the environment, else JAX's default 0.75. A `memory` above JAX's default pool raises the fraction to what it
    needs (`run_env` names the setting); above an explicit fraction's pool it is an error.

    Raises:
      PlanFlagError: one line naming --mem_fraction, the variable or --memory and what the target allows.
    """
    environ = os.environ if environ is None else environ
    fraction, source, setter = _fraction(mem_fraction, environ)
    most = largest_fraction(device_bytes)
    where = f"target {target}'s {device_bytes / GIB:.2f} GiB"
    reserve = f"{CONTEXT_RESERVE_BYTES / GIB:g} GiB kept for the CUDA context (docs/fit.md)"
    if not 0 < fraction <= most:
        raise PlanFlagError(f"{setter}: {fraction:g} of {where} leaves less than the {reserve}; allowed: 0 < "
                            f"fraction <= {most:.2f}")  # fmt: skip
    pool = int(fraction * device_bytes)
    run_env = None if setter is None else f"{MEM_FRACTION_ENV[0]}={fraction:g}"
    parts = dict(mem_fraction=fraction, mem_fraction_source=source, reserve_bytes=CONTEXT_RESERVE_BYTES)
    if memory is None:
        return Budget(pool, f"{fraction:.0%} of {where}, JAX's allocator ({source})", run_env=run_env, **parts)
    if memory <= pool:
        return Budget(memory, "--memory", run_env=run_env, **parts)
    needed = math.ceil(100 * memory / device_bytes) / 100
    asked = f"--memory {memory / GIB:.3g} GiB"
    if setter is not None:
        raise PlanFlagError(f"{asked}: more than the {pool / GIB:.3g} GiB that {setter} {fraction:g} gives JAX's "
                            f"allocator on {where}; raise {setter} or lower --memory")  # fmt: skip
    if needed > most:
        raise PlanFlagError(f"{asked}: more than JAX's allocator can have on {where} with the {reserve} outside "
                            f"it; allowed: at most {most * device_bytes / GIB:.3g} GiB")  # fmt: skip
    parts.update(mem_fraction=needed, mem_fraction_source="raised to hold --memory")
    return Budget(memory, "--memory", run_env=f"{MEM_FRACTION_ENV[0]}={needed:g}", **parts)

"""Before JAX starts its backends: simulated CPU devices, and `jax.distributed` for a run over several processes.

Both must happen before JAX's first computation (the backends read them when they start), so `run` parses
these flags ahead of the config (`parse_early`), sets the devices (`configure`), checks the config (bad input
ends a process before it joins the others), then joins them (`initialize`); the sweep passes them on:

- `--host_devices N`: N simulated CPU devices in this process (`jax_num_cpu_devices`, the same as
  `XLA_FLAGS=--xla_force_host_platform_device_count=N`), to run a mesh without N accelerators;
- `--coordinator_address HOST:PORT --num_processes P --process_id I`: this process is one of P, started
  by the user's own launcher (SLURM's srun, ssh, ...); `--distributed` alone leaves them to JAX's own
  detection (SLURM, Open MPI, TPU pods, or JAX_COORDINATOR_ADDRESS in the environment). JAX's
  coordination service connects them; CPU collectives between processes go through gloo.

No launcher and no protocol of our own: `jax.distributed.initialize` does it all (docs/mesh.md).
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import flags

from jaxscale.cli import UsageError

FLAG_NAMES = ("host_devices", "coordinator_address", "num_processes", "process_id", "distributed",
              "distributed_timeout")  # fmt: skip
DEFAULT_TIMEOUT_S = 300


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the flags of this module on `fv` (run and sweep both take them)."""
    flags.DEFINE_integer(
        "host_devices", None, "Simulate this many CPU devices in each process (forces the CPU backend), to run "
        "a mesh without as many accelerators. See docs/mesh.md.", lower_bound=1, flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_string(
        "coordinator_address", None, "HOST:PORT of process 0's coordination service, for a run over several "
        "processes (jax.distributed.initialize).", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("process_id", None, "This process's index, 0 ... num_processes-1.", lower_bound=0,
                         flag_values=fv)  # fmt: skip
    flags.DEFINE_bool(
        "distributed", False, "Call jax.distributed.initialize() and let JAX find the coordinator, process count "
        "and id (SLURM, Open MPI, JAX_COORDINATOR_ADDRESS).", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "distributed_timeout", DEFAULT_TIMEOUT_S, "Seconds to wait for every process to join.", lower_bound=1,
        flag_values=fv,
    )  # fmt: skip


def parse_early(argv: Sequence[str]) -> flags.FlagValues:
    """Only this module's flags from argv (every other flag is left for the full parse).

    Raises:
      UsageError: a bad value for one of them.
    """
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        fv(list(argv), known_only=True)
    except flags.Error as error:
        raise UsageError(str(error)) from None
    return fv


def wants_distributed(fv: flags.FlagValues) -> bool:
    """Whether this is one process of several (any of the flags, or JAX's coordinator variable, is set)."""
    given = (fv.coordinator_address, fv.num_processes, fv.process_id)
    return fv.distributed or any(v is not None for v in given) or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def _check(fv: flags.FlagValues) -> None:
    given = {"--coordinator_address": fv.coordinator_address, "--num_processes": fv.num_processes,
             "--process_id": fv.process_id}  # fmt: skip
    missing = [name for name, value in given.items() if value is None]
    if not fv.distributed and 0 < len(missing) < 3:
        raise UsageError(f"{', '.join(missing)}: give all three of --coordinator_address, --num_processes and "
                         "--process_id, or --distributed to let JAX detect them (SLURM, Open MPI)")  # fmt: skip
    if fv.process_id is not None and fv.num_processes is not None and fv.process_id >= fv.num_processes:
        raise UsageError(f"--process_id: {fv.process_id} is not below --num_processes={fv.num_processes}")


def configure(fv: flags.FlagValues) -> None:
    """Simulated devices and the CPU collectives, as the flags ask; call before JAX starts its backends.

    Raises:
      UsageError: inconsistent flags, or JAX's backends already started (nothing can change then).
    """
    _check(fv)
    try:
        if fv.host_devices is not None:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", fv.host_devices)
        if wants_distributed(fv):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    except RuntimeError as error:  # JAX refuses once its backends are up
        raise UsageError(f"--host_devices: must be set before JAX starts: {error}") from None


def initialize(fv: flags.FlagValues) -> None:
    """jax.distributed.initialize when this is one process of several; call after `configure`, before JAX's
    first computation. It returns once every process has joined; a process that never joins makes JAX end
    this one after --distributed_timeout seconds (it aborts with its own message).

    Raises:
      RuntimeError: JAX's backends already started, or the coordinator could not be reached.
    """
    if wants_distributed(fv):
        jax.distributed.initialize(
            coordinator_address=fv.coordinator_address,
            num_processes=fv.num_processes,
            process_id=fv.process_id,
            initialization_timeout=fv.distributed_timeout,
        )


def forwarded(fv: flags.FlagValues) -> list[str]:
    """This module's flags as given, to pass on to a child `jaxscale.run` (the sweep's variants)."""
    args = []
    for name in FLAG_NAMES:
        if fv[name].present:
            value = fv[name].value
            args.append(f"--{name}" if value is True else f"--no{name}" if value is False else f"--{name}={value}")
    return args


def shared_time() -> float:
    """The current time in seconds, process 0's in a multi-process run (so run names agree)."""
    now = time.time()
    if jax.process_count() == 1:
        return now
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.int64(now)))


def is_main_process() -> bool:
    """Process 0 of a multi-process run (or the only process): the one that writes result rows."""
    return jax.process_index() == 0


# What JAX's collectives and coordination service say when another process of the run is gone.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "heartbeat", "UNAVAILABLE")


def failure_text(text: str) -> str:
    """A failure's message for the row: in a multi-process run, one that shows another process was lost says so
    first (which process this is, of how many), then the collective's own text (it names the peer's address)."""
    if jax.process_count() > 1 and any(marker in text for marker in PEER_LOST):
        return (f"lost a peer: another process of this {jax.process_count()}-process run stopped, so process "
                f"{jax.process_index()} cannot go on: {text}")
    return text


def process_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """Where this process keeps its own trace: the run's directory for process 0, process_<i>/ inside it
    for the others (TensorBoard lists each as a run of its own)."""
    index = jax.process_index()
    return run_dir if index == 0 else run_dir / f"process_{index}"

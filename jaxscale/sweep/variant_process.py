"""One sweep variant's process: launched fresh, killed at its timeout or with the sweep, its failure read back."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from jaxscale import _env
from jaxscale.run import classify_failure

# Exec'd first on Linux: the run gets SIGKILL when the sweep process dies (even by kill -9), so no orphan
# keeps running or writes into a variant the resumed sweep runs again. PR_SET_PDEATHSIG survives execv.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 9); "
    "os.getppid() == int(sys.argv[1]) or os._exit(137); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


@dataclasses.dataclass(frozen=True)
class Finished:
    """How a variant's process ended."""

    returncode: int | None  # negative: killed by that signal
    timed_out: bool
    wall_s: float  # host wall clock from launch to exit, import and compile included
    log_path: pathlib.Path


def _environment() -> dict[str, str]:
    """This environment, with this checkout of jaxscale first on the path (the run imports the same code)."""
    return _env.with_package_on_path(dict(os.environ, PYTHONUNBUFFERED="1"))


def launch(python_args: list[str], log_path: pathlib.Path, timeout_s: float | None) -> Finished:
    """Runs `python <python_args>` in its own session, output to log_path; kills its group at the timeout.

    Raises:
      KeyboardInterrupt: after killing the process, when the sweep itself is interrupted.
    """
    command = [sys.executable, *python_args]
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *python_args]
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_environment(),
            start_new_session=True,
        )  # fmt: skip
        timed_out = False
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    return Finished(process.returncode, timed_out, time.perf_counter() - start, log_path)


_PROBE = "import jaxscale, jax; print(jax.devices()[0].device_kind, flush=True)"


def device_kind_in_child(timeout_s: float = 300.0) -> str:
    """The device_kind of the device the variants' processes will run on (what jax.devices()[0] reports),
    read in a short child process, so this process never opens the accelerator or takes its memory.

    Raises:
      RuntimeError: the child failed (its last line of stderr) or timed out.
    """
    env = _env.with_package_on_path(dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"reading the device kind took longer than {timeout_s:g} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"reading the device kind failed (exit {done.returncode}): {last}")
    return lines[-1].strip()


def failure(finished: Finished, timeout_s: float | None) -> tuple[str, str]:
    """(status, one-line error) for a process that left no result row."""
    if finished.timed_out:
        return "timeout", f"no result within the per-variant timeout of {timeout_s:g} s; the run was killed"
    text = finished.log_path.read_text(errors="replace") if finished.log_path.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    usage = [line[len("jaxscale: error: ") :] for line in lines if line.startswith("jaxscale: error: ")]
    raised = [line for line in lines if _RAISED.match(line)]
    code = finished.returncode
    ending = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    if code == -signal.SIGKILL:
        ending += ", perhaps by the host's out-of-memory killer"
    message = (usage or raised or [f"the run ended without a result; see {finished.log_path}"])[-1]
    return classify_failure(text), " ".join(f"{message} ({ending})".split())[:500]

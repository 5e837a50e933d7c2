"""TensorBoard's Profiler on the lab's traces: `python -m jaxscale.tensorboard [--logdir traces] [--port N]`.

Starts the real TensorBoard server (with the profile plugin, tensorboard-plugin-profile / xprof) bound to
127.0.0.1, waits until it answers, and prints its URL and the profile runs it lists: one per captured trace,
named <run>/<timestamp> or, for a sweep variant, <sweep>/<variant>/<timestamp>. The tests start it the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from absl import flags

from jaxscale.cli import Usage, UsageError, fail, no_arguments, print_help, wants_help

HOST = "127.0.0.1"  # loopback only: a profile shows file paths and source lines
DEFAULT_TIMEOUT_S = 90.0


class ServerError(RuntimeError):
    """TensorBoard exited or did not answer in time; the message ends with the last line of its log."""


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def fetch(url: str, timeout_s: float = 60.0) -> bytes:
    """The body of a GET, gunzipped where the server sent it compressed (TensorBoard gzips its JSON)."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return body


def fetch_json(url: str, timeout_s: float = 60.0) -> object:
    return json.loads(fetch(url, timeout_s))


@dataclasses.dataclass
class Server:
    """A running TensorBoard process; stop() ends it (and only it: it runs in its own process group)."""

    process: subprocess.Popen
    url: str  # ends with "/"
    logdir: pathlib.Path
    log_path: pathlib.Path

    def profile_runs(self) -> list[str]:
        """The profile plugin's runs (one per trace capture), as its /data/plugin/profile/runs lists them."""
        return list(fetch_json(self.url + "data/plugin/profile/runs"))

    def last_log_line(self) -> str:
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout_s)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _wait_until_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.process.poll()
        if code is not None:
            raise ServerError(f"tensorboard exited with code {code}: {server.last_log_line()}")
        try:
            fetch(server.url + "data/plugins_listing", timeout_s=5.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise ServerError(f"tensorboard did not answer at {server.url} within {timeout_s:.0f} s: "
                              f"{server.last_log_line()}")  # fmt: skip
        time.sleep(0.25)


def start(logdir: str | os.PathLike, port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Server:
    """Starts `tensorboard --logdir LOGDIR --host 127.0.0.1 --port PORT` and waits until it answers.

    Args:
      logdir: the traces root (each run's trace lies in <run>/plugins/profile/<timestamp>/).
      port: TCP port on 127.0.0.1 (None or 0: a free one).
      timeout_s: how long to wait for the server's first answer.

    Returns:
      The running Server (use it as a context manager, or call stop()).

    Raises:
      UsageError: logdir is not a directory, or the port is taken.
      ServerError: TensorBoard exited or did not answer in time.
    """
    logdir = pathlib.Path(logdir)
    if not logdir.is_dir():
        raise UsageError(f"--logdir: directory {str(logdir)!r} not found; traces are written by "
                         "python -m jaxscale.run / jaxscale.sweep under <output_root>/traces")  # fmt: skip
    if port and port_in_use(port):
        raise UsageError(f"--port: {port} is in use on {HOST}; choose another, or 0 for a free one")
    port = port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="jaxscale-tensorboard-", suffix=".log", delete=False)  # noqa: SIM115
    command = [
        sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", HOST, "--port", str(port),
        "--load_fast=false",  # the profile plugin reads the files itself; no separate data-server process
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    log.close()
    server = Server(process, f"http://{HOST}:{port}/", logdir, pathlib.Path(log.name))
    _wait_until_ready(server, timeout_s)
    return server


USAGE = Usage(
    command="python -m jaxscale.tensorboard [--logdir traces] [--port N] [--timeout S]",
    summary="Starts TensorBoard with the Profile plugin on the lab's traces, bound to 127.0.0.1, and prints its "
    "URL and the profile runs it lists; serves until Ctrl-C.",
    examples=(
        "python -m jaxscale.tensorboard",
        "python -m jaxscale.tensorboard --logdir traces/seed_table_cpu --port 6006",
    ),
    notes=(
        "Each run's trace is <logdir>/<run>/plugins/profile/<timestamp>/; a sweep variant's run is "
        "<sweep>/<variant>. What to look at first: docs/tensorboard.md.",
    ),  # fmt: skip
)


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("logdir", "traces", "Traces root (runs in <run>/plugins/profile/<timestamp>/).", flag_values=fv)
    flags.DEFINE_integer("port", 0, "Port on 127.0.0.1 (0: a free one).", flag_values=fv, lower_bound=0)
    flags.DEFINE_float("timeout", DEFAULT_TIMEOUT_S, "Seconds to wait for TensorBoard to answer.", flag_values=fv)
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: starts TensorBoard, prints the URL and runs, serves until Ctrl-C; exit 0, 1, or 2 (bad input)."""
    fv = _flag_values()
    if wants_help(argv):
        return print_help(USAGE, fv)
    try:
        no_arguments(fv, argv, "use --logdir DIR")
        server = start(fv.logdir, fv.port, fv.timeout)
    except UsageError as error:
        return fail(str(error))
    except ServerError as error:
        return fail(str(error), code=1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the server too, as Ctrl-C does
    with server:
        runs = server.profile_runs()
        print(f"TensorBoard: {server.url}#profile  (logdir {server.logdir}, log {server.log_path})")
        print(f"{len(runs)} profile runs" + (":" if runs else f"; none under {server.logdir} yet"))
        for run in sorted(runs):
            print(f"  {run}")
        print("Ctrl-C to stop.", flush=True)
        try:
            code = server.process.wait()
        except KeyboardInterrupt:
            return 0
    return fail(f"tensorboard exited with code {code}: {server.last_log_line()}", code=1)


if __name__ == "__main__":
    sys.exit(main())

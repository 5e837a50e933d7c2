"""Several processes through jax.distributed: 2 processes x 4 simulated CPU devices (gloo collectives) train like one
process of 8, only process 0 writes the row, each keeps its own trace, and a failed process stops the other."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO

from jaxscale import hosts

# fp32 (a tight comparison), 2x4x1 (data over the two processes, FSDP within each), few steps.
CONFIG = [
    "--config", "configs/fp32.py:tiny", "--config.mesh.data=2", "--config.mesh.fsdp=4",
    "--config.data.batch_size=16", "--config.model.dropout_rate=0.0", "--config.train.steps=2",
    "--config.train.warmup_steps=0", "--config.profile.steps=1", "--quiet",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(commands: list[list[str]], deadline_s: float, grace_s: float = 30.0) -> list[tuple[int, str, float]]:
    """Starts every `python -m jaxscale.run ...` at once; once one fails, the others get `grace_s` to stop by
    themselves before they are killed. Returns (exit code, output, seconds) per process, in order."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxscale.run", *c],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for c in commands
    ]
    ended: dict[int, float] = {}
    failed_at = None
    while len(ended) < len(procs) and time.monotonic() - start < deadline_s:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic() - start
                failed_at = failed_at or (time.monotonic() if proc.returncode else None)
        if failed_at and time.monotonic() - failed_at > grace_s:
            break
        time.sleep(0.2)
    results = []
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()  # only processes this test started
        output = proc.communicate()[0]
        results.append((proc.returncode, output, ended.get(i, time.monotonic() - start)))
    return results


def _processes(run_dir: pathlib.Path, extra: list[list[str]] | None = None) -> list[list[str]]:
    port = _free_port()
    extra = extra or [[], []]
    return [
        [
            *CONFIG,
            "--host_devices=4",
            f"--coordinator_address=127.0.0.1:{port}",
            "--num_processes=2",
            f"--process_id={i}",
            f"--run_dir={run_dir}",
            "--distributed_timeout=20",
            *extra[i],
        ]  # fmt: skip
        for i in range(2)
    ]


def test_host_flags_are_parsed_first_and_forwarded_as_given():
    fv = hosts.parse_early(["run", "--config", "x.py", "--host_devices=4", "--num_processes", "2", "--other"])
    assert fv.host_devices == 4 and fv.num_processes == 2 and fv.process_id is None
    assert hosts.forwarded(fv) == ["--host_devices=4", "--num_processes=2"]
    assert hosts.wants_distributed(fv)
    assert not hosts.wants_distributed(hosts.parse_early(["run", "--host_devices=8"]))
    assert hosts.process_dir(pathlib.Path("traces/x")) == pathlib.Path("traces/x")  # process 0 (this one)


@pytest.mark.slow  # waits out an 8 s join timeout
def test_a_process_that_fails_before_joining_stops_the_other_in_bounded_time(tmp_path):
    """Process 1 has a bad config value (exit 2 before joining); process 0 waits --distributed_timeout=8 s in
    jax.distributed.initialize, then JAX ends it (it aborts with its own message): no hang, no row."""
    commands = _processes(tmp_path / "run", extra=[["--distributed_timeout=8"], ["--config.model.dtype=float8"]])
    (code0, out0, seconds0), (code1, out1, _) = _launch(commands, deadline_s=240, grace_s=120)
    assert code1 == 2 and "jaxscale: error: model.dtype: unknown 'float8'" in out1
    assert code0 != 0 and seconds0 < 150, (code0, seconds0, out0[-2000:])
    assert "JAX distributed service" in out0 or "jax.distributed" in out0, out0[-2000:]
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize(
    "devices_per_process", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1_device_each", "2_devices_each"]
)
def test_two_processes_give_the_loss_of_one_device(tmp_path, devices_per_process):
    """The fast counterpart: 2 processes over gloo, data over the processes (and FSDP over each one's devices:
    2x1x1 with one device per process, 2x2x1 with two), one step of the tiny fp32 model, give the loss one
    process on one device gets (rel 1e-5, as below); only process 0 writes the row, and its program
    all-reduces across the processes. One device per process once failed placing the metrics (a local
    array put on a mesh across processes): the fast case."""
    fsdp = devices_per_process
    small = [*CONFIG, f"--config.mesh.fsdp={fsdp}", "--config.train.steps=1", "--config.profile.steps=0"]
    port = _free_port()
    two = [
        [*small, f"--host_devices={devices_per_process}", f"--coordinator_address=127.0.0.1:{port}",
         "--num_processes=2", f"--process_id={i}", f"--run_dir={tmp_path / 'two'}", "--distributed_timeout=60"]
        for i in range(2)
    ]  # fmt: skip
    one = [*small, "--config.mesh.data=1", "--config.mesh.fsdp=1", f"--run_dir={tmp_path / 'one'}"]
    results = _launch([*two, one], deadline_s=600)
    assert [code for code, _, _ in results] == [0, 0, 0], [out[-2000:] for _, out, _ in results]
    rows = [json.loads((tmp_path / name / "result.json").read_text()) for name in ("two", "one")]
    assert rows[0]["process_count"] == 2 and rows[0]["device_count"] == 2 * fsdp and rows[0]["mesh"] == f"2x{fsdp}x1"
    assert rows[1]["process_count"] == 1 and rows[1]["mesh"] == "1x1x1"
    for key in ("loss_first", "loss", "accuracy"):
        assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-5), key
    assert rows[0]["compiled_collective_all_reduce_count"] > 0 == rows[1]["compiled_collective_count"]
    assert not (tmp_path / "two" / "process_1" / "result.json").exists()


@pytest.mark.slow
def test_two_processes_of_four_devices_give_the_loss_of_one_process_of_eight(tmp_path):
    two = _launch(_processes(tmp_path / "two"), deadline_s=600)
    one = _launch([[*CONFIG, "--host_devices=8", f"--run_dir={tmp_path / 'one'}"]], deadline_s=600)
    assert [code for code, _, _ in two + one] == [0, 0, 0], [out[-2000:] for _, out, _ in two + one]
    rows = [json.loads((tmp_path / name / "result.json").read_text()) for name in ("two", "one")]
    assert rows[0]["process_count"] == 2 and rows[1]["process_count"] == 1
    assert rows[0]["device_count"] == rows[1]["device_count"] == 8 and rows[0]["mesh"] == "2x4x1"
    for key in ("loss_first", "loss", "accuracy"):
        assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-5), key
    assert rows[0]["compiled_collective_bytes"] == rows[1]["compiled_collective_bytes"] > 0  # the same program
    # Only process 0 wrote a row; process 1 kept its own trace inside the run's directory.
    assert not (tmp_path / "two" / "process_1" / "result.json").exists()
    assert list((tmp_path / "two" / "process_1" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert list((tmp_path / "two" / "plugins" / "profile").glob("*/*.xplane.pb"))


@pytest.mark.slow
def test_a_process_killed_mid_run_ends_the_other_by_itself(tmp_path):
    """Once process 0 reports its first steps, process 1 is killed; process 0 ends by itself, well within the
    deadline, non-zero, and says why in one of the two ways docs/mesh.md names: its next collective fails (gloo:
    connection reset by peer) and it leaves an error row that says a peer was lost (a failure is a row), or JAX's
    distributed service terminates it first (SIGABRT), leaving no row and its own last words in the log."""
    steps = ["--config.train.steps=100000", "--noquiet"]
    commands = _processes(tmp_path / "run", extra=[steps, steps])
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    log = tmp_path / "process_0.log"
    with open(log, "w") as out:
        procs = [subprocess.Popen([sys.executable, "-m", "jaxscale.run", *c], cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT) for c in commands[:1]]  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxscale.run", *commands[1]], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and procs[0].poll() is None and "loss=" not in log.read_text():
                time.sleep(1)
            assert procs[0].poll() is None and "loss=" in log.read_text(), log.read_text()[-2000:]
            procs[1].kill()
            killed = time.monotonic()
            code = procs[0].wait(timeout=600)
            assert code != 0 and time.monotonic() - killed < 300, code
            result = tmp_path / "run" / "result.json"
            if result.exists():  # the collective failed first: the row says what happened
                row = json.loads(result.read_text())
                assert row["status"] == "error", (code, row["status"], row["error"])
                assert row["error"].startswith("lost a peer: another process of this 2-process run stopped, so "
                                               "process 0 cannot go on: "), row["error"]  # fmt: skip
            else:  # JAX's distributed service ended it first, with its own reason
                assert code == -signal.SIGABRT, (code, log.read_text()[-3000:])
                assert "the JAX distributed service detected fatal errors" in log.read_text(), log.read_text()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()  # only processes this test started

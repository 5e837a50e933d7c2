"""The environment set before JAX is imported (with and without the optional CUDA plugin), and quiet starts:
every entry point's first line is the lab's own, while real warnings still reach stderr."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from jaxscale import _env


def test_installed_is_false_when_a_parent_package_is_missing():
    # Without the gpu-plan extra there is no jax_plugins package at all; find_spec would raise.
    assert not _env.installed("jaxscale_no_such_package.xla_cuda12")
    assert not _env.installed("jaxscale.no_such_module")
    assert _env.installed("jaxscale._env")


def test_backend_is_pinned_only_without_an_accelerator(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(_env.os.path, "exists", lambda path: False)  # no /dev/nvidiactl, no /dev/accel0
    monkeypatch.setattr(_env, "installed", lambda module: False)  # no CUDA plugin: nothing to pin
    _env.quiet_native_logs()
    assert "JAX_PLATFORMS" not in _env.os.environ
    monkeypatch.setattr(_env, "installed", lambda module: True)  # plugin but no GPU: pin to the CPU
    _env.quiet_native_logs()
    assert _env.os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(_env.os.path, "exists", lambda path: path == "/dev/nvidiactl")  # a GPU: leave JAX be
    _env.quiet_native_logs()
    assert "JAX_PLATFORMS" not in _env.os.environ


# --- Quiet starts: the CUDA plugin's start-up lines are dropped, everything else reaches stderr ----------------

NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1795318664.488680    8166 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    "GPU will not be used.\n"
)
REMAT = (
    "W1122 05:16:58.963056   15493 hlo_rematerialization.cc:3231] Can't reduce memory use below 18.22GiB "
    "(19559620720 bytes) by rematerialization; only reduced to 34.13GiB (36643063308 bytes), down from 35.20GiB "
    "(37800691668 bytes) originally\n"
)


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_filter_drops_only_the_plugins_lines_and_keeps_order():
    code = (
        "import os, sys\nfrom jaxscale import _env\nwith _env.native_stderr_filtered():\n"
        f"    os.write(2, {NOISE.encode()!r})\n    os.write(2, {REMAT.encode()!r})\n"
        "    print('a Python warning', file=sys.stderr)\n"
        f"    os.write(2, {NOISE.encode()!r})\n"
        "print('after the block', file=sys.stderr)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == REMAT + "a Python warning\nafter the block\n"
    assert all(_env.is_native_noise(line) for line in NOISE.splitlines())
    assert not _env.is_native_noise(REMAT)


@pytest.mark.skipif(
    not _env.cuda_plugin_installed() or os.path.exists("/dev/nvidiactl") or _env.installed("nvidia.cuda_runtime"),
    reason="the start-up lines come from the CUDA plugin's runtime stub on a machine without an NVIDIA driver or "
    "CUDA runtime (with the gpu-plan-cudnn extra's runtime the plugin's version check fails with other lines)",
)
def test_without_the_lab_a_plain_import_of_jax_is_noisy():
    """What the lab hides is real: `import jax` alone prints the plugin's lines here (so the checks below can fail)."""
    proc = _python("import jax; jax.devices()")
    assert proc.returncode == 0
    assert any(_env.is_native_noise(line) for line in proc.stderr.splitlines())


# Every entry point given bad input: the first line of stderr is the lab's own one-line error.
BAD_STARTS = [
    ("jaxscale.run", "--config", "configs/bf16_remat.py:no_such_preset"),
    ("jaxscale", "--config", "configs/bf16_remat.py:no_such_preset"),
    ("jaxscale.sweep", "--config", "experiments/seed_table.py:no_such_preset"),
    ("jaxscale.report", "/nonexistent/results"),
    ("jaxscale.tensorboard", "--logdir", "/nonexistent/traces"),
    ("jaxscale.bench", "--preset", "huge"),
    ("jaxscale.measure.traces", "/nonexistent/run"),
    ("jaxscale.plan.target_compile",),
    ("jaxscale.fit", "--config", "configs/bf16_remat.py:no_such_preset"),
    ("jaxscale.published", "--only", "no_such_run"),
    ("jaxscale.plan.calibrate", "/nonexistent/run"),
    ("jaxscale.data", "prepare", "--text", "/nonexistent/text", "--out", "/nonexistent/tokens"),
    ("jaxscale.report.docs_tables", "--root", "/nonexistent"),
]


def test_bad_starts_cover_every_entry_point():
    """The list above is checked against the entry points found in the package's files (tests/test_cli.py),
    so a new one cannot be missed."""
    from test_cli import find_entry_points

    assert set(find_entry_points()) <= {args[0] for args in BAD_STARTS}


@pytest.mark.parametrize("args", BAD_STARTS, ids=[a[0] for a in BAD_STARTS])
def test_every_entry_point_starts_with_its_own_line(args):
    proc = run_cli(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and lines[0].startswith("jaxscale: error: "), proc.stderr
    assert len(lines) == 1 and proc.stdout == ""


def test_a_run_that_works_starts_with_its_own_line(tmp_path):
    proc = run_cli("jaxscale.run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--output_root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.splitlines()[0].startswith("run bf16_remat_tiny_plan_")

"""A calibration run read and checked: its row, compiled step and trace, on this device; a sweep's measured steps."""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import platform
import zlib

import jax

from jaxscale.cli import UsageError
from jaxscale.measure import kernels, memory, traces
from jaxscale.plan import predict
from jaxscale.plan.calibration_fit import FLAG, Calibration, CalibrationError, fit

RESULT_FILE = "result.json"


def read_run(run_dir: str | pathlib.Path) -> tuple[dict, str]:
    """(result row, compiled step's HLO text) of a measured run with a trace.

    Raises:
      CalibrationError: one line naming --calibrate and what a calibration run needs, for a missing directory,
        a run without a row, not ok, not timed, or without its trace or HLO.
    """
    path = pathlib.Path(run_dir)
    needs = "a run directory of python -m jaxscale.run (not --plan) with a trace (profile.steps >= 1)"
    if not path.is_dir():
        raise CalibrationError(f"{FLAG}: {run_dir} is not a directory; give {needs}")
    if not (path / RESULT_FILE).is_file():
        raise CalibrationError(f"{FLAG}: {run_dir} holds no {RESULT_FILE}; give {needs}")
    try:
        row = json.loads((path / RESULT_FILE).read_text())
    except ValueError as error:
        raise CalibrationError(f"{FLAG}: {run_dir}/{RESULT_FILE} is not JSON ({error}); give {needs}") from None
    if row.get("status") != "ok" or not row.get("step_s_median"):
        what = "a plan, no step ran" if row.get("plan_only") else f"its status is {row.get('status')!r}"
        raise CalibrationError(f"{FLAG}: {run_dir} has no measured step ({what}); give {needs}")
    if not list(path.glob("plugins/profile/*/*.xplane.pb")) or not (path / traces.HLO_FILE).is_file():
        raise CalibrationError(f"{FLAG}: {run_dir} has no trace (plugins/profile/*/*.xplane.pb and "
                               f"{traces.HLO_FILE}); give {needs}")  # fmt: skip
    try:
        return row, gzip.decompress((path / traces.HLO_FILE).read_bytes()).decode()
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as error:
        raise CalibrationError(f"{FLAG}: {run_dir}/{traces.HLO_FILE} is unreadable ({error}); give {needs}") from None


def check_device(row: dict, run_dir: str, device: jax.Device) -> None:
    """Raises CalibrationError unless the run was measured on this device: same backend and device kind, and on
    a CPU the same host (its roofline is this machine's) and the same malloc where the run recorded one (the seed
    table's CPU steps were 6-25% shorter with tcmalloc than with glibc's: docs/measurements.md, "The CPU's
    allocator")."""
    here = {"backend": device.platform, "device_kind": device.device_kind}
    if device.platform == "cpu":
        here["hostname"] = platform.node()
        if row.get("host_allocator"):
            here["host_allocator"] = memory.host_allocator()
    for field, value in here.items():
        if row.get(field) != value:
            raise CalibrationError(
                f"{FLAG}: {run_dir} was measured with {field} {row.get(field)!r}, this run's is {value!r}; "
                "a calibration holds only for the device it was measured on: give a run of this device"
            )


def calibration(run_dir: str | pathlib.Path, device: jax.Device | None = None, by: str = "cell") -> Calibration:
    """Fits the Calibration of a measured run on this device's roofline (predict.local_roofline); `by` as in fit.

    Raises:
      CalibrationError: the run cannot calibrate (read_run), was measured on another device (check_device), or
        this device has no roofline.
    """
    row, hlo_text = read_run(run_dir)
    device = device or jax.devices()[0]
    check_device(row, str(run_dir), device)
    roof = predict.local_roofline(device, row.get("mesh_devices") or 1)
    if roof is None:
        raise CalibrationError(f"{FLAG}: no roofline for device_kind {device.device_kind!r} to calibrate")
    try:
        summary, rows = traces.analyze(pathlib.Path(run_dir), hlo_text, write_csv=False)
    except (OSError, ValueError, RuntimeError) as error:  # what ProfileData raises for a file it cannot read
        raise CalibrationError(f"{FLAG}: {run_dir}: its trace is unreadable ({error})") from None
    if not summary.get("trace_step_s"):
        raise CalibrationError(f"{FLAG}: {run_dir}: its trace has no annotated step to time")
    fitted = fit(rows, run_kernels(row, hlo_text), roof, summary["trace_step_s"], row["step_s_median"],
                 run=str(run_dir), by=by)  # fmt: skip
    return dataclasses.replace(fitted, backend=row.get("backend"), device_kind=row.get("device_kind"),
                               hostname=row.get("hostname"))  # fmt: skip


def run_kernels(row: dict, hlo_text: str) -> list[kernels.Kernel]:
    """The run's compiled kernels, causal attention resolved by the row's config."""
    return kernels.resolve_causal(kernels.kernels(hlo_text), bool(row.get("config.model.causal", True)))


def read_steps(path: str | pathlib.Path) -> dict[str, float]:
    """variant -> step_s_median of a sweep's results.jsonl (the ok rows).

    Raises:
      UsageError: one line naming --against, for a missing or unreadable file or one without measured rows.
    """
    try:
        rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise UsageError(f"--against: {path} is not a readable results.jsonl ({error})") from None
    steps = {r["variant"]: r["step_s_median"] for r in rows if r.get("status") == "ok" and r.get("step_s_median")}
    if not steps:
        raise UsageError(f"--against: {path} has no measured rows; give a sweep's results.jsonl")
    return steps

"""A run's checks before anything is written: the mesh's devices, a checkpoint to resume or start from, --calibrate."""

from __future__ import annotations

import pathlib

import jax
import ml_collections

from jaxscale.cli import UsageError
from jaxscale.config import ConfigError, check_mesh_devices, mesh_shape
from jaxscale.plan import calibrate, gpu_plan


def check_resume(config: ml_collections.ConfigDict, run_dir: pathlib.Path) -> None:
    """The newest checkpoint in run_dir, if any, against this run's config and data (its meta alone is read).

    Raises:
      UsageError: one line naming the field the checkpoint was written with otherwise; nothing is written.
    """
    from jaxscale.train import checkpoint  # orbax is imported only by runs that checkpoint

    try:
        checkpoint.check_resume(run_dir / "checkpoints", config)
    except checkpoint.CheckpointError as error:
        raise UsageError(str(error)) from None

def check_init_from(config: ml_collections.ConfigDict) -> None:
    """finetune.init_from's newest checkpoint against this model (its meta alone is read).

    Raises:
      UsageError: one line naming the field at fault; nothing is written.
    """
    from jaxscale.train import checkpoint  # orbax is imported only by runs that checkpoint

    try:
        checkpoint.check_init_from(config)
    except checkpoint.CheckpointError as error:
        raise UsageError(str(error)) from None

def check_devices(config: ml_collections.ConfigDict, target: str | None, devices: int | None) -> None:
    """The mesh against the devices it runs on: this run's (all processes') or --devices of a target.

    Raises:
      UsageError: one line naming mesh or --devices and what would work (a 1x1x1 mesh with --devices N > 1
        included: it would plan one of the N GPUs).
    """
    if target is not None or devices is not None:
        try:
            gpu_plan.check_devices_flag(config, target, devices)
        except gpu_plan.PlanFlagError as error:
            raise UsageError(str(error)) from None
        return
    count, platform = jax.device_count(), jax.default_backend()
    hint = f"; simulate CPU devices with --host_devices={mesh_shape(config).devices}" if platform == "cpu" else ""
    try:
        check_mesh_devices(config, count, f"this run ({platform})", hint)
    except ConfigError as error:
        raise UsageError(str(error)) from None

def calibration_flag(run_dir: str | None, target: str | None) -> calibrate.Calibration | None:
    """The calibration --calibrate names (None without it), fitted for this machine's device.

    Raises:
      UsageError: one line naming --calibrate: with --target (a calibration holds for this device only), or a
        run that cannot calibrate (jaxscale.plan.calibrate.CalibrationError).
    """
    if run_dir is None:
        return None
    if target is not None:
        raise UsageError(f"--calibrate: fits the predictor of this machine's device; --target {target} plans "
                         "another GPU, whose prediction stays uncalibrated: drop one of the two")  # fmt: skip
    try:
        return calibrate.calibration(run_dir)
    except calibrate.CalibrationError as error:
        raise UsageError(str(error)) from None

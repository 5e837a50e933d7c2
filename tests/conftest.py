"""Shared test helpers: real config files, shrunk to the `tiny` preset."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jaxscale.config import load_config_file  # importing jaxscale sets the backend environment first

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def load_config(name: str, preset: str = "tiny"):
    """get_config(preset) of configs/<name>.py, the same function the command line calls."""
    return load_config_file(CONFIGS / f"{name}.py", preset)


def run_cli(*args: str, cwd: pathlib.Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `python -m <args>` in a fresh process, as a user would."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def tiny_config():
    return load_config


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped (not deleted) where JAX has no GPU backend."""
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU backend")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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


def loss_and_grads(config, params, batch):
    """Deterministic (dropout off) loss and gradients of `config`'s model at `params`, jitted."""
    import jax

    from jaxscale import train

    config.model.dropout_rate = 0.0
    apply_fn = train.make_model(config).apply

    def loss_fn(p):
        return train.next_token_loss(p, apply_fn, batch, jax.random.PRNGKey(0))[0]

    return jax.jit(jax.value_and_grad(loss_fn))(params)


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled params (block_0 ... block_{L-1}) in the layout of a scan_layers=True model (stacked on axis 0)."""
    import jax
    import jax.numpy as jnp

    stacked = [params["transformer"][f"block_{i}"] for i in range(num_layers)]
    return {**params, "transformer": {"blocks": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *stacked)}}


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    """Same tree structure, and every leaf allclose."""
    import jax
    import numpy as np

    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)

"""Chunked and flash attention on a mesh with the heads split over `tensor` compute what one device computes
with the reference attention (float32): gradients and the parameters after a train step.

Needs 8 devices: tests/model/test_attention.py runs this file in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8; in an ordinary test process it is skipped.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxscale import train
from jaxscale.config import base_config, validate
from jaxscale.train import sharding

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see tests/model/test_attention.py)")


def _config(mesh, attention, **model):
    config = base_config("tiny-llama", attention)
    config.model.update(dtype="float32", dropout_rate=0.0, attention=attention, **model)
    config.data.batch_size, config.train.num_minibatches = 8, 1
    config.optimizer.update(name="sgd", warmup_steps=0, learning_rate=0.5, b1=0.0)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    validate(config)
    return config


@functools.cache
def _step(mesh, attention, blocks=()):
    """(loss sum, params after one train step) of the tiny Llama (4 query heads, 2 K/V heads) on `mesh`."""
    config = _config(mesh, attention, **dict(blocks))
    placement = sharding.placement(config, jax.devices()[: int(np.prod(mesh))])
    batch = train.make_batch(jax.random.PRNGKey(1), 8, config.data.seq_len, config.model.vocab_size)
    state, metrics = placement.step()(placement.init_state(), placement.init_metrics(), placement.place_batch(batch))
    return float(metrics["loss_sum"]), jax.device_get(state.params)


@pytest.mark.parametrize("attention,blocks", [
    ("chunked", (("attention_block_k", 8),)),
    ("flash", (("attention_block_q", 16), ("attention_block_k", 16))),
])  # fmt: skip
def test_kernel_with_heads_split_over_tensor_equals_the_reference_on_one_device(attention, blocks):
    """A 4x1x2 mesh (batch over data, 2 query heads and 1 K/V head per tensor device): loss and parameters
    after one SGD step equal the single-device reference step's."""
    loss, params = _step((4, 1, 2), attention, blocks)
    ref_loss, ref_params = _step((1, 1, 1), "reference")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)

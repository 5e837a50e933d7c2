"""Chunked and flash attention on a mesh with the heads split over `tensor` compute what one device computes
with the reference attention (float32): gradients and the parameters after a train step.

Needs 8 devices: tests/model/test_attention.py runs this file in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8; in an ordinary test process it is skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale import train
from jaxscale.config import base_config, validate
from jaxscale.model import flash_attention as flash
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


# Context parallelism: the ring over a mesh axis "context" (jaxscale.model.ring_attention) against the reference
# einsum on one device, values and every gradient, in float32.
RING_RULES = (("batch", ("data", "fsdp")), ("seq", "context"), ("heads", "tensor"), ("kv_heads", "tensor"))


def _ring_mesh(shape):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, ("data", "fsdp", "context", "tensor"))


def _ring_and_reference(shape, causal, kernel="chunked"):
    """(ring output and input gradients, reference's) for 4 query heads over 2 K/V heads, sequence 32, the
    blocks through `kernel` (chunked: key blocks of 2; flash: Pallas's interpreter, blocks of 4)."""
    from flax import linen as nn

    from jaxscale.model import ring_attention as ring
    from jaxscale.model.attention import reference_attention

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 32, 4, 8))
    k, v = (jax.random.normal(key, (2, 32, 2, 8)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape)
    n = shape[2]

    if kernel == "flash":
        blocks = ring.BlockKernel("flash", flash_blocks=flash.block_sizes(8, 32 // (2 * n), jnp.float32, 4, 4))
    else:
        blocks = ring.BlockKernel("chunked", block_k=2)

    def attend(q, k, v):  # natural order in and out, the balanced order in between
        balanced = (ring.to_balanced(x, n) for x in (q, k, v))
        return ring.from_balanced(ring.ring_attention(*balanced, causal, blocks), n)

    with jax.set_mesh(_ring_mesh(shape)), nn.logical_axis_rules(RING_RULES):
        jitted = jax.jit(attend)
        out, vjp = jax.vjp(jitted, q, k, v)
        grads = vjp(cotangent)
        hlo = jitted.lower(q, k, v).compile().as_text()
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal, jnp.float32), q, k, v)
    return (out, *grads), (ref_out, *ref_vjp(cotangent)), hlo


@pytest.mark.parametrize(
    "shape,kernel",
    [((2, 1, 4, 1), "chunked"), ((1, 1, 8, 1), "chunked"), ((1, 2, 2, 2), "chunked"), ((1, 1, 4, 1), "flash")],
)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_the_reference_on_one_device(shape, kernel, causal):
    """Rings of 4 (x 2 data parallel), of 8 (chunks of 2 positions), and of 2 with FSDP and the heads over
    tensor, with chunked blocks; a ring of 4 with flash blocks (Pallas interpreted): output, dq, dk and dv equal
    the reference einsum's (the masked halves skipped, the backward's own ring)."""
    ring, reference, _ = _ring_and_reference(shape, causal, kernel)
    for a, b in zip(ring, reference, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-6)


def test_the_ring_passes_blocks_and_gathers_nothing():
    """The compiled ring, with q, k, v and its output split along the sequence over a ring of 4, passes k and v
    around (collective-permutes) and gathers nothing: no device ever holds the whole sequence's keys."""
    import re

    from flax import linen as nn

    from jaxscale.model import ring_attention as ring

    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 32, 2, 8), jnp.float32)
    mesh = _ring_mesh((1, 1, 4, 1))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RING_RULES):
        kernel = ring.BlockKernel("chunked", block_k=2)
        attend = jax.jit(
            lambda q, k, v: ring.ring_attention(q, k, v, True, kernel), in_shardings=split, out_shardings=split
        )
        hlo = attend.lower(q, kv, kv).compile().as_text()
    kinds = r"(all-gather|all-reduce|all-to-all|collective-permute)"
    ops = [m.group(1) for m in re.finditer(rf"= \S+ {kinds}(?:-start)?\(", hlo)]
    assert "collective-permute" in ops and "all-gather" not in ops and "all-reduce" not in ops, ops

"""The balanced order of context parallelism (jaxscale.model.ring_attention), against hand-written permutations.
The ring itself runs on 8 simulated devices: tests/model/test_attention_devices.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.model import ring_attention


@pytest.mark.parametrize(
    "seq,n,order",
    [
        (8, 2, [0, 1, 6, 7, 2, 3, 4, 5]),  # chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
        (12, 3, [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]),
        (8, 4, [0, 7, 1, 6, 2, 5, 3, 4]),  # chunks of 1
        (6, 1, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_each_device_holds_an_early_and_a_late_chunk(seq, n, order):
    assert ring_attention.balanced_positions(seq, n).tolist() == order
    x = jnp.arange(2 * seq).reshape(2, seq) * 10  # [batch, seq]
    balanced = ring_attention.to_balanced(x, n, axis=1)
    np.testing.assert_array_equal(balanced, np.asarray(x)[:, order])
    np.testing.assert_array_equal(ring_attention.from_balanced(balanced, n, axis=1), x)


def test_the_order_permutes_any_axis_and_leaves_the_others():
    x = jnp.arange(3 * 8 * 5).reshape(3, 8, 5)  # [batch, seq, features]
    order = ring_attention.balanced_positions(8, 2)
    np.testing.assert_array_equal(ring_attention.to_balanced(x, 2, axis=1), np.asarray(x)[:, order])
    y = jnp.moveaxis(x, 1, -1)  # the sequence last
    np.testing.assert_array_equal(ring_attention.to_balanced(y, 2, axis=-1), np.asarray(y)[..., order])
    np.testing.assert_array_equal(ring_attention.from_balanced(ring_attention.to_balanced(y, 2, -1), 2, -1), y)

"""jaxscale.train.bf16_weights: a float32 update added to bf16 weights by nearest, stochastic and Kahan rounding,
against float64 sums and the bf16 grid computed with ml_dtypes in NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxscale.train import bf16_weights


def _neighbours(x: float) -> tuple[float, float]:
    """The bf16 values just below and above float32 `x` (NumPy: the bf16 grid by truncating x's bits)."""
    below = float(np.array(np.uint32(np.float32(x).view(np.uint32)) & np.uint32(0xFFFF0000)).view(np.float32))
    spacing = float(np.spacing(ml_dtypes.bfloat16(below)))
    return below, below + spacing


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_stochastic_rounding_goes_up_as_often_as_the_fraction_it_drops(fraction):
    """x a `fraction` of the way from one bf16 value to the next: 200,000 roundings land on the two neighbours only,
    up in `fraction` of them (within 5 standard deviations of a binomial count), so their mean is x (unbiased)."""
    below, above = _neighbours(1.0 + 1 / 256)
    x = np.float32(below + fraction * (above - below))
    draws = np.asarray(bf16_weights.stochastic_round(jnp.full((200_000,), x), jax.random.PRNGKey(0)), np.float64)
    assert set(np.unique(draws)) <= {below, above}
    up = float(np.mean(draws == above))
    assert abs(up - fraction) < 5 * np.sqrt(fraction * (1 - fraction) / draws.size)
    exact = jnp.asarray([below, -above, 0.0, 3.0], jnp.float32)  # bf16 values: unchanged, whatever the bits
    np.testing.assert_array_equal(np.asarray(bf16_weights.stochastic_round(exact, jax.random.PRNGKey(1)), np.float32),
                                  np.asarray(exact))  # fmt: skip


def test_small_steps_vanish_to_nearest_rounding_and_add_up_under_kahan_and_stochastic():
    """1,000 steps of 1e-3 on 1,024 weights of 1.0: each below half of bf16's spacing at 1 (2^-7 / 2), so
    round-to-nearest never moves a weight; Kahan's compensation reaches the float64 sum, 2.0, within half a spacing
    at 2 (2^-7); stochastic rounding is unbiased: the weights' mean is 2.0 within 5 standard deviations of a mean of
    1,024 random walks (each step's error has standard deviation 2^-7 x sqrt(f (1 - f)) below 2 and twice that above,
    f the step's fraction of a spacing: at most 0.083 x 2 over 1,000 steps, measured 0.084)."""
    weights = {"w": jnp.ones((1024,), jnp.bfloat16)}
    step = {"w": jnp.full((1024,), 1e-3, jnp.float32)}
    results = {}
    for rounding in bf16_weights.ROUNDINGS:
        params = weights
        compensation = bf16_weights.init_compensation(params) if rounding == "kahan" else None
        for i in range(1000):
            params, compensation = bf16_weights.apply_updates(params, step, rounding, jax.random.PRNGKey(i),
                                                              compensation)  # fmt: skip
        assert params["w"].dtype == jnp.bfloat16
        results[rounding] = np.asarray(params["w"], np.float64)
    np.testing.assert_array_equal(results["nearest"], 1.0)
    assert np.abs(results["kahan"] - 2.0).max() <= 2**-7
    walk = 2 * 2**-7 * np.sqrt(0.128 * 0.872) * np.sqrt(1000)  # a generous bound on one weight's spread
    assert abs(results["stochastic"].mean() - 2.0) <= 5 * walk / np.sqrt(1024)
    assert results["stochastic"].std() > 0.02  # each weight its own walk: rounded independently


def test_kahan_keeps_what_rounding_lost():
    """50 updates of about 1e-4 on 256 weights of about 1: round-to-nearest loses most of them (the spacing is 2^-7
    there); after each compensated add, weight + compensation equals the float64 running sum up to the bf16 rounding of
    the compensation itself (at most 2^-9 of it a step, n x 2^-9 x max|c| over n steps), a hundredth of nearest's
    error or less."""
    rng = np.random.default_rng(0)
    start = jnp.asarray(rng.normal(size=256), jnp.bfloat16)
    weight, compensation, nearest = start, jnp.zeros((256,), jnp.bfloat16), start
    exact = np.asarray(start, np.float64)
    for _ in range(50):
        update = rng.normal(size=256).astype(np.float32) * 1e-4
        weight, compensation = bf16_weights.kahan_add(weight, jnp.asarray(update), compensation)
        nearest, _ = bf16_weights.apply_updates(nearest, jnp.asarray(update), "nearest", jax.random.PRNGKey(0))
        exact += update
    error = np.abs(np.asarray(weight, np.float64) + np.asarray(compensation, np.float64) - exact).max()
    assert error <= 50 * 2**-9 * np.abs(np.asarray(compensation, np.float64)).max()
    assert error <= 0.01 * np.abs(np.asarray(nearest, np.float64) - exact).max()

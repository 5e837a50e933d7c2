"""jaxscale.model.pipeline on one device (its constraints are no-ops without a mesh): the schedule applies every layer
in the model's order to every row, GPipe and circular, and its loop runs the iterations the schedule counts. The
same function on meshes of 8 devices: tests/train/test_sharding_devices.py (test_pipeline_stages_equal_one_device)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.measure import hlo
from jaxscale.model import pipeline

L, B, T, H = 8, 8, 3, 5


def _layer(params: tuple[jax.Array, jax.Array], h: jax.Array) -> jax.Array:
    """A residual layer whose order matters (each layer its own weights and bias)."""
    w, b = params
    return h + jnp.tanh(h @ w + b)


def _params() -> tuple[jax.Array, jax.Array]:
    key = jax.random.PRNGKey(0)
    return jax.random.normal(key, (L, H, H)) * 0.5, jax.random.normal(jax.random.fold_in(key, 1), (L, H))


def _sequential(params, x):
    """The layers one after another, for every row at once (the reference: no microbatches, no stages)."""
    for i in range(L):
        x = _layer((params[0][i], params[1][i]), x)
    return x


def _pipelined(params, x, schedule):
    return pipeline.run(_layer, pipeline.stage_layout(params, schedule), x, schedule)


@pytest.mark.parametrize(
    "stages,microbatches,repeats",
    [(2, 1, 1), (2, 4, 1), (4, 2, 1), (8, 8, 1), (2, 2, 2), (2, 4, 2), (2, 2, 4), (4, 4, 2), (4, 8, 2)],
)
def test_every_schedule_applies_the_layers_in_order_to_every_row(stages, microbatches, repeats):
    """Output and gradients (of a sum over rows weighted per row, so a row in the wrong place shows) equal the
    sequential stack's to float32 rounding."""
    params = _params()
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, H))
    weights = jnp.arange(1.0, B + 1.0)[:, None, None]
    schedule = pipeline.Schedule(stages, microbatches, repeats)

    def loss(fn):
        return lambda p, x: jnp.sum(weights * fn(p, x) ** 2)

    want = jax.value_and_grad(loss(_sequential), argnums=(0, 1))(params, x)
    got = jax.jit(jax.value_and_grad(loss(lambda p, x: _pipelined(p, x, schedule)), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("stages,microbatches,repeats,iterations", [(4, 8, 1, 11), (2, 4, 2, 9), (8, 2, 1, 9)])
def test_the_compiled_loop_runs_the_iterations_of_the_schedule_and_its_bubble(stages, microbatches, repeats,
                                                                               iterations):  # fmt: skip
    """The hand count v·m + p - 1 (GPipe's and the circular schedule's: Huang et al. 2019, Narayanan et al. 2021) is
    the compiled program's loop trip count, and the bubble is the p - 1 iterations of it no stage uses."""
    schedule = pipeline.Schedule(stages, microbatches, repeats)
    assert schedule.iterations == iterations
    assert schedule.bubble == pytest.approx((stages - 1) / iterations)
    x = jnp.zeros((B, T, H))
    compiled = jax.jit(lambda p, x: _pipelined(p, x, schedule)).lower(_params(), x).compile()
    trips = {i.trip_count for c in hlo.parse(compiled.as_text()).computations.values() for i in c.values()}
    assert iterations in trips


def test_every_row_meets_every_layer_once_and_comes_back_in_its_place():
    """A layer counting its applications gives every row L (no visit lost or repeated, bubbles included), and the
    identity returns each row where it was (microbatch j carries rows j, j + m, ... and puts them back)."""
    schedule = pipeline.Schedule(2, 4, 1)
    x = jnp.zeros((B, 1, 1))
    staged = pipeline.stage_layout(jnp.zeros((L,)), schedule)
    counts = pipeline.run(lambda p, h: h + 1.0, staged, x, schedule)  # every layer once: L
    assert np.all(np.asarray(counts) == L)
    rows = jnp.arange(B, dtype=jnp.float32).reshape(B, 1, 1)
    np.testing.assert_array_equal(pipeline.run(lambda p, h: h, staged, rows, schedule), rows)


def test_inside_the_loop_only_the_pipelines_names_keep_the_stage_axis():
    """Outside the loop the positions split over the stages too (the head on 1/p of them); inside, only the stacked
    layers, the stage dimension and the finished microbatches' positions keep it."""
    from jaxscale.config import layout_rules

    outside = dict(layout_rules.RULES)
    inside = dict(pipeline.inner_rules(layout_rules.RULES))
    assert outside["stream_seq"] == outside["seq"] == ("context", "stage")
    assert inside["stream_seq"] == inside["seq"] == ("context",)
    assert inside["layers"] == inside["stage"] == inside["stage_seq"] == "stage"
    assert inside["batch"] == outside["batch"] and inside["embed"] == outside["embed"]


@pytest.mark.parametrize("repeats", [1, 2])
def test_the_backward_pass_keeps_no_copy_of_the_weights_per_iteration(repeats):
    """The circular schedule picks each iteration's weights by the iteration's index (two visits, then a select per
    stage): kept for the backward pass, that was a copy of a stage's weights in every iteration of the loop (the Llama
    3.1 8B plan of 4 stages x 2 visits: 70.6 GiB against GPipe's 30.6). They are picked again in the backward pass
    instead: the compiled gradient holds no array of the loop's iterations by a layer's weight matrix [H, H]; the
    layers' inputs, one [b, T, H] an iteration and layer, are still kept."""
    schedule = pipeline.Schedule(2, 4, repeats)
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, H))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(_pipelined(p, x, schedule) ** 2)))
    text = grad.lower(_params(), x).compile().as_text()
    shapes = {tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"f32\[([\d,]+)\]", text)}
    per_iteration = {s for s in shapes if s[0] == schedule.iterations and len(s) > 2}
    assert not [s for s in per_iteration if s[-2:] == (H, H)], per_iteration
    assert [s for s in per_iteration if s[-2:] == (T, H)]  # the layers' inputs, an iteration's each

"""The train step: accumulation equals the full batch, donation, metrics, and remat+scan shrinking XLA's plan."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, load_config, slow_except

from jaxscale import run, train
from jaxscale.config import base_config
from jaxscale.measure import memory


def _setup(dropout: float = 0.0, preset: str = "tiny"):
    config = base_config(preset, "accumulate")
    config.model.dtype = "float32"
    config.model.dropout_rate = dropout
    state = train.make_init_fn(config)()
    batch = train.make_batch(jax.random.PRNGKey(3), 8, config.data.seq_len, config.model.vocab_size)

    def grad_fn(params, minibatch, rng):
        (_, metrics), grads = jax.value_and_grad(train.next_token_loss, has_aux=True)(
            params, state.apply_fn, minibatch, rng
        )
        return grads, metrics

    return state, batch, grad_fn


# Both methods and both families in the default suite, every (minibatches, method, family) under -m slow.
ACCUMULATION_CASES = slow_except(
    [(n, method, preset) for n in (1, 2, 4) for method in ("loop", "scan") for preset in ("tiny", "tiny-llama")],
    fast=lambda case: case in ((4, "scan", "tiny"), (2, "loop", "tiny-llama")),
)


@pytest.mark.parametrize("num_minibatches, method, preset", ACCUMULATION_CASES)
def test_accumulated_gradients_equal_full_batch(method, num_minibatches, preset):
    state, batch, grad_fn = _setup(preset=preset)
    rng = jax.random.PRNGKey(0)
    full_grads, full_metrics = jax.jit(grad_fn)(state.params, batch, rng)
    accumulate = jax.jit(train.accumulate_gradients, static_argnums=(0, 4, 5))
    grads, metrics = accumulate(grad_fn, state.params, batch, rng, num_minibatches, method)
    assert_trees_close(grads, full_grads)
    assert float(metrics["tokens"]) == float(full_metrics["tokens"]) == batch.labels.size
    np.testing.assert_allclose(float(metrics["loss_sum"]), float(full_metrics["loss_sum"]), rtol=1e-5)
    assert float(metrics["correct"]) == float(full_metrics["correct"])


def test_loop_and_scan_use_the_same_dropout_keys():
    """With dropout on, both forms fold minibatch i's key the same way, so their gradients match."""
    state, batch, grad_fn = _setup(dropout=0.5)
    accumulate = jax.jit(train.accumulate_gradients, static_argnums=(0, 4, 5))
    rng = jax.random.PRNGKey(7)
    loop = accumulate(grad_fn, state.params, batch, rng, 4, "loop")
    scan = accumulate(grad_fn, state.params, batch, rng, 4, "scan")
    assert_trees_close(loop, scan)
    no_dropout = _setup(dropout=0.0)[2]
    plain = accumulate(no_dropout, state.params, batch, rng, 4, "scan")
    assert not np.allclose(plain[1]["loss_sum"], scan[1]["loss_sum"])  # dropout really was on


def test_train_step_donates_state_accumulates_metrics_and_learns():
    config = load_config("bf16_remat")
    config.optimizer.warmup_steps = 0  # set before the optimizer is built (make_init_fn builds it)
    step = train.make_train_step(config)
    state = train.make_init_fn(config)()
    metrics = train.init_metrics()
    batch = train.make_batch(
        jax.random.PRNGKey(0), config.data.batch_size, config.data.seq_len, config.model.vocab_size
    )
    old_params = jax.tree_util.tree_leaves(state.params)[0]
    losses, previous = [], 0.0
    for _ in range(8):
        state, metrics = step(state, metrics, batch)
        total = float(metrics["loss_sum"])
        losses.append((total - previous) / batch.labels.size)
        previous = total
    assert old_params.is_deleted()  # the state was donated: no second copy of params and Adam state
    assert int(state.step) == 8
    assert float(metrics["tokens"]) == 8 * batch.labels.size
    assert losses[-1] < losses[0]  # it learns the fixed random batch


def _temp_bytes(config) -> int:
    return memory.compiled_memory(run.compile_step(config)[0])["compiled_temp_bytes"]


@pytest.mark.slow  # the target-plan version (tests/plan/test_gpu_plan.py) runs by default
def test_remat_with_scan_shrinks_the_compiled_plan():
    scan_only = load_config("bf16")
    remat = load_config("bf16_remat")
    block = load_config("bf16_remat_block")
    scan_temp = _temp_bytes(scan_only)
    assert _temp_bytes(remat) < 0.7 * scan_temp
    assert _temp_bytes(block) < 0.7 * scan_temp


def _first_update(name: str, clip: float, grads: np.ndarray, warmup_steps: int = 0):
    """The first update and optimizer state of optimizer `name` (built after its fields are set)."""
    config = base_config("tiny", "opt")
    config.optimizer.update(name=name, grad_clip_norm=clip, warmup_steps=warmup_steps, learning_rate=0.1)
    tx = train.make_optimizer(config.optimizer)
    params = {"w": np.ones(grads.shape, np.float32)}
    updates, state = tx.update({"w": grads}, tx.init(params), params)
    return np.asarray(updates["w"]), state


def test_warmup_starts_at_a_learning_rate_of_zero():
    """Why the clipping test below sets warmup_steps=0: with warm-up the first update is exactly zero."""
    grads = np.full(3, 5.0, np.float32)
    assert not np.any(_first_update("sgd", 0.0, grads, warmup_steps=10)[0])
    assert np.any(_first_update("sgd", 0.0, grads)[0])


def test_clipping_bounds_an_update_that_would_exceed_the_norm():
    """Gradients of global norm 10 (> 1): SGD's first step is lr x the clipped gradient; Adam's first moment
    stores the clipped gradient (its first step, m/sqrt(v), is scale-free, so the moment is where it shows)."""
    grads = np.array([6.0, 8.0, 0.0], np.float32)  # norm 10
    lr, clip = 0.1, 1.0
    clipped, _ = _first_update("sgd", clip, grads)
    unclipped, _ = _first_update("sgd", 0.0, grads)
    np.testing.assert_allclose(unclipped, -lr * grads, rtol=1e-6)
    np.testing.assert_allclose(clipped, -lr * grads / 10.0, rtol=1e-6)  # norm lr * clip, same direction
    small = np.array([0.3, 0.4, 0.0], np.float32)  # norm 0.5 < 1: left alone
    np.testing.assert_allclose(_first_update("sgd", clip, small)[0], _first_update("sgd", 0.0, small)[0])
    for name in ("adam", "adamw"):
        b1 = base_config("tiny", "opt").optimizer.b1
        moment = {c: optax.tree_utils.tree_get(_first_update(name, c, grads)[1], "mu")["w"] for c in (clip, 0.0)}
        np.testing.assert_allclose(np.linalg.norm(moment[clip]), (1 - b1) * clip, rtol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(moment[0.0]), (1 - b1) * 10.0, rtol=1e-5)


def test_every_optimizer_builds_and_takes_a_finite_clipped_step():
    """adafactor included: a huge gradient, clipped, gives a finite update of the right sign."""
    grads = np.full(3, 1e6, np.float32)
    for name in ("adam", "adamw", "sgd", "adafactor"):
        update, _ = _first_update(name, 1.0, grads)
        assert np.all(np.isfinite(update)) and np.all(update < 0), name


@pytest.mark.parametrize(
    "scan_layers, accumulate, preset",
    slow_except(
        [(False, "loop", "tiny"), (True, "scan", "tiny"), (False, "loop", "tiny-llama"), (True, "scan", "tiny-llama")],
        fast=lambda case: case in ((False, "loop", "tiny"), (True, "scan", "tiny-llama")),
    ),
)
def test_named_scopes_reach_the_compiled_program(scan_layers, accumulate, preset):
    """Traces and HLO name the model's parts, so a profile reads block_1 / attn / mlp / accumulate / optimizer."""
    config = base_config(preset, "scopes")
    config.model.scan_layers, config.train.accumulate = scan_layers, accumulate
    op_names = "\n".join(re.findall(r'op_name="([^"]+)"', run.compile_step(config)[0].as_text()))
    expected = ["jit(train_step)/accumulate/", "jit(train_step)/optimizer/", "/attn/", "/mlp/", "/embed/", "/head/"]
    expected += ["/blocks/", "/minibatch/"] if scan_layers else ["/block_1/", "/minibatch_1/"]
    for scope in expected:
        assert scope in op_names, scope

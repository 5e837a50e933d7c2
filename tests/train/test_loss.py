"""The chunked output head and loss: the same loss, metrics and gradients as the whole-logits loss, with no
[B, T, V] logits in the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, load_config, run_cli

from jaxscale import train
from jaxscale.config import ConfigError, validate
from jaxscale.measure import memory


def _loss_and_grads(config, state, batch, rng):
    loss_fn = train.make_loss_fn(config)

    def value(params):
        return loss_fn(params, state.apply_fn, batch, rng)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(value, has_aux=True))(state.params)
    return loss, metrics, grads


# tiny: GPT, untied head with a bias, dropout 0.1; tiny-llama: tied head (the embedding transposed), no bias.
@pytest.mark.parametrize(
    "preset", [pytest.param("tiny", marks=pytest.mark.slow), "tiny-llama"]
)  # one loss for both families
@pytest.mark.parametrize("chunk_len", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_chunked_loss_equals_the_whole_logits_loss(preset, chunk_len):
    config = load_config("fp32", preset)  # float32: the two sums differ only by rounding order
    config.model.dropout_rate = 0.1  # the same dropout masks: the model runs the same modules with the same key
    state = train.make_init_fn(config)()
    batch = train.make_batch(jax.random.PRNGKey(3), 8, config.data.seq_len, config.model.vocab_size)
    rng = jax.random.PRNGKey(5)
    whole = _loss_and_grads(config, state, batch, rng)
    config.train.loss_chunk_len = chunk_len
    validate(config)
    chunked = _loss_and_grads(config, state, batch, rng)
    np.testing.assert_allclose(float(chunked[0]), float(whole[0]), rtol=1e-6)
    assert float(chunked[1]["tokens"]) == float(whole[1]["tokens"]) == batch.labels.size
    assert float(chunked[1]["correct"]) == float(whole[1]["correct"])
    np.testing.assert_allclose(float(chunked[1]["loss_sum"]), float(whole[1]["loss_sum"]), rtol=1e-6)
    assert_trees_close(chunked[2], whole[2], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # 50 s; the float32 equality above holds the claim in the default suite
def test_chunked_train_step_equals_the_whole_step_in_bf16():
    config = load_config("bf16_remat", "tiny")  # bf16, scan, remat MLP+Attn, 2 minibatches
    state = train.make_init_fn(config)()
    batch = train.make_batch(jax.random.PRNGKey(1), 8, config.data.seq_len, config.model.vocab_size)
    copy = jax.tree_util.tree_map(jnp.copy, state)
    whole, whole_metrics = train.make_train_step(config)(state, train.init_metrics(), batch)
    config.train.loss_chunk_len = 8
    chunked, chunked_metrics = train.make_train_step(config)(copy, train.init_metrics(), batch)
    np.testing.assert_allclose(float(chunked_metrics["loss_sum"]), float(whole_metrics["loss_sum"]), rtol=2e-3)
    assert_trees_close(chunked.params, whole.params, rtol=2e-2, atol=2e-4)  # bf16 matmuls, Adam's first step


def test_no_whole_logits_in_the_compiled_step():
    """At a vocabulary where the logits dominate, the chunked step's plan drops them: the whole step keeps at
    least the [B, T, V] float32 logits (and its gradient); the chunked one at most a few [B, C, V] chunks."""
    config = load_config("bf16_remat", "tiny")
    config.model.vocab_size, config.data.batch_size, config.train.num_minibatches = 8192, 8, 1
    validate(config)
    logits_bytes = 8 * config.data.seq_len * 8192 * 4  # [B, T, V] float32: 8 MiB
    whole = memory.compiled_memory(train.make_train_step(config).lower(*train.abstract_inputs(config)).compile())
    config.train.loss_chunk_len = 4  # [B, C, V] float32: 1 MiB
    chunked = memory.compiled_memory(train.make_train_step(config).lower(*train.abstract_inputs(config)).compile())
    assert whole["compiled_temp_bytes"] >= logits_bytes
    assert whole["compiled_temp_bytes"] - chunked["compiled_temp_bytes"] >= logits_bytes


def test_a_chunk_that_does_not_divide_the_sequence_is_one_line():
    config = load_config("bf16_remat", "tiny")  # seq 32
    config.train.loss_chunk_len = 12
    with pytest.raises(ConfigError, match=r"^train.loss_chunk_len: 12 does not divide data.seq_len=32; allowed: 0 "):
        validate(config)
    proc = run_cli("jaxscale.run", "--config", "configs/bf16_remat.py:tiny", "--config.train.loss_chunk_len=12",
                   "--plan", timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "train.loss_chunk_len: 12" in proc.stderr

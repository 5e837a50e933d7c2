"""Validation loss: the mean over minibatch-sized pieces equals the loss of the whole batch, without dropout."""

from __future__ import annotations

import jax
import numpy as np
from conftest import load_config

from jaxscale import train
from jaxscale.train import evaluate


def test_validation_loss_is_the_eval_mode_loss_of_the_whole_batch():
    config = load_config("fp32", "tiny")
    state = jax.jit(train.make_init_fn(config))()
    batch = train.make_batch(jax.random.PRNGKey(1), 8, config.data.seq_len, config.model.vocab_size)
    halves = [jax.tree_util.tree_map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch) for i in range(2)]
    step = evaluate.make_eval_step(config)
    result = evaluate.evaluate(step, state.params, halves)
    model = train.make_model(config, train=False)
    logits = model.apply({"params": state.params}, batch.inputs)  # [B, T, V]
    expected = -np.take_along_axis(jax.nn.log_softmax(logits), batch.labels[..., None], axis=-1).mean()
    np.testing.assert_allclose(result["loss"], expected, rtol=1e-6)
    assert result["tokens"] == batch.labels.size
    again = evaluate.evaluate(step, state.params, halves)
    assert again == result  # no dropout: the same every time

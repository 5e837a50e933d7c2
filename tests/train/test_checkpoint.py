"""Orbax checkpoints: the train state comes back leaf for leaf with the data position, the newest are kept,
and a checkpoint refuses to resume a run whose config would change the loss curve."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import load_config

from jaxscale import train
from jaxscale.train.checkpoint import CheckpointMismatch, Checkpoints


def _state(config):
    return jax.jit(train.make_init_fn(config))()


def test_state_and_data_position_round_trip_and_only_the_newest_are_kept(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every, config.train.checkpoint_keep = 2, 2
    state = _state(config)
    state = state.replace(step=state.step + 6, rng=jax.random.PRNGKey(7))
    saver = Checkpoints(tmp_path / "checkpoints", config)
    assert saver.latest_step() is None and saver.due(4) and not saver.due(3)
    for step in (2, 4, 6):
        saver.save(step, state, {"grain": {"next_index": step}})
    saver.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6]
    loader = Checkpoints(tmp_path / "checkpoints", config)
    target = _state(config)
    step, restored, position = loader.restore(target)
    loader.close()
    assert step == 6 and position == {"grain": {"next_index": 6}}
    assert type(restored) is type(state) and restored.apply_fn == target.apply_fn and restored.tx is target.tx
    for want, got in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_checkpoint_of_another_config_is_refused(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every = 1
    saver = Checkpoints(tmp_path / "checkpoints", config)
    saver.save(1, _state(config), {})
    saver.close()
    other = load_config("bf16", "tiny")
    other.train.checkpoint_every, other.optimizer.learning_rate = 1, 0.5
    loader = Checkpoints(tmp_path / "checkpoints", other)
    with pytest.raises(CheckpointMismatch, match="written with optimizer.learning_rate=0.001, this run has 0.5"):
        loader.restore(_state(other))
    loader.close()

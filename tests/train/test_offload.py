"""jaxscale.train.offload: the step with its optimizer state (and parameters) in host memory equals the device step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxscale import train
from jaxscale.config import ConfigError, base_config, validate
from jaxscale.train import sharding


def _two_steps(offload_state: bool = False, offload_params: bool = False):
    """The state after two steps of the tiny GPT (float32, no dropout) and the step's compiled HLO text."""
    config = base_config("tiny", "offload")
    config.model.dtype, config.model.dropout_rate = "float32", 0.0
    config.optimizer.offload_state, config.train.offload_params = offload_state, offload_params
    placement = sharding.placement(config)
    compiled = placement.step().lower(*placement.abstract_inputs()).compile()
    state, metrics = placement.init_state(), placement.init_metrics()
    tokens = train.make_batch(jax.random.PRNGKey(3), config.data.batch_size, config.data.seq_len, 128)
    batch = placement.place_batch(tokens)
    for _ in range(2):
        state, metrics = compiled(state, metrics, batch)
    return state, compiled.as_text()


def _kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(tree)}


@pytest.mark.parametrize("offload_params", [False, True])
def test_the_offloaded_step_equals_the_device_step_and_keeps_its_state_on_the_host(offload_params):
    """This CPU offers pinned_host memory (jax.devices()[0].addressable_memories()): the offloaded state really lives
    there between steps, and two steps give bit for bit the device-resident step's parameters and moments."""
    assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
    device, _ = _two_steps()
    offloaded, text = _two_steps(offload_state=True, offload_params=offload_params)
    assert _kinds(device.opt_state) == _kinds(device.params) == {"device"}
    assert _kinds(offloaded.opt_state) == {"pinned_host"}
    assert _kinds(offloaded.params) == {"pinned_host" if offload_params else "device"}
    assert "S(5)" in text.splitlines()[0]  # the program's entry layout puts them in host memory
    for ours, theirs in zip(jax.tree_util.tree_leaves((offloaded.params, offloaded.opt_state)),
                            jax.tree_util.tree_leaves((device.params, device.opt_state)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize(
    "field, value, others, message",
    [
        ("optimizer.offload_state", True, {"train.checkpoint_every": 5}, "optimizer.offload_state: host offload is "
         "not supported with train.checkpoint_every > 0"),
        ("train.offload_params", True, {"train.eval_every": 2, "data.source": "text", "data.path": "/x"},
         "train.offload_params: not supported with train.eval_every > 0"),
    ],
)  # fmt: skip
def test_offload_fields_are_validated_in_one_line(field, value, others, message):
    config = base_config("tiny", "offload")
    for name, setting in {field: value, **others}.items():
        group, key = name.split(".")
        config[group][key] = setting
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)

"""jaxscale.train.offload: the step with its optimizer state (and parameters) in host memory equals the device step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import with_default_cpu_codegen

from jaxscale import train
from jaxscale.config import base_config, validate
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
def test_the_offloaded_step_equals_the_device_step_and_keeps_its_state_on_the_host(offload_params, request):
    """This CPU offers pinned_host memory (jax.devices()[0].addressable_memories()): the offloaded state really lives
    there between steps, and two steps give bit for bit the device-resident step's parameters and moments (with
    XLA's default CPU emitters, as a run compiles them: with the legacy ones the suite uses, the two programs fuse
    differently and 107 of 8,192 elements of a kernel differ by an ulp)."""
    if not with_default_cpu_codegen(request):
        return
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


def test_offloaded_state_validates_with_checkpoints_and_validation():
    """Host offload used to be refused with train.checkpoint_every > 0 and (offloaded parameters) train.eval_every > 0;
    both are built now (a SIGKILLed offloaded run resumes float for float: tests/test_run_text.py -k offloaded)."""
    config = base_config("tiny", "offload")
    config.optimizer.offload_state, config.train.offload_params = True, True
    config.train.checkpoint_every, config.train.eval_every = 5, 2
    config.data.source, config.data.path = "text", "/x"
    validate(config)

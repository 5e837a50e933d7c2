"""The logical-to-mesh table: the mesh axes of a name, and what a config's layout changes in it."""

from __future__ import annotations

from jaxscale.config import base_config, layout_rules


def test_mesh_axes_of_a_name():
    assert layout_rules.mesh_axes("embed") == ("fsdp", "context")
    assert layout_rules.mesh_axes("mlp") == ("tensor",)
    assert layout_rules.mesh_axes("head_dim") == () and layout_rules.mesh_axes("not_a_name") == ()


def test_zero_stage_and_sequence_parallelism_change_the_table():
    config = base_config(None, "x")
    config.mesh.update(fsdp=2, tensor=2, zero_stage=1, sequence_parallel=True)
    assert layout_rules.mesh_axes("embed", layout_rules.rules(config, params=True)) == ()
    assert layout_rules.mesh_axes("embed", layout_rules.rules(config)) == ("fsdp", "context")
    assert layout_rules.mesh_axes("stream_seq", layout_rules.rules(config)) == ("context", "tensor")


def test_expert_parallelism_splits_the_experts_and_the_batch():
    """The experts' axis over mesh.expert; activations' batch over data x fsdp x expert, and the dispatched tokens'
    (batch_no_expert) over data x fsdp only, the expert axis splitting their experts instead."""
    assert layout_rules.mesh_axes("expert") == ("expert",)
    assert layout_rules.mesh_axes("batch") == ("data", "fsdp", "expert")
    assert layout_rules.mesh_axes("batch_no_expert") == ("data", "fsdp")

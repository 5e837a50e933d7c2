"""The logical-to-mesh table: the mesh axes of a name, and what a config's layout changes in it."""

from __future__ import annotations

from jaxscale.config import base_config, layout_rules


def test_mesh_axes_of_a_name():
    assert layout_rules.mesh_axes("embed") == ("fsdp", "context", "expert") == layout_rules.STATE_AXES
    assert layout_rules.mesh_axes("mlp") == ("tensor",)
    assert layout_rules.mesh_axes("head_dim") == () and layout_rules.mesh_axes("not_a_name") == ()


def test_zero_stage_and_sequence_parallelism_change_the_table():
    config = base_config(None, "x")
    config.mesh.update(fsdp=2, tensor=2, zero_stage=1, sequence_parallel=True)
    assert layout_rules.mesh_axes("embed", layout_rules.rules(config, params=True)) == ()
    assert layout_rules.mesh_axes("embed", layout_rules.rules(config)) == ("fsdp", "context", "expert")
    assert layout_rules.mesh_axes("stream_seq", layout_rules.rules(config)) == ("context", "tensor", "stage")


def test_expert_parallelism_splits_the_experts_and_the_batch():
    """The experts' axis over mesh.expert; activations' batch over data x fsdp x expert, and the dispatched tokens'
    (batch_no_expert) over data x fsdp only, the expert axis splitting their experts instead."""
    assert layout_rules.mesh_axes("expert") == ("expert",)
    assert layout_rules.mesh_axes("batch") == ("data", "fsdp", "expert")
    assert layout_rules.mesh_axes("batch_no_expert") == ("data", "fsdp")


def test_the_expert_axis_splits_the_model_state_and_the_experts_their_expert_axis():
    """The name "embed" takes the state axes fsdp x context x expert in every parameter but those whose expert axis
    took the expert axis first (the stacked experts, the router: fsdp x context there, the fallback rule); in an
    activation the batch has taken fsdp and expert, so "embed" stays whole, and the dispatched tokens keep their
    layout. Below ZeRO stage 3 the parameters' table splits no "embed" (the experts' expert axis still splits).
    split_axes is Flax's resolution, the one the layout applies."""
    split = layout_rules.split_axes
    assert split(("embed", "heads", "head_dim")) == (("fsdp", "context", "expert"), ("tensor",), ())
    assert split(("vocab", "embed")) == (("tensor",), ("fsdp", "context", "expert"))
    assert split(("layers", "expert", "embed", "mlp")) == (("stage",), ("expert",), ("fsdp", "context"), ("tensor",))
    assert split(("expert", "mlp", "embed")) == (("expert",), ("tensor",), ("fsdp", "context"))
    assert split(("embed", "expert")) == (("fsdp", "context"), ("expert",))
    assert split(("batch", "stream_seq", "embed")) == (("data", "fsdp", "expert"), ("context", "stage"), ())
    assert split(("batch", "seq", "expert")) == (("data", "fsdp", "expert"), ("context", "stage"), ())
    assert split(("batch_no_expert", "expert", None, "embed")) == (("data", "fsdp"), ("expert",), (), ())
    assert split((None, "mlp")) == ((), ("tensor",))
    whole = layout_rules.table(1, False, params=True)
    assert whole == layout_rules.gathered_table(False)
    assert split(("embed", "mlp"), whole) == ((), ("tensor",))
    assert split(("expert", "embed", "mlp"), whole) == (("expert",), (), ("tensor",))

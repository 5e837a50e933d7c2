"""The remat policy table: what each policy keeps, by hand, per family."""

from __future__ import annotations

import pytest

from jaxscale.config import remat_policies

# By hand from each policy's source (MaxText's names, torchtitan's every-second matmul, JAX's dot policies).
KEPT = {
    ("nothing_saveable", "gpt"): set(),
    ("dots_saveable", "gpt"): {"q", "k", "v", "logits", "context", "out", "up", "down"},
    ("dots_with_no_batch_dims_saveable", "llama"): {"q", "k", "v", "out", "gate", "up", "down"},
    ("save_qkv_proj", "llama"): {"q", "k", "v"},
    ("save_out_proj", "gpt"): {"out"},
    ("save_dot_with_context_except_mlp", "gpt"): {"q", "k", "v", "context", "out"},
    ("minimal_flash", "gpt"): {"q", "k", "v", "context", "out", "up", "down"},  # gpt has no gate
    ("minimal_flash", "llama"): {"q", "k", "v", "context", "out", "gate", "up", "down"},
    ("selective_op", "gpt"): {"q", "k", "v", "up", "context"},  # qkv (1st), up (3rd)
    ("selective_op", "llama"): {"q", "v", "gate", "down", "context"},  # q, v, gate, down: 1st, 3rd, 5th, 7th
    ("qkv_proj_offloaded", "gpt"): set(),
}


@pytest.mark.parametrize("policy, family", KEPT)
def test_kept_tensors(policy, family):
    assert remat_policies.kept(policy, family) == KEPT[policy, family]


def test_offloaded_tensors_come_back_without_recompute_but_are_not_on_the_device():
    assert remat_policies.not_recomputed("qkv_proj_offloaded", "llama") == {"q", "k", "v"}
    assert remat_policies.kept("qkv_proj_offloaded", "llama") == set()


def test_only_jax_dot_policies_save_by_dot_type():
    by_type = {name for name in remat_policies.POLICIES if remat_policies.saves_by_dot_type(name)}
    assert by_type == {"dots_saveable", "dots_with_no_batch_dims_saveable"}

"""The typed views of a config: derived sizes against published model cards and hand counts of meshes."""

from __future__ import annotations

import pytest
from conftest import load_config

from jaxscale.config import ConfigError, MeshShape, ModelConfig, mesh_shape, minibatch_per_device, validate


def test_llama3_1_8b_sizes_are_the_published_ones():
    # meta-llama/Llama-3.1-8B config.json: hidden 4096, 32 attention heads, 8 key/value heads,
    # intermediate_size 14336; so head_dim 128 and K/V width 8 x 128 = 1024.
    sizes = ModelConfig.from_config(load_config("bf16_remat", "llama3.1-8b").model)
    assert (sizes.num_heads, sizes.kv_heads, sizes.kv_width, sizes.mlp_width) == (32, 8, 1024, 14336)


def test_gpt_sizes_without_grouped_query_attention():
    # :seed is the notebook's GPT: hidden 1024 in 8 heads of 128, MLP 4 x 1024, one K/V head per query head.
    sizes = ModelConfig.from_config(load_config("bf16_remat", "seed").model)
    assert (sizes.num_heads, sizes.kv_heads, sizes.kv_width, sizes.mlp_width) == (8, 8, 1024, 4096)


def test_mesh_shape_derives_devices_split_and_text():
    config = load_config("bf16_remat", "tiny")  # batch 8 in 2 minibatches
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 1
    mesh = mesh_shape(config)
    assert mesh == MeshShape(2, 2, 1) and tuple(mesh) == (2, 2, 1, 1, 1)  # (data, fsdp, tensor, context, expert)
    assert (mesh.devices, mesh.batch_split, mesh.text, mesh.axes_text) == (4, 4, "2x2x1", "data x fsdp x tensor")
    assert minibatch_per_device(config) == 8 // 2 // 4 == 1
    config.mesh.tensor = 2  # tensor-parallel devices share their sequences: the split stays data x fsdp
    assert (mesh_shape(config).devices, mesh_shape(config).batch_split, minibatch_per_device(config)) == (8, 4, 1)
    config.mesh.context = 4  # so do context-parallel ones; the text names the fourth size only when it splits
    mesh = mesh_shape(config)
    assert (mesh.devices, mesh.batch_split, mesh.text) == (32, 4, "2x2x2x4")
    assert mesh.axes_text == "data x fsdp x tensor x context"
    assert mesh.physical == (2, 2, 4, 1, 2)  # the device array's order: data, fsdp, context, expert, tensor (fastest)


def test_the_expert_axis_splits_the_batch_and_is_written_last():
    """mesh.expert: expert-parallel devices are data parallel outside the experts, so the batch splits over
    data x fsdp x expert; the text writes all five sizes once it splits, and its layout word is ep<n>."""
    from jaxscale.config.spec import layout_text, mesh_axes_text

    config = load_config("bf16_remat", "tiny-moe")  # batch 8 in 2 minibatches, 4 experts
    config.mesh.data, config.mesh.expert = 2, 2
    mesh = mesh_shape(config)
    assert (mesh.devices, mesh.batch_split, minibatch_per_device(config)) == (4, 4, 8 // 2 // 4)
    assert (mesh.text, mesh.axes_text) == ("2x1x1x1x2", "data x fsdp x tensor x context x expert")
    assert mesh_axes_text(mesh.text) == mesh.axes_text and layout_text(config) == "dp2 ep2"
    assert mesh.physical == (2, 1, 1, 2, 1)  # data, fsdp, context, expert, tensor
    config.mesh.expert = 1  # an expert axis of 1 leaves the text as it was
    assert (mesh_shape(config).text, mesh_shape(config).axes_text) == ("2x1x1", "data x fsdp x tensor")


def test_validation_reads_the_same_derived_sizes():
    config = load_config("bf16_remat", "tiny-llama")
    config.model.num_kv_heads = 3  # the tiny Llama has 4 query heads: 3 divides none of them
    with pytest.raises(
        ConfigError, match=r"^model.num_kv_heads: 3 does not divide the 4 query heads.*allowed: 1, 2, 4$"
    ):
        validate(config)

"""The typed views of a config: derived sizes against published model cards, hand counts of meshes, and the run's
one view (RunSpec) that the analytic models read."""

from __future__ import annotations

import pytest
from conftest import load_config

from jaxscale.config import ConfigError, MeshShape, ModelConfig, finetune, mesh_shape, minibatch_per_device, validate
from jaxscale.config.spec import RunSpec
from jaxscale.measure import memory, params


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
    assert mesh == MeshShape(2, 2, 1) and tuple(mesh) == (2, 2, 1, 1, 1, 1)  # data fsdp tensor context expert stage
    assert (mesh.devices, mesh.batch_split, mesh.text, mesh.axes_text) == (4, 4, "2x2x1", "data x fsdp x tensor")
    assert minibatch_per_device(config) == 8 // 2 // 4 == 1
    config.mesh.tensor = 2  # tensor-parallel devices share their sequences: the split stays data x fsdp
    assert (mesh_shape(config).devices, mesh_shape(config).batch_split, minibatch_per_device(config)) == (8, 4, 1)
    config.mesh.context = 4  # so do context-parallel ones; the text names the fourth size only when it splits
    mesh = mesh_shape(config)
    assert (mesh.devices, mesh.batch_split, mesh.text) == (32, 4, "2x2x2x4")
    assert mesh.axes_text == "data x fsdp x tensor x context"
    assert mesh.physical == (1, 2, 2, 4, 1, 2)  # the device array's order: stage, data, fsdp, context, expert, tensor


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
    assert mesh.physical == (1, 2, 1, 1, 2, 1)  # stage, data, fsdp, context, expert, tensor
    config.mesh.expert = 1  # an expert axis of 1 leaves the text as it was
    assert (mesh_shape(config).text, mesh_shape(config).axes_text) == ("2x1x1", "data x fsdp x tensor")


def test_the_stage_axis_multiplies_the_devices_not_the_batch_split_and_is_written_sixth():
    """mesh.stage (pipeline parallelism): the stages hold different layers of the same rows, so the batch splits as
    before; the text writes six sizes once it splits, the device array puts it outermost, and its layout word is
    pp<n> (pp<n>v<v> circular)."""
    from jaxscale.config.spec import layout_text, mesh_axes_text

    config = load_config("bf16_remat", "tiny-llama")
    config.mesh.data, config.mesh.tensor, config.mesh.stage = 2, 2, 4
    mesh = mesh_shape(config)
    assert (mesh.devices, mesh.batch_split, mesh.text) == (16, 2, "2x1x2x1x1x4")
    assert mesh_axes_text(mesh.text) == "data x fsdp x tensor x context x expert x stage" == mesh.axes_text
    assert mesh.physical == (4, 2, 1, 1, 1, 2) and layout_text(config) == "dp2 tp2 pp4"
    config.mesh.pipeline_repeats = 2
    assert layout_text(config) == "dp2 tp2 pp4v2"


def test_validation_reads_the_same_derived_sizes():
    config = load_config("bf16_remat", "tiny-llama")
    config.model.num_kv_heads = 3  # the tiny Llama has 4 query heads: 3 divides none of them
    with pytest.raises(
        ConfigError, match=r"^model.num_kv_heads: 3 does not divide the 4 query heads.*allowed: 1, 2, 4$"
    ):
        validate(config)


def _config(name: str, preset: str, **changes):
    config = load_config(name, preset)
    for field, value in changes.items():
        group, key = field.split("__")
        config[group][key] = value
    validate(config)
    return config


def test_the_run_view_of_a_mesh_zero_2_and_the_top_block_by_hand():
    # The tiny Llama (2 blocks, hidden 64 in 4 heads of 16, 2 K/V heads: K/V width 32, MLP 192, vocabulary 128),
    # batch 8 of 32 tokens in 2 minibatches, on data 2 x fsdp 2 x tensor 2 at ZeRO-2 with sequence parallelism,
    # accumulating on each device; the top block and the (untied) head train.
    config = _config("bf16", "tiny-llama", model__scan_layers=False, model__tie_embeddings=False, mesh__data=2,
                     mesh__fsdp=2, mesh__tensor=2, mesh__zero_stage=2, mesh__sequence_parallel=True,
                     mesh__reduce_gradients="step", finetune__train="last_blocks", finetune__last_blocks=1,
                     finetune__head=True, optimizer__state_dtype="bfloat16", optimizer__offload_state=True)  # fmt: skip
    run = RunSpec.from_config(config)
    assert run.model == ModelConfig.from_config(config.model) and run.mesh == MeshShape(2, 2, 2)
    assert (run.zero_stage, run.seq_len, run.batch_size, run.num_minibatches, run.accumulate) == (2, 32, 8, 2, "scan")
    assert run.minibatch_per_device == 8 // 2 // (2 * 2) == 1  # tensor-parallel devices share their sequences
    assert run.tokens_per_step == 8 * 32
    assert run.sequence_parallel and run.accumulates_locally and run.loss_chunk_len == 0
    assert (run.optimizer, run.state_dtype, run.offload_state, run.offload_params) == ("adam", "bfloat16", True, False)
    rules = run.finetune
    assert (rules.mode, rules.backward_blocks, rules.stored_dtype) == ("last_blocks", 1, "bfloat16")
    trained = {k for k in params.param_table(run.model) if rules.trainable(k)}
    top_block = {f"transformer/block_1/{k}" for k in params.layer_param_table(run.model)}
    assert trained == top_block | {"output/kernel", "post_norm/scale"}
    # ZeRO-2: the parameters whole on fsdp, the gradients and the optimizer state split 2 ways.
    assert memory.zero_splits(run) == {"params": 1, "grads": 2, "optimizer": 2}
    # What one device holds of the trained ones, tensor split 2 ways: the norms 2 x 64 whole, q and out 64 x 64 / 2,
    # k and v 64 x 32 / 2, gate, up and down 64 x 192 / 2; the head 64 x 128 / 2 and its norm 64.
    assert memory.trained_param_count(run) == 2 * 64 + 2 * 2048 + 2 * 1024 + 3 * 6144 + 4096 + 64 == 28864
    assert memory.analytic_memory(run) == memory.analytic_memory(config)  # the config read once, the same figures
    assert RunSpec.of(run) is run
    config.model.tie_embeddings = True  # a tied head trains the token embedding: the gradient reaches the bottom
    assert RunSpec.from_config(config).finetune.backward_blocks == 2


def test_the_run_view_of_qlora_under_fsdp_by_hand():
    # LoRA on the attention of the scanned tiny Llama, the base in NF4, ZeRO-3 over fsdp 2 ("auto" reduces every
    # minibatch there, so nothing accumulates on each device).
    config = _config("bf16_remat", "tiny-llama", mesh__fsdp=2, model__lora_rank=4, finetune__frozen_dtype="nf4")
    run = RunSpec.from_config(config)
    rules = run.finetune
    assert (rules.mode, rules.backward_blocks, rules.stored_dtype) == ("adapters", 2, "bfloat16")
    assert not run.accumulates_locally and not run.sequence_parallel and run.minibatch_per_device == 8 // 2 // 2
    assert memory.zero_splits(run) == {"params": 2, "grads": 2, "optimizer": 2}
    table = params.param_table(run.model)
    adapters = {f"transformer/blocks/attn/{p}/lora_{ab}" for p in ("q", "k", "v", "out") for ab in "ab"}
    assert {k for k in table if rules.trainable(k)} == adapters
    nf4 = {k for k in table if rules.nf4_kernel(k)}  # every projection's kernel, each layer quantized apart
    projections = ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/gate", "mlp/up", "mlp/down")
    assert nf4 == {f"transformer/blocks/{k}/kernel" for k in projections}
    assert {rules.nf4_stacked(k) for k in nf4} == {1}
    # The config-taking rules, which the train step asks, are the view's.
    for path in table:
        assert finetune.trainable(path, config) == rules.trainable(path)
        assert finetune.nf4_kernel(path, config) == rules.nf4_kernel(path)

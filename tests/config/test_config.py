"""Config files, presets and validation of every field."""

from __future__ import annotations

import jax
import pytest
from conftest import CONFIGS, load_config

from jaxscale.config import PRESETS, ConfigError, all_presets, base_config, validate

CONFIG_NAMES = sorted(p.stem for p in CONFIGS.glob("*.py"))


def test_every_reference_variant_has_a_config_file():
    for name in ("fp32", "bf16", "bf16_noscan", "bf16_remat", "bf16_remat_block", "bf16_remat_noaccum"):
        assert name in CONFIG_NAMES


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_files_validate_at_every_preset(name, preset):
    config = load_config(name, preset)
    validate(config)
    assert config.name == name and config.preset == preset and config.preset_source == "given"


def test_variants_differ_as_the_reference_table_says():
    assert load_config("fp32").model.dtype == "float32"
    assert load_config("bf16").model.scan_layers and not load_config("bf16_noscan").model.scan_layers
    assert load_config("bf16_remat").model.remat == ("MLP", "Attn")
    assert load_config("bf16_remat_block").model.remat == ("Block",)
    assert load_config("bf16_remat_noaccum").train.num_minibatches == 1


def test_no_preset_picks_by_backend():
    config = load_config("bf16_remat", preset=None)
    expected = "cpu" if jax.default_backend() == "cpu" else "seed"
    assert config.preset == expected and config.preset_source.startswith("auto")


def test_seed_preset_is_the_reference_scale():
    config = load_config("bf16_remat", "seed")
    assert (config.model.num_layers, config.model.hidden_size, config.model.head_dim) == (12, 1024, 128)
    assert (config.data.batch_size, config.data.seq_len, config.train.num_minibatches) == (64, 512, 4)


BAD = [
    ("model.hidden_size", 100, "not divisible by model.head_dim"),
    ("data.batch_size", 7, "not divisible by train.num_minibatches"),
    ("data.seq_len", 64, "exceeds model.max_seq_len"),
    ("model.dtype", "float8", "allowed: bfloat16, float32, float16"),
    ("model.softmax_dtype", "int8", "allowed"),
    ("model.remat", ("Everything",), "allowed: MLP, Attn, Block"),
    ("model.remat_policy", "magic", "allowed"),
    ("model.attention", "flash9", "allowed"),
    ("model.num_layers", 0, "positive integer"),
    ("model.vocab_size", -3, "positive integer"),
    ("train.steps", 0, "positive integer"),
    ("train.accumulate", "vmap", "allowed: scan, loop"),
    ("optimizer.name", "lion", "allowed: adam, adamw, sgd, adafactor"),
    ("model.dropout_rate", 1.5, "[0, 1)"),
    ("model.family", "mamba", "allowed: gpt, llama"),
    ("model.num_kv_heads", 2, "grouped-query attention needs model.family=llama"),
    ("model.num_kv_heads", -1, "integer >= 0"),
    ("model.mlp_hidden_size", -5, "integer >= 0"),
    ("model.rope_theta", 0.0, "must be > 0"),
    ("model.norm_epsilon", -1e-5, "must be > 0"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=[b[0] for b in BAD])
def test_validation_names_the_field(field, value, message):
    config = base_config("tiny", "bad")
    group, key = field.split(".")
    config[group][key] = value
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value).startswith(f"{field}:")
    assert message in str(error.value)


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="preset: unknown 'huge'; allowed: seed, cpu, tiny"):
        base_config("huge", "x")


def test_llama_fields_are_validated_against_the_heads():
    config = base_config("tiny-llama", "bad")
    config.model.num_kv_heads = 3  # 4 query heads
    with pytest.raises(ConfigError, match=r"model.num_kv_heads: 3 does not divide the 4 query heads.*allowed: 1, 2, 4"):
        validate(config)
    config.model.update(num_kv_heads=2, head_dim=15, hidden_size=60)
    with pytest.raises(ConfigError, match="model.head_dim: 15: rotary embeddings rotate pairs"):
        validate(config)


def test_unknown_preset_lists_the_named_models():
    with pytest.raises(ConfigError, match="llama3.1-8b"):
        base_config("llama9", "x")
    assert {"seed", "cpu", "tiny", "gpt2", "llama3.2-1b", "tiny-llama"} <= set(all_presets())


@pytest.mark.parametrize("stage,what", [(1, "the optimizer state"), (2, "the optimizer state and the gradients")])
def test_zero_stage_below_3_without_an_fsdp_axis_is_one_line(stage, what, tmp_path, capsys, monkeypatch):
    """ZeRO-1/2 split the state over mesh.fsdp (x mesh.context x mesh.expert); with all three 1 it would be plain data
    parallelism under another name: exit 2 from the command line, one line naming mesh.zero_stage and what is
    allowed."""
    from jaxscale import run

    monkeypatch.chdir(CONFIGS.parent)
    code = run.main(["jaxscale.run", "--config", "configs/bf16.py:tiny", f"--config.mesh.zero_stage={stage}",
                     "--plan", "--output_root", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not any(tmp_path.iterdir())
    assert err == (f"jaxscale: error: mesh.zero_stage: {stage} shards {what} over mesh.fsdp (x mesh.context x "
                   "mesh.expert), and mesh.fsdp=1 (context 1, expert 1) splits nothing: it would be plain data "
                   "parallelism; set mesh.fsdp > 1, or leave mesh.zero_stage at 3 (the default)")  # fmt: skip


@pytest.mark.parametrize("mesh", [dict(fsdp=2), dict(context=2), dict(fsdp=1, zero_stage=3)], ids=str)
def test_zero_stage_below_3_with_something_to_split_validates(mesh):
    """Stage 1 over fsdp=2, or over context=2 alone (the optimizer state splits over fsdp x context: jaxscale.train.
    sharding.RULES), and the default stage 3 on one device, are valid."""
    config = base_config("tiny", "zero")
    config.model.attention = "chunked"  # context parallelism runs attention as a ring of chunks
    config.mesh.update({"zero_stage": 1, **mesh})
    validate(config)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--config.mesh.reduce_gradients=sometimes"],
         "mesh.reduce_gradients: unknown 'sometimes'; allowed: auto, step, minibatch"),
        (["--config.mesh.fsdp=2", "--config.mesh.reduce_gradients=step"],
         "mesh.reduce_gradients: step accumulates a whole gradient on each device, which ZeRO-3 over mesh.fsdp=2 "
         "does not hold (its parameters are split); use minibatch or auto, or mesh.zero_stage 1 or 2"),
        (["--config.mesh.data=2", "--config.mesh.context=2", "--config.model.attention=chunked",
          "--config.mesh.reduce_gradients=step"],
         "mesh.reduce_gradients: step is not built for context parallelism (mesh.context=2: the ring attention's "
         "shard_map is not taken per group of rows); use minibatch or auto"),
    ],
)
def test_reduce_gradients_bad_values_are_one_line(overrides, message, tmp_path, capsys, monkeypatch):
    """mesh.reduce_gradients: an unknown value, or a once-a-step reduction where ZeRO-3 splits the parameters."""
    from jaxscale import run

    monkeypatch.chdir(CONFIGS.parent)
    code = run.main(["jaxscale.run", "--config", "configs/bf16.py:tiny", *overrides, "--plan", "--output_root",
                     str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"jaxscale: error: {message}" and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "mesh,minibatches,expected",
    [
        (dict(data=2), 2, True),  # data parallel: auto is once a step
        (dict(fsdp=2, zero_stage=1), 2, True),  # ZeRO-1: auto is once a step
        (dict(fsdp=2, zero_stage=2), 2, False),  # ZeRO-2: auto reduces every minibatch (DeepSpeed's stage 2)
        (dict(fsdp=2, zero_stage=2, reduce_gradients="step"), 2, True),
        (dict(fsdp=2), 2, False),  # ZeRO-3 (FSDP2's default)
        (dict(data=2, reduce_gradients="minibatch"), 2, False),
        (dict(data=2), 1, False),  # one minibatch: one reduction a step anyway
        (dict(fsdp=2, zero_stage=1, context=2), 2, False),  # the context ring is not taken per group
        (dict(), 2, False),  # one device: nothing to reduce
    ],
    ids=str,
)
def test_which_layouts_accumulate_locally(mesh, minibatches, expected):
    """config.accumulates_locally, written out per layout (docs/mesh.md's rule)."""
    from jaxscale.config import accumulates_locally

    config = base_config("tiny", "local")
    config.model.attention = "chunked"  # context parallelism runs attention as a ring of chunks
    config.mesh.update(mesh)
    config.train.num_minibatches = minibatches
    validate(config)
    assert accumulates_locally(config) is expected


@pytest.mark.parametrize(
    "preset,mesh,message",
    [
        ("tiny-llama", dict(data=2, expert=2), "mesh.expert: 2 splits a mixture of experts' experts, and "
         "model.num_experts=0 (a dense model); set model.num_experts > 0, or 1"),
        ("tiny-moe", dict(expert=3), "mesh.expert: 3 does not divide model.num_experts=4; allowed: 1, 2, 4"),
        ("tiny-moe", dict(data=2, expert=4), "mesh.expert: 4 does not divide the 2 sequences of a minibatch per "
         "data x fsdp group (data.batch_size / train.num_minibatches / (mesh.data x mesh.fsdp)); allowed: 1, 2"),
        ("tiny-moe", dict(expert=0), "mesh.expert: must be a positive integer, got 0"),
        ("tiny-moe", dict(data=2, expert=2, reduce_gradients="step"), "mesh.reduce_gradients: step is not built "
         "for expert parallelism (mesh.expert=2: a device's group of rows would need every expert); use minibatch "
         "or auto"),
    ],
    ids=str,
)  # fmt: skip
def test_bad_expert_meshes_are_one_line(preset, mesh, message):
    """mesh.expert splits the experts and the batch: it must divide both, and needs experts (tiny-moe: 4 experts,
    8 sequences in 2 minibatches)."""
    config = base_config(preset, "expert")
    config.mesh.update(mesh)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == message


def test_the_expert_axis_shards_the_model_state_so_it_divides_the_hidden_size_and_zero_1_may_use_it_alone():
    """The expert-parallel devices split every parameter's embed axis with fsdp x context (jaxscale.config.layout_rules
    STATE_AXES): fsdp x context x expert must divide model.hidden_size, and ZeRO-1 over expert alone splits the
    optimizer state (valid, not plain data parallelism)."""
    config = base_config("tiny-moe", "expert")
    config.model.hidden_size, config.data.batch_size = 96, 128  # 6 heads of 16; 64 sequences a minibatch
    config.mesh.update(fsdp=16, expert=4)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == (
        "mesh.fsdp: 16 x mesh.context=1 x mesh.expert=4 does not divide model.hidden_size=96 (the model state is "
        "split along its embed axis over the three); fsdp x context x expert may be: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, "
        "48, 96"
    )
    config.mesh.update(fsdp=8)
    validate(config)
    config = base_config("tiny-moe", "expert")
    config.mesh.update(data=2, expert=2, zero_stage=1)
    validate(config)


@pytest.mark.parametrize("mesh", [dict(expert=4), dict(data=2, expert=2), dict(fsdp=2, zero_stage=1, expert=2)])
def test_expert_parallelism_reduces_every_minibatch(mesh):
    """Under mesh.expert > 1 the auto reduction is every minibatch's (a device's group of rows would need every
    expert), where the same layout without it accumulates once a step (data parallel, ZeRO-1)."""
    from jaxscale.config import accumulates_locally

    config = base_config("tiny-moe", "expert")
    config.mesh.update(mesh)
    validate(config)
    assert not accumulates_locally(config)
    config.mesh.data, config.mesh.expert = config.mesh.data * config.mesh.expert, 1
    validate(config)
    assert accumulates_locally(config) is True


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(stage=2), "model.scan_layers: mesh.stage=2 pipelines nn.scan's stacked layers, so they must be one "
         "stack: set it True (or mesh.stage=1)"),
        (dict(stage=4, scan=True), "model.num_layers: 2 does not split into mesh.stage x mesh.pipeline_repeats = 4 "
         "equal groups of layers; stage x repeats may be: 1, 2"),
        (dict(stage=2, scan=True, layers=4, pipeline_repeats=2, pipeline_microbatches=1), "mesh.pipeline_microbatches: "
         "1: the circular schedule (mesh.pipeline_repeats=2) needs at least mesh.stage=2 microbatches (a microbatch's "
         "next visit of stage 0 waits for its last stage); allowed: >= 2"),
        (dict(stage=2, scan=True, data=2, pipeline_microbatches=3), "mesh.pipeline_microbatches: 3 microbatches of "
         "the minibatch's 4 sequences, each split over data x fsdp x expert = 2 devices: 3 x 2 must divide 4; "
         "microbatches may be: 1, 2"),
        (dict(stage=2, scan=True, dropout=0.1), "model.dropout_rate: 0.1: mesh.stage=2 pipelines nn.scan's stacked "
         "layers, so its layers run without dropout keys (not built); allowed: 0"),
        (dict(stage=0), "mesh.stage: must be a positive integer, got 0"),
        (dict(pipeline_repeats=0), "mesh.pipeline_repeats: must be an integer >= 1 (1: GPipe), got 0"),
    ],
    ids=str,
)  # fmt: skip
def test_bad_pipelines_are_one_line(changes, message):
    """mesh.stage splits nn.scan's stack into equal stages (x repeats), its microbatches split each device's rows
    (tiny-llama: 2 layers, 16 sequences in 4 minibatches), and what the pipeline does not carry is refused."""
    config = base_config("tiny-llama", "pipeline")
    config.model.dropout_rate = changes.pop("dropout", 0.0)
    config.model.scan_layers = changes.pop("scan", False)
    config.model.num_layers = changes.pop("layers", config.model.num_layers)
    config.mesh.update(changes)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == message

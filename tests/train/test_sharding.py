"""jaxscale.train.sharding: the rules table gives each layout, the per-device state matches the memory model, bad
meshes are one-line errors, and (in a process with 8 simulated CPU devices) every mesh computes what one device does.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest
from conftest import xla_flags_with
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from jaxscale import train
from jaxscale.config import ConfigError, base_config, check_mesh_devices, validate
from jaxscale.measure import memory
from jaxscale.train import sharding

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _config(mesh=(1, 1, 1), scan_layers=True, preset="tiny", **groups):
    config = base_config(preset, "sharding")
    config.model.scan_layers = scan_layers
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    for dotted, value in groups.items():
        group, field = dotted.split("__")
        config[group][field] = value
    return config


def _layout(config):
    """The layout on an abstract mesh of the config's shape: no devices needed."""
    shape = sharding.mesh_shape(config).physical
    mesh = AbstractMesh(shape, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
    init_fn = train.make_init_fn(config)
    return sharding.make_layout(config, mesh, init_fn), init_fn


def _exact(numerator: int, divisor: int) -> int:
    assert numerator % divisor == 0, (numerator, divisor)
    return numerator // divisor


def hand_count_per_device(model, fsdp: int, tensor: int) -> int:
    """Parameters one device holds, counted by hand from the model's modules and the rules of docs/mesh.md:
    a parameter is divided by fsdp if it has an embed axis and by tensor if it has a vocab, heads, kv_heads or
    mlp axis. Written out per parameter, independently of jaxscale.measure.params' table."""
    h, v, layers, f, t = model.hidden_size, model.vocab_size, model.num_layers, fsdp, tensor
    mlp = model.mlp_hidden_size or model.mlp_expansion * h
    heads = h // model.head_dim
    kv = (model.num_kv_heads or heads) * model.head_dim
    both, embed, split = f * t, f, t
    if model.family == "gpt":
        layer = (
            _exact(4 * h, embed)  # two LayerNorms' scale and bias (embed,)
            + _exact(h * 3 * h, both) + _exact(3 * h, split)  # qkv kernel (embed, heads, qkv), bias (heads, qkv)
            + _exact(h * h, both) + _exact(h, embed)  # out kernel (heads, head_dim, embed), bias (embed,)
            + _exact(h * mlp, both) + _exact(mlp, split)  # up kernel (embed, mlp), bias (mlp,)
            + _exact(mlp * h, both) + _exact(h, embed)  # down kernel (mlp, embed), bias (embed,)
        )  # fmt: skip
        top = _exact(v * h, both) + _exact(model.max_seq_len * h, embed) + _exact(2 * h, embed)  # embed, pos, norm
        head = _exact(h * v, both) + _exact(v, split)  # output kernel (embed, vocab), bias (vocab,)
    else:
        layer = (
            _exact(2 * h, embed)  # two RMSNorm scales (embed,)
            + _exact(h * h, both) + _exact(2 * h * kv, both)  # q (embed, heads, head_dim), k and v (.., kv_heads, ..)
            + _exact(h * h, both)  # out (heads, head_dim, embed)
            + _exact(3 * h * mlp, both)  # gate, up (embed, mlp), down (mlp, embed)
        )  # fmt: skip
        top = _exact(v * h, both) + _exact(h, embed)  # token embedding (vocab, embed), final RMSNorm (embed,)
        head = _exact(h * v, both)  # output kernel (embed, vocab), no bias
    return layers * layer + top + (0 if model.tie_embeddings else head)


def _spec(layout, *path):
    node = layout.state.params
    for key in path:
        node = node[key]
    return node.spec


FS = ("fsdp", "context", "expert")  # the model state's split: context- and expert-parallel devices shard it too


def test_one_table_gives_data_parallel_fsdp_and_tensor_parallel_layouts():
    layout, _ = _layout(_config((2, 2, 2)))
    blocks = ("transformer", "blocks")
    assert _spec(layout, *blocks, "attn", "qkv", "kernel") == PartitionSpec("stage", FS, "tensor", None)
    assert _spec(layout, *blocks, "attn", "out", "kernel") == PartitionSpec("stage", "tensor", None, FS)
    assert _spec(layout, *blocks, "mlp", "up", "kernel") == PartitionSpec("stage", FS, "tensor")
    assert _spec(layout, *blocks, "mlp", "down", "kernel") == PartitionSpec("stage", "tensor", FS)
    assert _spec(layout, *blocks, "mlp", "up", "bias") == PartitionSpec("stage", "tensor")
    assert _spec(layout, *blocks, "attn", "pre_norm", "scale") == PartitionSpec("stage", FS)
    assert _spec(layout, "embed", "embedding") == PartitionSpec("tensor", FS)
    assert _spec(layout, "output", "kernel") == PartitionSpec(FS, "tensor")
    assert _spec(layout, "pos_emb") == PartitionSpec(None, FS)  # "pos" is never split
    # Optimizer moments follow their parameters (ZeRO-3); the batch splits over data x fsdp.
    mu = layout.state.opt_state[0].mu["transformer"]["blocks"]["mlp"]["up"]["kernel"]
    assert mu.spec == PartitionSpec("stage", FS, "tensor")
    # rows over data x fsdp x expert (the expert axis, 1 here, splits the batch too); positions: context parallel, and
    # split over a pipeline's stages (1 here) outside its loop
    assert layout.batch.inputs.spec == PartitionSpec(("data", "fsdp", "expert"), ("context", "stage"))
    assert layout.state.step.spec == PartitionSpec()


def test_the_same_table_splits_the_llamas_parameters():
    """Llama: q by heads, grouped k and v by K/V heads, SwiGLU's gate and up by width, every embed axis by
    the state axes (fsdp x context x expert), the tied embedding by vocabulary; the stacked layer axis only over a
    pipeline's stages (1 here)."""
    layout, _ = _layout(_config((2, 2, 2), preset="tiny-llama"))
    blocks = ("transformer", "blocks")
    assert _spec(layout, *blocks, "attn", "q", "kernel") == PartitionSpec("stage", FS, "tensor", None)
    for name in ("k", "v"):
        assert _spec(layout, *blocks, "attn", name, "kernel") == PartitionSpec("stage", FS, "tensor", None)
    assert _spec(layout, *blocks, "attn", "out", "kernel") == PartitionSpec("stage", "tensor", None, FS)
    for name in ("gate", "up"):
        assert _spec(layout, *blocks, "mlp", name, "kernel") == PartitionSpec("stage", FS, "tensor")
    assert _spec(layout, *blocks, "mlp", "down", "kernel") == PartitionSpec("stage", "tensor", FS)
    assert _spec(layout, *blocks, "mlp", "pre_norm", "scale") == PartitionSpec("stage", FS)
    assert _spec(layout, "embed", "embedding") == PartitionSpec("tensor", FS)
    assert _spec(layout, "post_norm", "scale") == PartitionSpec(FS)
    assert "output" not in layout.state.params  # tied
    nu = layout.state.opt_state[0].nu["transformer"]["blocks"]["attn"]["k"]["kernel"]
    assert nu.spec == PartitionSpec("stage", FS, "tensor", None)


MESHES = {
    "tiny": [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4), (1, 1, 4)],
    "tiny-llama": [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2), (1, 1, 2)],  # tensor | 2 K/V heads
}


@pytest.mark.parametrize("preset,mesh", [(p, m) for p, meshes in MESHES.items() for m in meshes])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_analytic_state_per_device_equals_the_real_shardings(preset, mesh, scan_layers):
    """memory.sharded_param_count (the analytic model) and a hand count against the shard shapes of the step's
    real layout, for both families."""
    config = _config(mesh, scan_layers, preset=preset)
    layout, init_fn = _layout(config)
    state = sharding.abstract_inputs(config, layout, init_fn)[0]
    per_device = sharding.state_bytes_per_device(state)
    _, fsdp, tensor = mesh
    params = 4 * memory.sharded_param_count(config.model, fsdp, tensor)
    assert params == 4 * hand_count_per_device(config.model, fsdp, tensor)
    assert per_device["params"] == params
    assert 0 <= per_device["optimizer"] - 2 * params <= 16  # Adam's two moments, plus its step counters
    row = memory.analytic_memory(config)
    assert row["analytic_params_bytes"] == params and row["analytic_optimizer_bytes"] == 2 * params


@pytest.mark.parametrize("target", ["a5000", "h100"])
def test_the_committed_gpu_mesh_plans_agree_with_the_estimate_as_documented(target):
    """The deviceless 8-GPU plans of experiments/mesh.py:seed are within 12% of the per-device analytic estimate
    (7% before the float32 gradient sums; docs/mesh.md's tables of them are tests/report/test_docs_tables.py's)."""
    import json

    path = REPO / "experiments" / "results" / f"mesh_seed_plan_{target}_x8" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == 6 and {row["compiled_backend"] for row in rows} == {f"cuda:{target}"}
    for row in rows:
        assert abs(row["compiled_to_analytic_peak_ratio"] - 1) <= 0.12, row["variant"]


def test_analytic_activations_split_by_batch_and_tensor():
    def analytic(mesh):  # unrolled float32 layers: every activation term is proportional to the batch
        return memory.analytic_memory(_config(mesh, False, data__batch_size=16, model__dtype="float32"))

    one, data, tensor, fsdp = analytic((1, 1, 1)), analytic((8, 1, 1)), analytic((1, 1, 4)), analytic((1, 8, 1))
    assert data["analytic_params_bytes"] == one["analytic_params_bytes"]  # data parallel replicates the state
    assert data["analytic_activation_per_layer_bytes"] * 8 == one["analytic_activation_per_layer_bytes"]
    assert fsdp["analytic_activation_per_layer_bytes"] == data["analytic_activation_per_layer_bytes"]
    assert fsdp["analytic_fsdp_gather_bytes"] > 0 == data["analytic_fsdp_gather_bytes"]
    # Tensor parallelism splits only what lies between a block's two matmuls (Korthikanti et al. Sec. 4.2.2).
    ratio = tensor["analytic_activation_per_layer_bytes"] / one["analytic_activation_per_layer_bytes"]
    assert 0.25 < ratio < 0.7


def test_sequence_parallelism_splits_korthikantis_replicated_10sbh_by_t():
    """Korthikanti et al. 2022, Sec. 4.2.2: with tensor parallelism alone 10sbh bytes per layer stay replicated
    (16-bit activations, 1-byte dropout masks: the two LayerNorms' inputs 4sbh and outputs 4sbh, the two dropout
    masks 2sbh), and sequence parallelism splits them t ways too, all of a layer's activations then being sbh(34/t +
    5as/(ht)). Hand count for the unrolled GPT without remat, autodiff's residuals (plus the LayerNorms' float32
    mean and rstd, 2 x 2 x 4sb, which the paper leaves out): the difference between the two layouts is (10sbh +
    16sb)(1 - 1/t), and the layer under sequence parallelism is the one-device layer divided by t whatever the
    kernel."""
    t = 4

    def per_layer(mesh, sp, attention="reference"):
        config = _config(mesh, False, data__batch_size=16, model__dtype="bfloat16", model__dropout_rate=0.1,
                         model__attention=attention, mesh__sequence_parallel=sp,
                         model__residuals="autodiff")  # fmt: skip  # Korthikanti's accounting: what autodiff keeps
        return memory.analytic_memory(config)["analytic_activation_per_layer_bytes"], config

    plain, config = per_layer((1, 1, t), False)
    split, _ = per_layer((1, 1, t), True)
    s, b, h = config.data.seq_len, config.data.batch_size // config.train.num_minibatches, config.model.hidden_size
    assert plain - split == (10 * s * b * h + 16 * s * b) * (t - 1) // t
    for attention in ("reference", "chunked"):
        assert per_layer((1, 1, t), True, attention)[0] * t == per_layer((1, 1, 1), False, attention)[0]


@pytest.mark.parametrize(
    "mesh,changes,field,hint",
    [
        ((8, 1, 1), {"data__batch_size": 8}, "mesh:", "may be: 1, 2, 4"),  # minibatch of 4 sequences
        ((1, 3, 1), {"data__batch_size": 24}, "mesh.fsdp:", "may be: 1, 2, 4, 8, 16, 32, 64"),  # hidden 64
        ((1, 1, 8), {}, "mesh.tensor:", "1, 2, 4"),  # 4 heads
        ((1, 1, 2), {"model__vocab_size": 127}, "mesh.tensor:", "model.vocab_size"),
        ((0, 1, 1), {}, "mesh.data:", "positive integer"),
        ((1, 2, 1), {"mesh__zero_stage": 0}, "mesh.zero_stage:", "allowed: 1, 2, 3"),
        ((2, 1, 1), {"mesh__sequence_parallel": True}, "mesh.sequence_parallel:", "set mesh.tensor > 1"),
        (
            (1, 1, 2),
            {"mesh__sequence_parallel": True, "data__seq_len": 31, "model__max_seq_len": 32},
            "data.seq_len:",
            "not divisible by the 2 devices",
        ),  # fmt: skip
        ((1, 1, 1), {"mesh__context": 2}, "model.attention:", "set model.attention=chunked or flash"),
        ((1, 1, 1), {"mesh__context": 3, "model__attention": "chunked"}, "mesh.context:", "allowed: 1, 2, 4, 8, 16"),
        (
            (1, 1, 1),
            {"mesh__context": 2, "model__attention": "chunked", "model__attention_block_k": 16},
            "model.attention_block_k:",
            "chunk of 8 positions",
        ),  # fmt: skip
    ],
)
def test_bad_meshes_name_the_field_and_what_would_work(mesh, changes, field, hint):
    with pytest.raises(ConfigError) as error:
        validate(_config(mesh, **changes))
    assert str(error.value).startswith(field) and hint in str(error.value)


def test_mesh_must_use_every_device_except_the_single_device_default():
    check_mesh_devices(_config((1, 1, 1)), 8)  # 1x1x1 runs on one device wherever it is
    check_mesh_devices(_config((2, 2, 2)), 8)
    with pytest.raises(ConfigError, match=r"^mesh: .*2x2x1 = 4 devices, but the run has 8.*mesh.data=8"):
        check_mesh_devices(_config((2, 2, 1)), 8, "the run")


def test_single_device_placement_is_the_unsharded_step():
    config = _config((1, 1, 1))
    placement = sharding.placement(config)
    assert placement.layout is None
    compiled = placement.step().lower(*placement.abstract_inputs()).compile()
    assert "all-reduce" not in compiled.as_text() and len(jax.tree_util.tree_leaves(placement.init_state())) > 0


# The 8-device processes compile with XLA's CPU fusion emitters off (its older loop emitters instead): each of their
# compiles is ~3x faster (the tiny GPT, Llama and MoE steps on one device: 10.0 s -> 3.1 s of CPU), and the fast
# device tests took 159 s of CPU instead of 285 s (-n 0, measured back to back on this loaded 2-core machine). Sound
# for that file: every check there is a mesh's numbers against one device's, both compiled in the same process with
# the same flags; the shards' shapes and bytes; the all-to-alls XLA's partitioner inserts (before the CPU backend's
# fusion); and bounds on the sharded init's memory, all of which hold with either emitter (they pass both ways). The
# emitters change the CPU backend's fusion and so its temp buffers (the tiny GPT step: 2,857,704 -> 2,840,104 bytes),
# so the rest of the suite, whose CPU memory plans are checked, keeps XLA's default.
LEGACY_CPU_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _device_tests_command(*pytest_args: str) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of a pytest process over tests/train/test_sharding_devices.py with 8 simulated CPU
    devices."""
    flags = f"--xla_force_host_platform_device_count=8 {LEGACY_CPU_EMITTERS}"
    env = dict(os.environ, XLA_FLAGS=xla_flags_with(flags), JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_sharding_devices.py")]
    return [*command, *pytest_args], env


def _run_device_tests(*pytest_args: str) -> subprocess.CompletedProcess:
    command, env = _device_tests_command(*pytest_args)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


# The fast device tests run in two processes at once, each -n 0 (its tests share _one_device's references and start
# JAX once): these, and the rest. The first half holds the Llama whole-step tests, which share their one-device
# reference (LLAMA_STEP there).
_FIRST_HALF = "2x2x2_mesh or zero_stages or context_parallel or share_of_params or fsdp_init or place_batch"
_HALVES = {"first_half": _FIRST_HALF, "second_half": f"not ({_FIRST_HALF})"}


def test_meshes_equal_one_device_on_8_simulated_cpu_devices():
    """Runs tests/train/test_sharding_devices.py in processes with 8 simulated CPU devices (XLA reads the flag when
    its CPU backend starts, so it cannot be set in this process): its two halves side by side, in two processes
    started together, each -n 0.

    Why one test starting both, not a test per half: xdist's load scheduling gave both halves (57 s and 40 s under
    the suite's load) to the same worker, one after the other, at the end of the collection, while the other worker
    sat idle for the last minute. Started together, the two processes use both cores whichever worker runs this
    test, and tests/conftest.py runs it first (LONGEST_FIRST), so the suite's other tests fill the cores around it
    instead of waiting behind it."""
    started = {}
    for name, selection in _HALVES.items():
        command, env = _device_tests_command("-n", "0", "-m", "not slow", "-k", selection)
        started[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)  # fmt: skip
    finished = {}
    try:
        for name, process in started.items():
            finished[name] = (*process.communicate(timeout=900), process.returncode)
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()  # only the processes this test started
    for name, (stdout, stderr, returncode) in finished.items():
        assert returncode == 0, (name, stdout[-4000:] + stderr[-2000:])
        assert " passed" in stdout and "skipped" not in stdout, (name, stdout[-2000:])


@pytest.mark.slow
def test_slow_mesh_variants_equal_one_device():
    done = _run_device_tests("-m", "slow")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]

"""Orbax checkpoints: the train state comes back leaf for leaf with the data position, the newest are kept, a
resume reads the meta first and refuses a run whose config or data would change the loss curve or the data
position's meaning (before any array is read), and the arrays are read straight into the abstract state's
shardings (no state initialised first)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import load_config, text_config, write_counting_tokens, xla_flags_with
from flax import traverse_util

from jaxscale import train
from jaxscale.config import base_config, validate
from jaxscale.train import checkpoint, sharding
from jaxscale.train.checkpoint import CheckpointError, CheckpointMismatch, Checkpoints, check_resume

REPO = pathlib.Path(__file__).resolve().parents[2]


_STATES = {}


def _state(config):
    """The initial state of `config`'s model (compiled once per model: an init compile takes seconds here)."""
    key = repr(sorted(config.model.items()))
    if key not in _STATES:
        _STATES[key] = jax.jit(train.make_init_fn(config))()
    return _STATES[key]


def _abstract(config):
    return jax.eval_shape(train.make_init_fn(config))


def _save(directory, config, steps=(1,), data_state=None, state=None):
    """Checkpoints of `state` (default: config's initial state) at `steps`; returns the state."""
    saver = Checkpoints(directory, config)
    state = _state(config) if state is None else state
    for step in steps:
        saver.save(step, state, data_state or {})
    saver.close()
    return state


def tree_digest(directory: pathlib.Path) -> dict[str, str]:
    """Every file under `directory` -> sha256 of its bytes (with its modification time)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() + f"@{p.stat().st_mtime_ns}"
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


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
    target = _abstract(config)  # shapes only: nothing is initialised to be overwritten
    step, restored, position = loader.restore(target)
    loader.close()
    assert step == 6 and position == {"grain": {"next_index": 6}}
    assert type(restored) is type(state) and restored.apply_fn == target.apply_fn and restored.tx is target.tx
    for want, got in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored), strict=True):
        assert isinstance(got, jax.Array) and got.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_arrays_are_read_into_the_shardings_of_the_abstract_state(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every = 1
    state = _save(tmp_path / "checkpoints", config)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=named), _abstract(config))
    loader = Checkpoints(tmp_path / "checkpoints", config)
    _, restored, _ = loader.restore(target)
    loader.close()
    assert all(leaf.sharding == named for leaf in jax.tree_util.tree_leaves(restored))
    for want, got in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_checkpoint_of_another_config_is_refused(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every = 1
    _save(tmp_path / "checkpoints", config)
    other = load_config("bf16", "tiny")
    other.train.checkpoint_every, other.optimizer.learning_rate = 1, 0.5
    loader = Checkpoints(tmp_path / "checkpoints", other)
    with pytest.raises(CheckpointMismatch, match="optimizer.learning_rate: .* was written with "
                                                 "optimizer.learning_rate=0.001, this run has 0.5"):  # fmt: skip
        loader.restore(_abstract(other))
    loader.close()


def test_another_shape_is_refused_by_the_meta_before_any_array_is_read(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every = 1
    _save(tmp_path / "checkpoints", config, steps=(1, 2))
    before = tree_digest(tmp_path / "checkpoints")
    wider = load_config("bf16", "tiny")
    wider.train.checkpoint_every, wider.model.hidden_size = 1, 128  # every kernel's shape differs
    assert check_resume(tmp_path / "checkpoints", config) == 2
    with pytest.raises(CheckpointMismatch, match=r"^model.hidden_size: .*/checkpoints/2 was written with "
                                                 r"model.hidden_size=64, this run has 128; resume with"):  # fmt: skip
        check_resume(tmp_path / "checkpoints", wider)
    loader = Checkpoints(tmp_path / "checkpoints", wider)
    with pytest.raises(CheckpointMismatch, match="^model.hidden_size: "):  # not orbax's shape error
        loader.restore(_abstract(wider))
    loader.close()
    assert tree_digest(tmp_path / "checkpoints") == before  # the checkpoints are untouched
    assert check_resume(tmp_path / "nothing", wider) is None and not (tmp_path / "nothing").exists()


def test_a_text_checkpoint_names_its_data_and_worker_count(tmp_path):
    data = write_counting_tokens(tmp_path / "data", train=2000, validation=200)
    config = text_config("bf16", "tiny", data, checkpoint_every=1)
    _save(tmp_path / "checkpoints", config, data_state={"grain": {"next_index": 1}}, state={"x": np.zeros(2)})
    assert check_resume(tmp_path / "checkpoints", config) == 1
    workers = text_config("bf16", "tiny", data, checkpoint_every=1)
    workers.data.workers = 2  # grain's state would hold one position per worker
    with pytest.raises(CheckpointMismatch, match="^data.workers: .* was written with data.workers=0, this run has 2"):
        check_resume(tmp_path / "checkpoints", workers)
    prefetch = text_config("bf16", "tiny", data, checkpoint_every=1)
    prefetch.data.prefetch, prefetch.data.host_delay_s = 0, 0.5  # neither enters the position
    assert check_resume(tmp_path / "checkpoints", prefetch) == 1
    moved = data.rename(tmp_path / "moved")  # the same token files elsewhere resume
    assert check_resume(tmp_path / "checkpoints", text_config("bf16", "tiny", moved, checkpoint_every=1)) == 1
    write_counting_tokens(data, train=2001, validation=200)  # other data where the first was
    other = f"^data.path: {data} holds other token files than .* was trained on \\(manifest digest [0-9a-f]{{12}}, the"
    with pytest.raises(CheckpointMismatch, match=other):
        check_resume(tmp_path / "checkpoints", config)


def test_a_synthetic_run_ignores_the_data_pipeline_fields(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every = 1
    _save(tmp_path / "checkpoints", config, state={"x": np.zeros(2)})
    config.data.workers, config.data.path = 4, "anywhere"  # not read by the synthetic source
    assert check_resume(tmp_path / "checkpoints", config) == 1


def test_an_unreadable_or_older_checkpoint_is_one_error(tmp_path):
    config = load_config("bf16", "tiny")
    config.train.checkpoint_every = 1
    saver = Checkpoints(tmp_path / "old", config)
    saver._fields = {k: v for k, v in saver._fields.items() if k != "train.seed"}  # as written by an older version
    saver.save(1, {"x": np.zeros(2)}, {})
    saver.close()
    with pytest.raises(CheckpointMismatch, match=r"^train.seed: .*/old/1 does not record it"):
        check_resume(tmp_path / "old", config)
    (tmp_path / "foreign" / "3" / "other").mkdir(parents=True)
    (tmp_path / "foreign" / "3" / "other" / "x").write_text("{}")
    with pytest.raises(CheckpointError, match=r"^--name: .*/foreign/3 is not a readable jaxscale checkpoint"):
        check_resume(tmp_path / "foreign", config)


def _fsdp_config():
    config = base_config("tiny", "mesh")
    config.model.dtype = "float32"
    config.mesh.fsdp, config.train.checkpoint_every = 2, 1
    validate(config)
    return config


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (run by the test below in its own process)")
def test_fsdp_restore_reads_each_shard_where_it_lives(tmp_path):
    config = _fsdp_config()
    placement = sharding.placement(config)
    state = _save(tmp_path / "checkpoints", config, state=placement.init_state())
    abstract = placement.abstract_inputs()[0]
    loader = Checkpoints(tmp_path / "checkpoints", config)
    _, restored, _ = loader.restore(abstract)
    loader.close()
    split = 0
    for want, got, shape in zip(*(jax.tree_util.tree_leaves(t) for t in (state, restored, abstract)), strict=True):
        assert got.sharding == shape.sharding and got.sharding.is_equivalent_to(want.sharding, want.ndim)
        assert [s.data.shape for s in got.addressable_shards] == [s.data.shape for s in want.addressable_shards]
        split += got.addressable_shards[0].data.size * 2 == got.size
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert split > 0  # the embed-split kernels and their Adam moments came back as halves


@pytest.mark.slow  # 35 s on the shared 2 cores; test_the_arrays_are_read_into_the_shardings... is the fast one
def test_fsdp_restore_on_2_simulated_cpu_devices():
    """Runs the test above in a process with 2 simulated CPU devices (XLA reads the flag at backend start)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=2"), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::"
               "test_fsdp_restore_reads_each_shard_where_it_lives"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def _finetune_config(**fields):
    config = base_config("tiny-llama", "lora")
    config.model.update(lora_rank=4, lora_targets=("all",))
    config.finetune.update(train="adapters", **fields)
    validate(config)
    return config


def test_init_from_reads_another_runs_parameters_and_starts_its_adapters_fresh(tmp_path):
    """finetune.init_from: the base run's parameters (the optimizer state and step of that checkpoint are not
    read) become this run's frozen weights in bfloat16, the adapters keep their init, and B = 0 keeps the loaded
    model's function."""
    base = base_config("tiny-llama", "base")
    trained = jax.tree_util.tree_map(lambda x: x + 0.5, _state(base))  # not the init this run would draw
    _save(tmp_path / "base" / "checkpoints", base, steps=(2,), state=trained)
    config = _finetune_config(init_from=str(tmp_path / "base"))
    state = checkpoint.with_base_params(jax.jit(train.make_init_fn(config))(), config)
    flat = traverse_util.flatten_dict(state.frozen, sep="/")
    expected = traverse_util.flatten_dict(trained.params, sep="/")
    assert set(flat) == set(expected)
    for path, value in flat.items():
        assert value.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[path].astype(jax.numpy.bfloat16)))
    lora_b = [v for k, v in traverse_util.flatten_dict(state.params, sep="/").items() if k.endswith("lora_b")]
    assert lora_b and all(not np.any(np.asarray(b)) for b in lora_b)


def test_init_from_quantizes_the_loaded_kernels_to_nf4(tmp_path):
    """finetune.frozen_dtype=nf4 (QLoRA): the loaded projection kernels become the NF4 codes of the loaded values
    (jaxscale.model.nf4.quantize of them), the other loaded parameters bfloat16."""
    from jaxscale.model import nf4

    base = base_config("tiny-llama", "base")
    trained = jax.tree_util.tree_map(lambda x: x + 0.5, _state(base))
    _save(tmp_path / "base" / "checkpoints", base, steps=(2,), state=trained)
    config = _finetune_config(init_from=str(tmp_path / "base"), frozen_dtype="nf4")
    state = checkpoint.with_base_params(jax.jit(train.make_init_fn(config))(), config)
    flat = traverse_util.flatten_dict(state.frozen, sep="/")
    expected = traverse_util.flatten_dict(trained.params, sep="/")
    assert set(flat) == set(expected)
    kernels = [path for path, value in flat.items() if isinstance(value, nf4.Nf4Weight)]
    assert len(kernels) == 2 * 7  # q, k, v, out, gate, up, down in 2 blocks
    for path, value in flat.items():
        want = nf4.quantize(expected[path]) if path in kernels else expected[path].astype(jax.numpy.bfloat16)
        jax.tree_util.tree_map(np.testing.assert_array_equal, value, want)


@pytest.mark.parametrize(
    "setup, message",
    [
        ("missing", "finetune.init_from: {dir}/nowhere is not a directory"),
        ("empty", "finetune.init_from: {dir}/empty holds no checkpoint"),
        ("wider", "model.hidden_size: finetune.init_from: {dir}/wider/checkpoints/1 was written with 128, this run "
                  "has 64"),
        ("lora", "finetune.init_from: {dir}/lora/checkpoints/1 was itself a fine-tuning run"),
    ],
)  # fmt: skip
def test_init_from_a_missing_empty_or_foreign_run_is_one_line(tmp_path, setup, message):
    (tmp_path / "empty").mkdir()
    if setup == "wider":
        wider = base_config("tiny-llama", "wide")
        wider.model.update(hidden_size=128, head_dim=32)
        _save(tmp_path / "wider" / "checkpoints", wider)
    if setup == "lora":
        lora = _finetune_config()
        _save(tmp_path / "lora" / "checkpoints", lora)
    config = _finetune_config(init_from=str(tmp_path / setup if setup != "missing" else tmp_path / "nowhere"))
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_init_from(config)
    assert str(error.value).startswith(message.format(dir=tmp_path)) and "\n" not in str(error.value)

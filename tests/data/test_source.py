"""Data sources: the synthetic batch is the reference's, text batches are windows shifted into inputs and labels,
prefetching changes no batch, a saved position resumes at the next batch, and the files are checked against the
config with errors that name the field."""

from __future__ import annotations

import ast
import pathlib

import jax
import numpy as np
import pytest
from conftest import load_config, text_config, write_counting_tokens

import jaxscale.data
import jaxscale.data.source
from jaxscale import train
from jaxscale.data import Batch, DataError, check, make_batch, make_source, read, validation_batches, windows_to_batch
from jaxscale.data.source import SyntheticSource, TextSource
from jaxscale.train.sharding import place_batch, placement


def _counting_config(tmp_path, **data_fields):
    config = text_config("bf16", "tiny", write_counting_tokens(tmp_path / "d", train=2000, validation=200))
    config.data.update(data_fields)
    return config


def _take(source, count: int) -> list[np.ndarray]:
    batches = []
    for _ in range(count):
        batch, waited = source.next_batch()
        assert waited >= 0
        batches.append(np.asarray(batch.labels))
    return batches


def test_synthetic_source_hands_out_the_reference_batch_every_step():
    config = load_config("bf16", "tiny")
    source = make_source(config, placement(config))
    expected = train.make_batch(jax.random.PRNGKey(config.data.seed), 8, 32, config.model.vocab_size)
    for _ in range(2):
        batch, _ = source.next_batch()
        np.testing.assert_array_equal(batch.inputs, expected.inputs)
        np.testing.assert_array_equal(batch.labels, expected.labels)
    assert isinstance(source, SyntheticSource) and source.state() == {}


def test_windows_become_inputs_and_next_token_labels():
    batch = windows_to_batch(np.array([[5, 6, 7, 8], [1, 2, 3, 4]], np.uint16))
    np.testing.assert_array_equal(batch.inputs, [[5, 6, 7], [1, 2, 3]])
    np.testing.assert_array_equal(batch.labels, [[6, 7, 8], [2, 3, 4]])
    assert batch.inputs.dtype == np.int32


def test_place_batch_puts_the_batch_on_the_device_or_its_sharding():
    host = windows_to_batch(np.arange(20, dtype=np.uint16).reshape(4, 5))
    placed = place_batch(host)
    assert isinstance(placed.inputs, jax.Array) and placed.inputs.devices() == {jax.devices()[0]}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    for share in (False, True):  # one process: the global batch and its share are the same rows
        placed = place_batch(host, sharding, share=share)
        assert placed.labels.sharding == sharding
        np.testing.assert_array_equal(placed.labels, host.labels)


def test_the_data_package_makes_batches_and_leaves_their_placement_to_train():
    # One concern in one place: the Batch type lives in data (train re-exports it), placement in train.sharding.
    assert train.Batch is Batch and train.make_batch is make_batch
    package = pathlib.Path(jaxscale.data.__file__).parent
    imported = [
        name
        for path in package.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        + ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
    ]
    assert [m for m in imported if m.startswith("jaxscale.train")] == []
    assert not any(hasattr(module, "place_batch") for module in (jaxscale.data, jaxscale.data.source))


def test_place_batch_assembles_the_global_batch_from_each_process_share(monkeypatch):
    # One process here: its share is the whole batch; the multi-process path must still give the same array.
    host = windows_to_batch(np.arange(20, dtype=np.uint16).reshape(4, 5))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    placed = place_batch(host, sharding, share=True)
    assert placed.inputs.sharding == sharding
    np.testing.assert_array_equal(placed.inputs, host.inputs)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_text_batches_do_not_depend_on_prefetch_and_resume_from_a_saved_position(tmp_path, prefetch):
    config = _counting_config(tmp_path, prefetch=prefetch)
    reference_config = _counting_config(tmp_path / "ref", prefetch=0)
    reference = TextSource(reference_config, placement(reference_config))
    expected = _take(reference, 7)
    reference.close()
    source = TextSource(config, placement(config))
    seen = _take(source, 4)
    position = source.state()  # the prefetch thread has read further ahead; the position is the 4th batch's
    source.close()
    resumed = TextSource(config, placement(config), state=position)
    seen += _take(resumed, 3)
    resumed.close()
    for batch, want in zip(seen, expected, strict=True):
        np.testing.assert_array_equal(batch, want)
    window = seen[0][0]  # token i is i: a label row counts up from its window's second token
    np.testing.assert_array_equal(window, np.arange(window[0], window[0] + config.data.seq_len))


def test_validation_batches_are_fixed_minibatch_sized_windows(tmp_path):
    config = _counting_config(tmp_path)
    config.train.eval_every, config.train.eval_batches = 5, 2
    batches = validation_batches(config, placement(config))
    rows = config.data.batch_size // config.train.num_minibatches
    assert len(batches) == 2 * config.train.num_minibatches
    assert all(b.inputs.shape == (rows, config.data.seq_len) for b in batches)
    starts = np.concatenate([np.asarray(b.inputs)[:, 0] for b in batches])
    assert starts[0] == 0 and starts[-1] == 200 - config.data.seq_len - 1  # evenly spread over the split
    again = validation_batches(config, placement(config))
    assert all((np.asarray(a.labels) == np.asarray(b.labels)).all() for a, b in zip(batches, again, strict=True))


def test_check_names_the_field_that_disagrees_with_the_files(tmp_path, pydoc_bytes):
    config = text_config("bf16", "tiny", pydoc_bytes)
    assert check(config).vocab_size == 256
    config.model.vocab_size = 128
    with pytest.raises(DataError, match=r"model.vocab_size: 128 does not match .* \(256, tokenizer bytes\); set "
                                        r"--config.model.vocab_size=256"):  # fmt: skip
        check(config)
    short = _counting_config(tmp_path, seq_len=32)
    short.data.path = str(write_counting_tokens(tmp_path / "short", train=32, validation=10))
    with pytest.raises(DataError, match="data.seq_len: 32 needs windows of 33 tokens, but the train split"):
        check(short)
    short.data.path = str(write_counting_tokens(tmp_path / "short_validation", train=100, validation=10))
    check(short)  # the validation split is only needed for validation
    short.train.eval_every = 1
    with pytest.raises(DataError, match="the validation split .* holds only 10"):
        check(short)
    assert read(short.data.path).split("validation").tokens == 10

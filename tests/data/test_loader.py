"""The grain pipeline: windows are slices of the token file, every start once per epoch, the same batches for a
seed whatever the number of worker processes, and an iterator state that resumes at the next batch."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_counting_tokens

from jaxscale.data import loader, read


def _take(iterator, count: int) -> list[np.ndarray]:
    return [np.asarray(next(iterator)).copy() for _ in range(count)]


def test_windows_are_slices_and_each_start_comes_once_per_epoch(tmp_path):
    split = read(write_counting_tokens(tmp_path / "d", train=40)).split("train")
    seq_len, batch_size = 7, 3  # 40 - 8 + 1 = 33 starts = 11 batches per epoch
    batches = _take(loader.iterate(loader.batches(split, batch_size, seq_len, seed=1), 0, 0), 22)
    assert all(b.shape == (batch_size, seq_len + 1) and b.dtype == np.uint16 for b in batches)
    for window in np.concatenate(batches):
        np.testing.assert_array_equal(window, np.arange(window[0], window[0] + seq_len + 1))
    starts = [int(w[0]) for w in np.concatenate(batches)]
    assert sorted(starts[:33]) == list(range(33)) and sorted(starts[33:]) == list(range(33))
    assert starts[:33] != starts[33:]  # the second epoch is shuffled differently


def test_the_same_seed_gives_the_same_batches_and_another_seed_others(tmp_path):
    split = read(write_counting_tokens(tmp_path / "d", train=1000)).split("train")
    first = _take(loader.iterate(loader.batches(split, 4, 16, seed=3), 0, 0), 5)
    again = _take(loader.iterate(loader.batches(split, 4, 16, seed=3), 0, 0), 5)
    other = _take(loader.iterate(loader.batches(split, 4, 16, seed=4), 0, 0), 5)
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    assert not all((a == b).all() for a, b in zip(first, other, strict=True))


def test_worker_processes_give_the_same_batches_and_their_state_resumes(tmp_path):
    split = read(write_counting_tokens(tmp_path / "d", train=1000)).split("train")
    dataset = loader.batches(split, 4, 16, seed=3, host_delay_s=0.001)
    expected = _take(loader.iterate(dataset, 0, 0), 8)
    workers = loader.iterate(dataset, 2, 2)
    try:
        seen = _take(workers, 5)
        state = workers.get_state()
        resumed = loader.iterate(dataset, 2, 3)  # another buffer (data.prefetch): the state counts batches handed out
        try:
            resumed.set_state(state)
            seen += _take(resumed, 3)
        finally:
            resumed.close()
    finally:
        workers.close()
    assert all((a == b).all() for a, b in zip(seen, expected, strict=True))


def test_a_window_longer_than_the_split_is_refused(tmp_path):
    split = read(write_counting_tokens(tmp_path / "d", train=10)).split("train")
    with pytest.raises(ValueError, match="does not fit"):
        loader.WindowSource(split, 11)


def test_each_process_reads_its_own_share_of_every_batch(tmp_path):
    split = read(write_counting_tokens(tmp_path / "d", train=1000)).split("train")
    single = _take(loader.iterate(loader.batches(split, 4, 16, seed=3), 0, 0), 2)
    shares = [_take(loader.iterate(loader.batches(split, 4, 16, seed=3, process_index=p, process_count=2), 0, 0), 2)
              for p in (0, 1)]  # fmt: skip
    assert all(share.shape == (2, 17) for per_process in shares for share in per_process)
    for step in range(2):  # the processes' shares of a step are, together, the single process's batch
        np.testing.assert_array_equal(np.concatenate([shares[0][step], shares[1][step]]), single[step])


def test_a_position_means_the_same_batch_for_any_process_count(tmp_path):
    # Why the process count is not among a checkpoint's fields: process p's slice index j is global batch j.
    split = read(write_counting_tokens(tmp_path / "d", train=1000)).split("train")
    single = _take(loader.iterate(loader.batches(split, 4, 16, seed=3), 0, 0), 5)
    first = loader.iterate(loader.batches(split, 4, 16, seed=3, process_index=0, process_count=2), 0, 0)
    _take(first, 3)
    resumed = loader.iterate(loader.batches(split, 4, 16, seed=3), 0, 0)
    resumed.set_state(first.get_state())  # process 0's position after 3 steps on 2 processes, resumed on 1
    for step, batch in enumerate(_take(resumed, 2), start=3):
        np.testing.assert_array_equal(batch, single[step])

"""The grain pipeline: random windows of seq_len + 1 tokens from a memory-mapped split, batched, on workers.

```
WindowSource (window i = tokens[i : i + seq_len + 1], read from the memory map)
  -> shuffle(seed) -> repeat() -> batch(batch_size)       MapDataset: batch j is a function of (seed, j) only
  -> HostDelay (data.host_delay_s, optional)              the slow host on purpose
  -> to_iter_dataset (no reader threads)                  -> mp_prefetch(data.workers processes) when > 0
```
Every window start is drawn once per epoch (a global shuffle of all starts), reshuffled each epoch. Because
the order is fixed by the seed and the batch index, the batches do not depend on the number of workers, and
the iterator's state (`get_state`/`set_state`) is a small dict that checkpoints the position exactly.
Worker processes (spawned) unpickle these classes, so they stay small and hold only paths and numbers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import grain
import numpy as np
from absl import flags

from jaxscale.data.manifest import Split

_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


class WindowSource:
    """Random-access windows of `window` tokens of a split (grain's RandomAccessDataSource protocol).

    The memory map is opened lazily in each process, so the object pickles as a path and three numbers.
    """

    def __init__(self, split: Split, window: int):
        if split.tokens < window:
            raise ValueError(f"a window of {window} tokens does not fit in {split.tokens} tokens")
        self._path, self._dtype, self._tokens, self._window = str(split.path), split.dtype, split.tokens, window
        self._memmap = None

    def __len__(self) -> int:
        return self._tokens - self._window + 1  # every start whose window ends inside the split

    def __getitem__(self, index: int) -> np.ndarray:
        if self._memmap is None:
            self._memmap = np.memmap(self._path, dtype=self._dtype, mode="r", shape=(self._tokens,))
        return np.asarray(self._memmap[index : index + self._window])  # [window]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_memmap": None}

    def __repr__(self) -> str:
        return f"WindowSource({self._path}, window={self._window})"


class HostDelay(grain.transforms.Map):
    """Sleeps `seconds` per batch: a host pipeline made slow on purpose (a slow disk, decoder or augmentation).

    A sleep holds no CPU core, so on a CPU backend it slows the host side without slowing the compute.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds

    def map(self, element: np.ndarray) -> np.ndarray:
        time.sleep(self.seconds)
        return element


def batches(
    split: Split,
    batch_size: int,
    seq_len: int,
    seed: int,
    host_delay_s: float = 0.0,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """This process's share of batch j of the infinite, deterministic sequence.

    Returns:
      A MapDataset whose element j is [batch_size // process_count, seq_len + 1] token ids (the split's dtype):
      with several processes, each takes every process_count-th share, so the shares of one step differ.
    """
    dataset = grain.MapDataset.source(WindowSource(split, seq_len + 1)).shuffle(seed=seed).repeat()
    dataset = dataset.batch(batch_size // process_count, drop_remainder=True)
    if process_count > 1:
        dataset = dataset[process_index::process_count]
    if host_delay_s > 0:
        dataset = dataset.map(HostDelay(host_delay_s))
    return dataset


def exit_with_parent(worker_index: int, worker_count: int) -> None:
    """Worker start (grain's worker_init_fn): on Linux, SIGKILL this worker when its parent dies, even by kill -9.

    Without it a killed run leaves its workers orphaned, blocked on a full buffer. The signal follows the
    thread that started the worker (grain starts them on the first `next`): TextSource's prefetch thread, which
    ends only when the source is closed, or the main thread.
    """
    del worker_index, worker_count
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the prctl
            os._exit(1)


def iterate(dataset: grain.MapDataset, workers: int, buffer_per_worker: int) -> grain.DatasetIterator:
    """An iterator over `dataset`: in this process (workers=0) or in `workers` spawned processes.

    No reader threads are used in either case (ReadOptions(num_threads=0)): `workers` is the host's only
    parallelism, and prefetching ahead of the step is done by the caller (source.TextSource), so the two knobs
    of the experiment are separate. Each worker keeps up to `buffer_per_worker` (at least 1) batches ready.
    """
    iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if workers > 0:
        if not flags.FLAGS.is_parsed():  # grain reads its absl flags; our entry points parse their own FlagValues
            flags.FLAGS.mark_as_parsed()
        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=max(1, buffer_per_worker))
        iterable = iterable.mp_prefetch(options, worker_init_fn=exit_with_parent)
    return iter(iterable)

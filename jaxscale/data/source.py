"""Where a run's batches come from: one interface for the synthetic batch and for text through grain.

A data source hands the train step its next batch already on the device, and says how long the step waited
for it. Sources make host batches; the run's placement (`BatchPlacement`: jaxscale.train.sharding.Placement,
whose `place_batch` is the one place a batch goes to the device(s)) puts them there. TextSource prefetches: a background
thread takes batches from the grain iterator and places them on the device `data.prefetch` steps ahead
(double buffering at 1, the default 2), so host work overlaps the device's step; with prefetch 0 the step
waits for all of its batch's preparation. The wait is a `jax.profiler.TraceAnnotation("input_wait")` in a trace.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

import jax
import ml_collections
import numpy as np

from jaxscale.data import manifest, stats
from jaxscale.data.batch import Batch, make_batch, windows_to_batch
from jaxscale.data.manifest import DataError

WAIT_ANNOTATION = "input_wait"


class BatchPlacement(Protocol):
    """Where batches go: the run's jaxscale.train.sharding.Placement (one device, or split over a mesh)."""

    def place_batch(self, batch: Batch) -> Batch:
        """A global host batch (every process holds all of it) on the device(s)."""

    def place_share(self, share: Batch) -> Batch:
        """This process's share of a global batch (the text loader's rows) on the device(s)."""


class DataSource(Protocol):
    """What run.execute asks of a data source."""

    def next_batch(self) -> tuple[Batch, float]:
        """The next batch, on the device(s), and the seconds the caller waited for it."""

    def state(self) -> dict:
        """The position after the batches handed out so far (JSON), for a checkpoint."""

    def close(self) -> None:
        """Stops background threads and worker processes."""


class SyntheticSource:
    """The reference's data: one batch of random tokens, made on the device once and used for every step.

    Every process makes the same global batch from the seed; `placement` puts it where the step takes it:
    on the device, or each process's rows on a mesh.
    """

    def __init__(self, config: ml_collections.ConfigDict, placement: BatchPlacement):
        d = config.data
        batch = make_batch(jax.random.PRNGKey(d.seed), d.batch_size, d.seq_len, config.model.vocab_size)
        self._batch = placement.place_batch(batch)

    def next_batch(self) -> tuple[Batch, float]:
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(WAIT_ANNOTATION):
            batch = self._batch
        return batch, time.perf_counter() - start

    def state(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class TextSource:
    """Random windows of a prepared text split through grain, prefetched onto the device by a thread."""

    def __init__(self, config: ml_collections.ConfigDict, placement: BatchPlacement, state: dict | None = None):
        from jaxscale.data import loader  # grain is imported only by runs on text

        d = config.data
        split = check(config).split("train")
        self._placement = placement
        if d.batch_size % jax.process_count():
            raise DataError(f"data.batch_size: {d.batch_size} is not divisible by the {jax.process_count()} processes")
        dataset = loader.batches(split, d.batch_size, d.seq_len, d.seed, d.host_delay_s,
                                 jax.process_index(), jax.process_count())  # fmt: skip
        self._iterator = loader.iterate(dataset, d.workers, d.prefetch)
        if state:
            self._iterator.set_state(state["grain"])
        self._state = self._iterator.get_state()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        if d.prefetch > 0:
            self._queue = queue.Queue(maxsize=d.prefetch)
            self._thread = threading.Thread(target=self._fill, name="jaxscale-prefetch", daemon=True)
            self._thread.start()

    def _produce(self) -> tuple[Batch, dict]:
        batch = self._placement.place_share(windows_to_batch(next(self._iterator)))
        return jax.block_until_ready(batch), self._iterator.get_state()

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                self._put(self._produce())
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(_Failed(error))
        finally:  # the thread that uses the iterator closes it (worker processes end with their starter thread)
            self._close_iterator()

    def _close_iterator(self) -> None:
        if self._iterator is not None and hasattr(self._iterator, "close"):
            self._iterator.close()
        self._iterator = None  # freed now, not at interpreter exit (where grain's __del__ fails noisily)

    def next_batch(self) -> tuple[Batch, float]:
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(WAIT_ANNOTATION):
            item = self._produce() if self._queue is None else self._queue.get()
        if isinstance(item, _Failed):
            raise item.error
        batch, self._state = item
        return batch, time.perf_counter() - start

    def state(self) -> dict:
        return {"grain": self._state}

    def close(self) -> None:
        self._stop.set()
        if self._queue is not None:
            self._thread.join(timeout=60)
        else:
            self._close_iterator()


def check(config: ml_collections.ConfigDict) -> manifest.Manifest:
    """Checks a text config against its token files (before anything is run or written).

    Raises:
      DataError: naming the field at fault: data.path (missing or corrupt), model.vocab_size (not the
        files' vocabulary) or data.seq_len (longer than a split).
    """
    found = manifest.read(config.data.path)
    if config.model.vocab_size != found.vocab_size:
        raise DataError(
            f"model.vocab_size: {config.model.vocab_size} does not match the vocabulary of the token files in "
            f"{config.data.path} ({found.vocab_size}, tokenizer {found.tokenizer}); set "
            f"--config.model.vocab_size={found.vocab_size}"
        )
    needed = {"train": True, "validation": config.train.eval_every > 0}
    for name, split in found.splits.items():
        if needed[name] and split.tokens < config.data.seq_len + 1:
            raise DataError(
                f"data.seq_len: {config.data.seq_len} needs windows of {config.data.seq_len + 1} tokens, but the "
                f"{name} split of {config.data.path} holds only {split.tokens}"
            )
    return found


def validation_batches(config: ml_collections.ConfigDict, placement: BatchPlacement) -> list[Batch]:
    """Fixed held-out batches: train.eval_batches x data.batch_size windows, evenly spaced over the split.

    Each batch has the rows of one minibatch (batch_size / num_minibatches), so evaluation needs no more
    activation memory than a training minibatch. The same windows are used at every evaluation. Every
    process reads the same (global) windows; on a mesh `placement` puts each process's rows on its devices.
    """
    d, t = config.data, config.train
    split = check(config).split("validation")
    tokens = split.open()
    count = t.eval_batches * d.batch_size
    starts = np.linspace(0, split.tokens - d.seq_len - 1, count).round().astype(np.int64)  # [count]
    windows = np.stack([tokens[s : s + d.seq_len + 1] for s in starts])  # [count, T + 1]
    rows = d.batch_size // t.num_minibatches
    return [placement.place_batch(windows_to_batch(windows[i : i + rows])) for i in range(0, count, rows)]


def data_columns(config: ml_collections.ConfigDict) -> dict:
    """The row's description of the data: tokenizer, token counts and the validation split's unigram entropy."""
    if config.data.source != "text":
        return {}
    found = check(config)
    validation = found.split("validation")
    return {
        "data_tokenizer": found.tokenizer,
        "data_train_tokens": found.split("train").tokens,
        "data_validation_tokens": validation.tokens,
        "data_validation_unigram_entropy_nats": stats.unigram_entropy_nats(validation.open(), found.vocab_size),
    }


def make_source(config: ml_collections.ConfigDict, placement: BatchPlacement, state: dict | None = None) -> DataSource:
    """The data source of `config.data.source`, resumed at `state` (from DataSource.state()) when given.

    `placement` (jaxscale.train.sharding.placement(config)) says where batches go: one device, or split over a
    mesh (the text loader gives each process its own rows, placed as its share of the global batch).
    """
    if config.data.source == "text":
        return TextSource(config, placement, state)
    return SyntheticSource(config, placement)

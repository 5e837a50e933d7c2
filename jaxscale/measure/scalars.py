"""TensorBoard scalars (training and validation loss, input wait) as event files, written without TensorFlow.

Uses the `tensorboard` package's own writer (`tensorboard.summary.Writer`, numpy only). The events land in the
run's directory beside its profile, so `python -m jaxscale.tensorboard` shows both under the run's name:
`loss/train` and `loss/validation` share the `loss` section of the Scalars tab.
"""

from __future__ import annotations

import pathlib


class ScalarWriter:
    """Buffered scalar events under `logdir`; the event file is created at the first value."""

    def __init__(self, logdir: pathlib.Path):
        self.logdir = pathlib.Path(logdir)
        self._writer = None

    def add(self, tag: str, value: float, step: int) -> None:
        """Records `value` for `tag` (e.g. "loss/train") at `step`."""
        if self._writer is None:
            from tensorboard.summary import Writer

            self.logdir.mkdir(parents=True, exist_ok=True)
            self._writer = Writer(str(self.logdir))
        self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

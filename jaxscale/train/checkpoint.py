"""Checkpoints with orbax: the train state and the data iterator's position, every N steps; resume from the last.

`<run dir>/checkpoints/<step>/` holds `state` (the TrainState's arrays: params, optimizer state, step, dropout
key) and `meta` (JSON: the data source's position and the fields that fix the loss curve). Orbax writes each
checkpoint into a temporary directory and renames it when complete, so a run killed mid-save leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import ml_collections
import orbax.checkpoint as ocp

# Fields that change the loss curve: a checkpoint resumes only a run whose config agrees on all of them.
_CURVE_GROUPS = ("model", "optimizer")
_CURVE_FIELDS = ("data.batch_size", "data.seq_len", "data.seed", "data.source", "data.path", "train.num_minibatches",
                 "train.accumulate", "train.seed")  # fmt: skip


class CheckpointMismatch(ValueError):
    """The checkpoint was written by a run whose config differs in a field that changes the loss curve."""


def curve_fields(config: ml_collections.ConfigDict) -> dict[str, object]:
    """The config fields that fix the loss curve, flat and JSON-ready."""
    fields = {f"{g}.{k}": v for g in _CURVE_GROUPS for k, v in config[g].items()}
    fields.update({f: config[f.split(".")[0]][f.split(".")[1]] for f in _CURVE_FIELDS})
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


class Checkpoints:
    """Saves every `train.checkpoint_every` steps into `directory`, keeping the newest `train.checkpoint_keep`."""

    def __init__(self, directory: pathlib.Path, config: ml_collections.ConfigDict):
        self.directory = pathlib.Path(directory).absolute()
        self.every = config.train.checkpoint_every
        self._fields = curve_fields(config)
        options = ocp.CheckpointManagerOptions(max_to_keep=config.train.checkpoint_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.saved_steps: list[int] = []
        self.save_s = 0.0  # host seconds the steps were held up by saving (the write itself is asynchronous)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, state: Any, data_state: dict) -> None:
        """Saves the state after `steps_done` steps and the data position after as many batches."""
        start = time.perf_counter()
        meta = {"data": data_state, "config": self._fields}
        self._manager.save(steps_done, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)))  # fmt: skip
        self.saved_steps.append(steps_done)
        self.save_s += time.perf_counter() - start

    def restore(self, like_state: Any) -> tuple[int, Any, dict]:
        """(steps done, state, data position) of the newest checkpoint; `like_state` gives structure and placement.

        Raises:
          CheckpointMismatch: naming the first field whose value differs from this run's config.
        """
        step = self._manager.latest_step()
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like_state),
                                                                       meta=ocp.args.JsonRestore()))  # fmt: skip
        saved = restored.meta["config"]
        for field, value in self._fields.items():
            if saved.get(field) != value:
                raise CheckpointMismatch(
                    f"{self.directory}/{step} was written with {field}={saved.get(field)!r}, this run has {value!r}; "
                    "resume with the same config, or use another --name"
                )
        return step, restored.state, restored.meta["data"]

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

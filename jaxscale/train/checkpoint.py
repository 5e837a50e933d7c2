"""Checkpoints with orbax: the train state and the data iterator's position, every N steps; resume from the last.

`<run dir>/checkpoints/<step>/` holds `state` (the TrainState's arrays: params, optimizer state, step, dropout
key) and `meta` (JSON: the data source's position and the fields a resume must agree on). Orbax writes each
checkpoint into a temporary directory and renames it when complete, so a run killed mid-save leaves the
previous checkpoint intact.

A resume reads `meta` alone first and compares it with this run's fields (`check`, also run by
jaxscale.run before anything is compiled or written), then reads the arrays straight into the state's
abstract shapes and shardings (`restore`): no state is initialised to be overwritten.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from flax import traverse_util

from jaxscale.config import finetune
from jaxscale.data import manifest
from jaxscale.train.step import model_params, split_params

# Fields that change the loss curve: a checkpoint resumes only a run whose config agrees on all of them.
_CURVE_GROUPS = ("model", "optimizer", "finetune")
_CURVE_FIELDS = ("data.batch_size", "data.seq_len", "data.seed", "data.source", "train.num_minibatches",
                 "train.accumulate", "train.grad_accumulation", "train.seed")  # fmt: skip
# Fields that change what a text run's saved data position means. grain's iterator state is per worker
# process: with data.workers = N > 0 it holds N positions, worker i's within its slice (batches i, i + N, ...),
# so it cannot be set on another number of workers (grain raises, or silently resumes at other batches); with
# 0 it is one next index. Neither data.prefetch (the buffers: the state counts the batches handed out) nor
# data.host_delay_s enters it, nor the process count (each process's slice index is the global step).
_POSITION_FIELDS = ("data.workers",)
# The token files: their manifest's digest (manifest.Manifest.digest), in place of data.path, so a moved
# directory resumes and other data at the same path is refused.
DATA_DIGEST = "data.digest"


class CheckpointError(ValueError):
    """A checkpoint cannot resume this run (one line naming the field at fault)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was written by a run whose config or data differs in a field that a resume must keep."""


def resume_fields(config: ml_collections.ConfigDict) -> dict[str, object]:
    """The fields a resume must agree on, flat and JSON-ready: the loss curve's and, on text, the data's."""
    fields = {f"{g}.{k}": v for g in _CURVE_GROUPS for k, v in config[g].items()}
    names = _CURVE_FIELDS + (_POSITION_FIELDS if config.data.source == "text" else ())
    fields.update({f: config[f.split(".")[0]][f.split(".")[1]] for f in names})
    if config.data.source == "text":
        fields[DATA_DIGEST] = manifest.read(config.data.path).digest
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def _mismatch(config: ml_collections.ConfigDict, where: str, field: str, saved: object, value: object) -> str:
    if field == DATA_DIGEST:
        return (
            f"data.path: {config.data.path} holds other token files than {where} was trained on (manifest digest "
            f"{str(value)[:12]}, the checkpoint's {str(saved)[:12]}); resume on the same data, or use another --name"
        )
    return (
        f"{field}: {where} was written with {field}={saved!r}, this run has {value!r}; resume with the same "
        "config, or use another --name"
    )


def _on_device(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A leaf with its sharding, or on this process's first device when it has none (the single-device step)."""
    if getattr(leaf, "sharding", None) is not None:
        return leaf
    return jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    )


class Checkpoints:
    """Saves every `train.checkpoint_every` steps into `directory`, keeping the newest `train.checkpoint_keep`.

    With `read_only` nothing is ever written (not even the directory): for checking a resume before a run.
    """

    def __init__(self, directory: pathlib.Path, config: ml_collections.ConfigDict, read_only: bool = False):
        self.directory = pathlib.Path(directory).absolute()
        self.every = config.train.checkpoint_every
        self._config, self._read_only = config, read_only
        self._fields = resume_fields(config)
        # Read-only: nothing created or deleted (orbax's own read_only option warns three times on stderr).
        keep = None if read_only else config.train.checkpoint_keep
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.saved_steps: list[int] = []
        self.save_s = 0.0  # host seconds the steps were held up by saving (the write itself is asynchronous)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, state: Any, data_state: dict) -> None:
        """Saves the state after `steps_done` steps and the data position after as many batches."""
        if self._read_only:
            raise RuntimeError(f"{self.directory} was opened read-only, for checking a resume")
        start = time.perf_counter()
        meta = {"data": data_state, "config": self._fields}
        self._manager.save(steps_done, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)))  # fmt: skip
        self.saved_steps.append(steps_done)
        self.save_s += time.perf_counter() - start

    def check(self) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint, its `meta` alone read and checked against this run (None: none).

        Raises:
          CheckpointMismatch: naming the first field whose saved value differs from this run's.
          CheckpointError: the newest checkpoint has no readable jaxscale meta.
        """
        step = self._manager.latest_step()
        if step is None:
            return None
        where = f"{self.directory}/{step}"
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as error:  # noqa: BLE001 - orbax raises many types for a missing or foreign item
            raise CheckpointError(
                f"--name: {where} is not a readable jaxscale checkpoint ({type(error).__name__}); use another --name"
            ) from None
        saved = meta.get("config") if isinstance(meta, dict) else None
        if not isinstance(saved, dict) or "data" not in meta:
            raise CheckpointError(f"--name: {where} is not a jaxscale checkpoint (its meta has no config and data "
                                  "position); use another --name")  # fmt: skip
        for field, value in self._fields.items():
            if field not in saved:
                raise CheckpointMismatch(f"{field}: {where} does not record it (written by an older jaxscale), so "
                                         "it cannot be resumed safely; use another --name")  # fmt: skip
            if saved[field] != value:
                raise CheckpointMismatch(_mismatch(self._config, where, field, saved[field], value))
        return step, meta

    def restore(self, abstract_state: Any) -> tuple[int, Any, dict]:
        """(steps done, state, data position) of the newest checkpoint, after `check`.

        Args:
          abstract_state: the state as ShapeDtypeStructs (jax.eval_shape of the init; on a mesh with the
            layout's shardings, Placement.abstract_inputs): its structure, dtypes and placement. Each array is
            read into its shards where they live; a leaf without a sharding goes to this process's first device.

        Raises:
          CheckpointError: there is no checkpoint, or `check` refused it.
        """
        checked = self.check()
        if checked is None:
            raise CheckpointError(f"--name: {self.directory} holds no checkpoint to resume from")
        step, meta = checked
        target = jax.tree_util.tree_map(_on_device, abstract_state)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return step, restored.state, meta["data"]

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


# The model fields that decide the parameters' names and shapes (finetune.init_from must agree on them; the
# adapters, remat, attention kernel and dtypes do not change the base parameters).
_PARAM_FIELDS = ("family", "vocab_size", "hidden_size", "head_dim", "num_layers", "mlp_expansion", "mlp_hidden_size",
                 "num_kv_heads", "max_seq_len", "tie_embeddings", "scan_layers")  # fmt: skip


def _source_directory(source: str) -> pathlib.Path:
    """The checkpoints directory of finetune.init_from: a run directory (its checkpoints/) or that directory."""
    path = pathlib.Path(source)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def check_init_from(config: ml_collections.ConfigDict) -> tuple[pathlib.Path, int]:
    """(checkpoints directory, step) of finetune.init_from's newest checkpoint, its meta checked: written by a
    run that trained every parameter of a model with this run's parameter shapes. Nothing is written.

    Raises:
      CheckpointError: one line naming finetune.init_from and what is wrong.
    """
    source = config.finetune.init_from
    directory = _source_directory(source)
    if not directory.is_dir():
        raise CheckpointError(f"finetune.init_from: {source} is not a directory; give a run directory with "
                              "checkpoints (a run with --config.train.checkpoint_every=N)")  # fmt: skip
    manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(create=False))
    try:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(f"finetune.init_from: {directory} holds no checkpoint; give a run directory "
                                  "whose run saved one (--config.train.checkpoint_every=N)")  # fmt: skip
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as error:  # noqa: BLE001 - orbax raises many types for a missing or foreign item
            raise CheckpointError(f"finetune.init_from: {directory}/{step} is not a readable jaxscale checkpoint "
                                  f"({type(error).__name__})") from None  # fmt: skip
    finally:
        manager.close()
    saved = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"finetune.init_from: {directory}/{step} is not a jaxscale checkpoint (no config)")
    where = f"finetune.init_from: {directory}/{step}"
    if saved.get("finetune.train", "all") not in ("all", "auto") or saved.get("model.lora_rank", 0):
        raise CheckpointError(f"{where} was itself a fine-tuning run (finetune.train={saved.get('finetune.train')}, "
                              f"model.lora_rank={saved.get('model.lora_rank')}); start from a run that trained "
                              "every parameter without adapters")  # fmt: skip
    for name in _PARAM_FIELDS:
        value = config.model[name]
        kept = saved.get(f"model.{name}")
        if (list(kept) if isinstance(kept, (list, tuple)) else kept) != value:
            raise CheckpointError(f"model.{name}: {where} was written with {kept!r}, this run has {value!r}; "
                                  "the base parameters must have the same shapes")  # fmt: skip
    return directory, step


def load_base_params(config: ml_collections.ConfigDict, abstract_params: Any) -> Any:
    """The parameters of finetune.init_from's newest checkpoint (after `check_init_from`), read into
    `abstract_params` (ShapeDtypeStructs with shardings: the model's params without adapters, float32): each
    array straight into its shards; the rest of that checkpoint (optimizer state, step) is not read."""
    directory, step = check_init_from(config)
    target = jax.tree_util.tree_map(_on_device, abstract_params)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(create=False))
    try:
        args = ocp.args.PyTreeRestore({"params": target}, restore_args={"params": restore_args}, partial_restore=True)
        return manager.restore(step, args=ocp.args.Composite(state=args)).state["params"]
    finally:
        manager.close()


def with_base_params(state: Any, config: ml_collections.ConfigDict) -> Any:
    """A fresh train state whose model parameters (trained and frozen) are finetune.init_from's; the adapters
    keep their init (B = 0: the loaded model's function), the frozen ones are cast to finetune.frozen_dtype."""
    flat = traverse_util.flatten_dict(model_params(state.params, state.frozen), sep="/")
    base = {
        k: jax.ShapeDtypeStruct(v.shape, jnp.float32, sharding=v.sharding)
        for k, v in flat.items()
        if not finetune.is_lora_param(k)
    }
    loaded = load_base_params(config, traverse_util.unflatten_dict(base, sep="/"))
    flat.update(traverse_util.flatten_dict(loaded, sep="/"))
    params, frozen = split_params(traverse_util.unflatten_dict(flat, sep="/"), config)
    return state.replace(params=params, frozen=frozen)


def check_resume(directory: pathlib.Path, config: ml_collections.ConfigDict) -> int | None:
    """The step a run would resume from in `directory` (None: no checkpoint), its meta checked; nothing written.

    Raises:
      CheckpointError: as Checkpoints.check, before anything of the run is compiled or written.
    """
    if not pathlib.Path(directory).is_dir():
        return None
    checkpoints = Checkpoints(directory, config, read_only=True)
    try:
        checked = checkpoints.check()
    finally:
        checkpoints.close()
    return None if checked is None else checked[0]

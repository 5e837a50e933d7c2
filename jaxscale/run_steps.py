"""A run's steps: warm-up, timed and profiled steps with validation and checkpoints, resumed where one left off."""

from __future__ import annotations

import contextlib
import pathlib
import sys

import ml_collections
from tqdm import tqdm

from jaxscale import data
from jaxscale.measure import profiling
from jaxscale.measure.scalars import ScalarWriter
from jaxscale.train import evaluate, sharding
from jaxscale.train import loop as train_loop


class RunError(Exception):
    """The run failed after it started; carries the row status (oom | error | nan)."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status

def _evaluation(config: ml_collections.ConfigDict, placement: sharding.Placement):
    """(params, fp8_meta) -> validation loss on the fixed held-out batches, or None when train.eval_every is 0.

    On a mesh the batches are split like the training batch and the model is traced with the mesh's rules.
    """
    if not config.train.eval_every:
        return None
    batches = data.validation_batches(config, placement)
    eval_step = evaluate.make_eval_step(config)

    def evaluation(params, fp8_meta=None):
        with placement.activate():
            return evaluate.evaluate(eval_step, params, batches, fp8_meta)

    return evaluation

def _steps(config, loop: train_loop.TrainLoop, run_dir: pathlib.Path, row: dict, bar: tqdm) -> None:
    """Warm-up, timed and profiled steps from wherever the loop starts (0, or a checkpoint's step)."""
    trained = config.train.warmup_steps + config.train.steps
    row.setdefault("loss_first", None)  # stays None when resumed after step 1
    while loop.steps_done < trained:
        record = loop.step()
        if record.step == 1:
            row["loss_first"] = record.loss
        bar.update()
        bar.set_postfix(loss=f"{record.loss:.3f}")
    remaining = trained + config.profile.steps - loop.steps_done
    if config.profile.steps > 0 and remaining > 0:
        first = loop.steps_done
        row["trace_files"] = profiling.capture(run_dir, remaining, lambda: loop.step().loss, first_step=first)
        row["trace_dir"] = str(run_dir)
        bar.update(remaining)
    if loop.evaluation is not None and (not loop.validation or loop.validation[-1][0] != loop.steps_done):
        loop.evaluate()  # and at the end

def execute(config, compiled, placement: sharding.Placement, run_dir: pathlib.Path, row: dict, progress: bool) -> None:
    """Warm-up, timed and profiled steps, resumed from the last checkpoint if there is one; fills `row` in place.

    Raises RunError on a non-finite loss.
    """
    evaluation = _evaluation(config, placement)
    first, state, data_state, checkpoints = 0, None, None, None
    with contextlib.ExitStack() as cleanup:  # closed in reverse, also on errors and Ctrl-C
        if config.train.checkpoint_every:
            from jaxscale.train.checkpoint import Checkpoints  # orbax is imported only by runs that checkpoint

            checkpoints = Checkpoints(run_dir / "checkpoints", config)
            cleanup.callback(_close_checkpoints, checkpoints, row, run_dir / "checkpoints")
            if checkpoints.latest_step() is not None:  # meta checked first, then read into the abstract state
                first, state, data_state = checkpoints.restore(placement.abstract_inputs()[0])
        if state is None:  # a fresh run: the only state ever initialised
            state = placement.init_state()
            if config.finetune.init_from:  # the base parameters of another run's checkpoint
                from jaxscale.train.checkpoint import with_base_params

                state = with_base_params(state, config)
        row["resumed_from_step"] = first or None
        row.update(data.data_columns(config))
        source = data.make_source(config, placement, state=data_state)
        cleanup.callback(source.close)
        scalars = ScalarWriter(run_dir)
        cleanup.callback(scalars.close)
        loop = train_loop.TrainLoop(compiled, state, placement.init_metrics(), source, scalars, evaluation,
                                    config.train.eval_every, checkpoints, first_step=first)  # fmt: skip
        cleanup.callback(lambda: row.update(loop.columns(config, row["tokens_per_step"])))
        if config.finetune.init_from and not first and evaluation is not None and config.train.eval_every:
            loop.evaluate()  # the loaded model on this data, before fine-tuning moves it (validation step 0)
        total = config.train.warmup_steps + config.train.steps + config.profile.steps
        bar = tqdm(total=total, initial=first, desc=row["name"], unit="step", disable=not progress, file=sys.stderr)
        cleanup.callback(bar.close)
        try:
            _steps(config, loop, run_dir, row, bar)
        except FloatingPointError as error:
            raise RunError("nan", str(error)) from None

def _close_checkpoints(checkpoints, row: dict, directory: pathlib.Path) -> None:
    """Waits for the writes; the row names the checkpoints as the run's directory does (relative where it is)."""
    checkpoints.close()
    row["checkpoint_dir"], row["checkpoint_steps"] = str(directory), checkpoints.saved_steps
    row["checkpoint_save_s_total"] = checkpoints.save_s

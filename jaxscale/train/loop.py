"""The training loop's step: a batch from the data source, the compiled step, per-step records, validation
every N steps and checkpoints, with the losses written as TensorBoard scalars.

The data source is anything with `next_batch() -> (batch on device, seconds waited)` and `state() -> dict`
(jaxscale.data.source.DataSource); jaxscale.run drives the loop through its warm-up, timed and profiled phases.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxscale.measure import timing
from jaxscale.measure.scalars import ScalarWriter
from jaxscale.train.sharding import host_scalars
from jaxscale.train.step import model_params

if TYPE_CHECKING:  # orbax is imported only by runs that checkpoint
    from jaxscale.train.checkpoint import Checkpoints


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step: its number (steps done after it), mean loss and accuracy, and host seconds."""

    step: int
    loss: float
    accuracy: float
    step_s: float  # the compiled step, dispatch to block_until_ready
    input_wait_s: float  # waiting for the batch before the step


class TrainLoop:
    """Runs steps one at a time and keeps what a result row needs from them."""

    def __init__(
        self,
        compiled: Callable,
        state: Any,
        metrics: Any,
        source: Any,
        scalars: ScalarWriter,
        evaluation: Callable[[Any, Any], dict[str, float]] | None = None,
        eval_every: int = 0,
        checkpoints: Checkpoints | None = None,
        first_step: int = 0,
    ):
        self.compiled, self.state, self.source, self.scalars = compiled, state, source, scalars
        self.evaluation, self.eval_every, self.checkpoints = evaluation, eval_every, checkpoints
        self.metrics = metrics  # zero sums, where the step takes them (Placement.init_metrics)
        self.steps_done = first_step
        self.records: list[StepRecord] = []
        self.validation: list[tuple[int, dict[str, float]]] = []  # (steps done, evaluate()'s result)

    def step(self) -> StepRecord:
        """One optimizer step; then validation and a checkpoint when due.

        Raises:
          FloatingPointError: the step's loss is not finite (nothing is evaluated or saved after it).
        """
        batch, waited = self.source.next_batch()
        (self.state, sums), elapsed = timing.time_call(self.compiled, self.state, self.metrics, batch)
        current = host_scalars(sums)  # after the timer: a few bytes, the step already finished
        # The step adds its sums to the ones it is given: given zeros, they are this step's alone. (A difference of
        # float32 running sums would lose the loss's last digits as the sums grow: 2e-6 after 40 tiny steps.)
        self.metrics = jax.tree_util.tree_map(jnp.zeros_like, sums)
        tokens = current["tokens"]
        loss, accuracy = current["loss_sum"] / tokens, current["correct"] / tokens
        record = StepRecord(self.steps_done + 1, loss, accuracy, elapsed, waited)
        self.records.append(record)
        self.scalars.add("loss/train", loss, record.step)
        self.scalars.add("input/wait_s", waited, record.step)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss became {loss} at step {self.steps_done}; lower optimizer.learning_rate or use float32"
            )
        self.steps_done = record.step
        if self.evaluation is not None and self.eval_every and self.steps_done % self.eval_every == 0:
            self.evaluate()
        if self.checkpoints is not None and self.checkpoints.due(self.steps_done):
            self.checkpoints.save(self.steps_done, self.state, self.source.state())
        return record

    def evaluate(self) -> dict[str, float]:
        """Validation now (after `steps_done` steps), recorded and written as `loss/validation`."""
        result = self.evaluation(model_params(self.state.params, self.state.frozen), self.state.fp8_meta)
        self.validation.append((self.steps_done, result))
        self.scalars.add("loss/validation", result["loss"], self.steps_done)
        self.scalars.flush()
        return result

    def columns(self, config: ml_collections.ConfigDict, tokens_per_step: int) -> dict:
        """Row columns of the steps run: times and input waits of the timed ones, losses, validation."""
        warmup, trained = config.train.warmup_steps, config.train.warmup_steps + config.train.steps
        timed = [r for r in self.records if warmup < r.step <= trained]
        last = [r for r in self.records if r.step <= trained][-1:] or self.records[-1:]
        columns = {**timing.summarize([r.step_s for r in timed]), "step_s_all": [r.step_s for r in timed]}
        columns.update(timing.input_wait_columns([r.input_wait_s for r in timed], [r.step_s for r in timed]))
        columns["tokens_per_s"] = tokens_per_step / columns["step_s_median"] if timed else None
        both = columns["step_with_input_wait_s_median"]
        columns["tokens_per_s_with_input_wait"] = tokens_per_step / both if timed else None
        columns["loss"], columns["accuracy"] = (last[0].loss, last[0].accuracy) if last else (None, None)
        columns["loss_all"] = [r.loss for r in self.records]
        columns["validation_steps"] = [step for step, _ in self.validation]
        columns["validation_loss_all"] = [result["loss"] for _, result in self.validation]
        final = self.validation[-1][1] if self.validation else {}
        columns["validation_loss"], columns["validation_accuracy"] = final.get("loss"), final.get("accuracy")
        columns["validation_tokens"] = final.get("tokens")
        return columns


def summary_lines(row: dict) -> list[str]:
    """Summary lines for the input wait, validation loss and checkpoints, where the row has them."""
    lines = []
    if row.get("input_wait_s_median") is not None and row.get("config.data.source") == "text":
        lines.append(
            f"  input wait {row['input_wait_s_median']:.4f} s median, {row['input_wait_s_total']:.3f} s total "
            f"({row['input_wait_fraction']:.0%} of step + wait; workers {row['config.data.workers']}, prefetch "
            f"{row['config.data.prefetch']})   {row['tokens_per_s_with_input_wait']:,.0f} tokens/s with the wait"
        )
    if row.get("validation_loss") is not None:
        lines.append(
            f"  validation loss {row['validation_loss']:.4f} after step {row['validation_steps'][-1]} "
            f"(unigram entropy of the validation tokens {row['data_validation_unigram_entropy_nats']:.4f})"
        )
    if row.get("checkpoint_steps"):
        lines.append(f"  checkpoints at steps {row['checkpoint_steps']} in {row['checkpoint_dir']}")
    if row.get("resumed_from_step"):
        lines.append(f"  resumed from the checkpoint after step {row['resumed_from_step']}")
    return lines

"""The loop's step: per-step loss from the running sums, the batch wait recorded, validation and checkpoints on
their schedule with the data position of the batches consumed, scalars written, and a non-finite loss stopping
it before anything is evaluated or saved."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from jaxscale.train.loop import TrainLoop
from jaxscale.train.step import init_metrics


@dataclasses.dataclass
class FakeState:
    params: float
    frozen: dict = dataclasses.field(default_factory=dict)  # nothing frozen: validation reads params alone
    fp8_meta: dict = dataclasses.field(default_factory=dict)  # no delayed FP8 scaling state


class FakeSource:
    """Batch i is the loss the fake step reports for it; the position is the number of batches handed out."""

    def __init__(self, losses):
        self.losses, self.handed = list(losses), 0

    def next_batch(self):
        self.handed += 1
        return self.losses[self.handed - 1], 0.25

    def state(self):
        return {"handed": self.handed}


def fake_step(state, metrics, loss):
    """Adds `loss` for 4 tokens, 1 of them correct, and moves the params by one."""
    added = {"loss_sum": loss * 4, "correct": 1.0, "tokens": 4.0}
    return FakeState(state.params + 1), {k: metrics[k] + jnp.float32(v) for k, v in added.items()}


class Recorder:
    def __init__(self):
        self.scalars, self.saved = [], []

    def add(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def due(self, steps_done):
        return steps_done % 2 == 0

    def save(self, steps_done, state, data_state):
        self.saved.append((steps_done, state.params, data_state))


def test_steps_record_losses_and_run_validation_and_checkpoints_on_schedule():
    recorder = Recorder()
    evaluation = lambda params, fp8_meta: {"loss": 10.0 * params}  # noqa: E731
    source = FakeSource([3.0, 2.0, 1.5, 1.0, 0.5])
    loop = TrainLoop(fake_step, FakeState(0), init_metrics(), source, recorder, evaluation,
                     eval_every=3, checkpoints=recorder, first_step=10)  # fmt: skip
    records = [loop.step() for _ in range(5)]
    assert [r.step for r in records] == [11, 12, 13, 14, 15] and loop.steps_done == 15
    assert [r.loss for r in records] == [3.0, 2.0, 1.5, 1.0, 0.5]
    assert all(r.accuracy == 0.25 and r.input_wait_s == 0.25 and r.step_s >= 0 for r in records)
    assert [(step, result["loss"]) for step, result in loop.validation] == [(12, 20.0), (15, 50.0)]
    assert recorder.saved == [(12, 2, {"handed": 2}), (14, 4, {"handed": 4})]
    assert ("loss/train", 1.5, 13) in recorder.scalars and ("loss/validation", 50.0, 15) in recorder.scalars
    assert ("input/wait_s", 0.25, 11) in recorder.scalars


def test_a_non_finite_loss_stops_before_validation_or_a_checkpoint():
    recorder = Recorder()
    loop = TrainLoop(fake_step, FakeState(0), init_metrics(), FakeSource([1.0, float("nan")]), recorder,
                     lambda params, fp8_meta: {"loss": 0.0}, eval_every=1, checkpoints=recorder)  # fmt: skip
    loop.step()
    with pytest.raises(FloatingPointError, match="loss became nan at step 1"):
        loop.step()
    assert [step for step, _ in loop.validation] == [1] and [s for s, _, _ in recorder.saved] == []

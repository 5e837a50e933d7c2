"""Training: train state, next-token loss, gradient accumulation and the jitted step (step.py); the device mesh
and the logical-axis rules that lay the step out on it (sharding.py)."""

from jaxscale.train.step import (
    Batch,
    Metrics,
    TrainState,
    abstract_inputs,
    accumulate_gradients,
    batch_gradients,
    batch_shape,
    chunked_next_token_loss,
    init_metrics,
    make_batch,
    make_init_fn,
    make_loss_fn,
    make_model,
    make_optimizer,
    make_train_step,
    next_token_loss,
    train_step,
)

__all__ = [
    "Batch",
    "Metrics",
    "TrainState",
    "abstract_inputs",
    "accumulate_gradients",
    "batch_gradients",
    "batch_shape",
    "init_metrics",
    "make_batch",
    "make_init_fn",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "chunked_next_token_loss",
    "make_loss_fn",
    "next_token_loss",
    "train_step",
]

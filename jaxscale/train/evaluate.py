"""Validation loss: the model without dropout on held-out batches, summed on the device, averaged per token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxscale.model import fp8
from jaxscale.train import offload
from jaxscale.train.sharding import host_scalars
from jaxscale.train.step import Batch, Metrics, make_loss_fn, make_model


def make_eval_step(config: ml_collections.ConfigDict) -> Callable[..., Metrics]:
    """A jitted (params, batch, fp8_meta={}) -> {"loss_sum", "correct", "tokens"} of the model in eval mode (no
    dropout); `fp8_meta`: the train state's delayed FP8 scaling state (model.fp8=delayed), read and not updated.
    With train.offload_params the parameters live in host memory: the step brings them to the device, as the train
    step does (jaxscale.train.offload)."""
    model, loss_fn = make_model(config, train=False), make_loss_fn(config)
    key = jax.random.PRNGKey(0)  # unused without dropout; the loss takes one
    on_host = "params" in offload.parts(config)

    def eval_step(params: Any, batch: Batch, fp8_meta: Any = None) -> Metrics:
        params = offload.to_device(params) if on_host else params
        apply_fn = fp8.with_state(model.apply, fp8_meta) if fp8_meta else model.apply
        _, metrics = loss_fn(params, apply_fn, batch, key)
        return metrics

    return jax.jit(eval_step)


def evaluate(
    eval_step: Callable[..., Metrics], params: Any, batches: Sequence[Batch], fp8_meta: Any = None
) -> dict[str, float]:
    """Mean next-token loss and accuracy over `batches` (each [rows, seq]), per token (`fp8_meta`: make_eval_step's).

    Returns:
      {"loss": nats per token, "accuracy": fraction of tokens predicted exactly, "tokens": tokens evaluated}.
    """
    totals = None
    for batch in batches:
        metrics = eval_step(params, batch, fp8_meta)
        totals = metrics if totals is None else jax.tree_util.tree_map(jnp.add, totals, metrics)
    totals = host_scalars(totals)  # replicated sums: read from this process's shard (works across hosts)
    return {"loss": totals["loss_sum"] / totals["tokens"], "accuracy": totals["correct"] / totals["tokens"],
            "tokens": totals["tokens"]}  # fmt: skip

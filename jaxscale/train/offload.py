"""Host offload of the optimizer state and the trained parameters: kept in host memory between steps (JAX memory
kinds, `pinned_host`), brought to the device inside the jitted step where they are used and sent back.

MaxText's `optimizer_memory_host_offload` / `parameter_memory_host_offload` and DeepSpeed's ZeRO-Offload keep the
same parts on the host; MaxText moves the optimizer state to the device for the update (`jax.device_put(opt_state,
sharding.with_memory_kind("device"))` before `apply_gradients`) with the state's shardings in `pinned_host`, and so
does this module:

- `optimizer.offload_state`: the optimizer's state lives in `pinned_host` (`host_shardings` marks the layout's
  shardings). The update is wrapped (`offloaded_optimizer`): an optimization barrier ties the state to the
  gradients, so it is fetched only once they exist (never during the backward pass, where it would sit on the
  device beside the activations), moved to the device (`to_device`), updated, and moved back (`to_host`).
- `train.offload_params`: the trained parameters live in `pinned_host`; the step marks them for the device at its
  start and sends the updated ones back (`offloaded_step`). What XLA compiles of that for a GPU (the H100 plans,
  tests/measure/test_host_memory.py by hand): no copy of the parameters to the device at all. Every kernel that
  needs a weight reads it from host memory in place (a GPU kernel may read pinned host memory): the casts to the compute
  dtype in each minibatch's forward pass (again in the backward pass for layers it recomputes, under remat, nn.scan or
  model.residuals=closed_form), a few small tensors in the backward pass's reductions, and the optimizer's update (with
  the state, when that is offloaded too); the updated parameters go back to the host once (a device-to-host copy). So
  the device holds no float32 copy of them, only the compute-dtype casts of the layers in flight (the analytic model
  leaves their 4 bytes out of the device peak: jaxscale.measure.memory), and the host link carries them several
  times a step (jaxscale.measure.kernels prices each read). MaxText streams each scanned layer's weights by
  explicit copies instead; that is not built.

The transfers inside the step are written with `jax.memory.Space` (not a sharding's memory kind) on purpose: a
deviceless GPU target's compile-only devices have no memories (`addressable_memories()` is empty), and there a
`NamedSharding(..., memory_kind="pinned_host")` is silently canonicalized to no memory kind, so a program placed
by shardings alone is the all-device program. The memory spaces mark the program either way (XLA's host
offloader gives the arguments they start from the host memory space, S(5)), and on a device with memories the
shardings agree with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax

HOST_KIND = "pinned_host"  # the memory kind the offloaded parts live in between steps (JAX's name)
PARTS = ("opt_state", "params")  # the TrainState fields that can be offloaded


def parts(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The TrainState fields `config` keeps on the host: opt_state (optimizer.offload_state), params
    (train.offload_params)."""
    chosen = {"opt_state": config.optimizer.offload_state, "params": config.train.offload_params}
    return tuple(part for part in PARTS if chosen[part])


def to_device(tree: Any) -> Any:
    """Every array of `tree` in device memory (inside a jitted function: a host-to-device transfer)."""
    return jax.device_put(tree, jax.memory.Space.Device)


def to_host(tree: Any) -> Any:
    """Every array of `tree` in host memory (inside a jitted function: a device-to-host transfer)."""
    return jax.device_put(tree, jax.memory.Space.Host)


def offloaded_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its state kept on the host: each update fetches the state once the gradients exist, updates it on
    the device and sends it back. `init` is tx's (the layout places its result)."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        # The barrier makes the state's transfer depend on the finished gradients: XLA may not prefetch it.
        updates, state = jax.lax.optimization_barrier((updates, state))
        updates, state = tx.update(updates, to_device(state), params, **extra)
        return updates, to_host(state)

    return optax.GradientTransformation(tx.init, update)


def host_shardings(state_shardings: Any, config: ml_collections.ConfigDict) -> Any:
    """A TrainState of NamedShardings with the offloaded fields' (parts(config)) in HOST_KIND memory."""
    moved = {part: jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST_KIND), getattr(state_shardings, part))
             for part in parts(config)}  # fmt: skip
    return state_shardings.replace(**moved)


def offloaded_step(step: Callable, config: ml_collections.ConfigDict) -> Callable:
    """The train step `step(state, metrics, batch, **options)`, with train.offload_params: the trained parameters
    brought to the device at its start and the updated ones sent back to the host at its end (`step` itself
    without it; the optimizer state's transfers are the optimizer's own, `offloaded_optimizer`)."""
    if "params" not in parts(config):
        return step

    def offloaded(state: Any, metrics: Any, batch: Any, **options: Any) -> tuple[Any, Any]:
        state, metrics = step(state.replace(params=to_device(state.params)), metrics, batch, **options)
        return state.replace(params=to_host(state.params)), metrics

    return offloaded

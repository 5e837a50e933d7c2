"""Training: train state, next-token loss, gradient accumulation (loop or lax.scan) and the jitted step."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util
from flax.training import train_state

from jaxscale import model as models
from jaxscale.config import finetune, step_model
from jaxscale.config.spec import accumulates_in_backward
from jaxscale.data.batch import Batch as Batch  # the batch type is the data package's; re-exported
from jaxscale.data.batch import make_batch as make_batch  # as train.Batch and train.make_batch
from jaxscale.model import axes as model_axes
from jaxscale.model import fp8, nf4
from jaxscale.train import backward_accumulation, bf16_weights, fused_step, offload, quantized_state

Metrics = dict[str, jax.Array]  # {"loss_sum", "correct", "tokens"}: float32 scalars, summed


class TrainState(train_state.TrainState):
    """Params, optimizer state and step (from Flax) plus the RNG key that dropout draws from, and the frozen
    parameters (jaxscale.config.finetune): `params` holds what trains (all of them by default), `frozen` the
    rest in finetune.frozen_dtype ({} when everything trains); the model reads both (`model_params`).
    `fp8_meta`: with model.fp8=delayed, Flax's delayed-scaling state (amax histories and scales, the
    jaxscale.model.fp8.OVERWRITE collection), which each step replaces by the value its FP8 ops return ({} without)."""

    rng: jax.Array
    frozen: Any = flax.struct.field(default_factory=dict)
    fp8_meta: Any = flax.struct.field(default_factory=dict)
    # model.param_dtype=bfloat16: optimizer.bf16_rounding (jaxscale.train.bf16_weights), "" for float32 weights; and
    # Kahan's bf16 compensation buffers, like params ({} otherwise)
    bf16_rounding: str = flax.struct.field(pytree_node=False, default="")
    compensation: Any = flax.struct.field(default_factory=dict)

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """One optimizer step. Float32 weights: Flax's (optax's update, then params + updates). bf16 weights without a
        master copy: the gradients in float32 into the optimizer (whose state was made for float32 params:
        make_init_fn), and its float32 update added to the bf16 weights by `bf16_rounding`, the stochastic rounding's
        bits drawn from this step's key."""
        key = jax.random.fold_in(self.rng, 0x5EED)  # the step's key, not the dropout stream it was split into
        params, opt_state, compensation = bf16_weights.optimizer_step(
            self.tx, grads, self.opt_state, self.params, self.bf16_rounding, key, self.compensation or None
        )
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state,
                            compensation={} if compensation is None else compensation, **kwargs)  # fmt: skip


@flax.struct.dataclass
class Fp8Gradients:
    """What the step differentiates and gets back with delayed FP8 scaling: the trained params' gradients, and the
    new delayed-scaling state Flax's FP8 ops return as the "gradient" of their state (jaxscale.model.fp8)."""

    params: Any
    fp8_meta: Any


def _accumulate(total: Any, new: Any) -> Any:
    """Two minibatches' gradients together: summed; delayed-scaling states (each computed from the same old state)
    by their maximum, so the newest amax is the batch's (jaxscale.model.fp8)."""
    if isinstance(total, Fp8Gradients):
        return Fp8Gradients(
            _tree_add(total.params, new.params), jax.tree_util.tree_map(jnp.maximum, total.fp8_meta, new.fp8_meta)
        )
    return _tree_add(total, new)


def _scale(grads: Any, factor: float) -> Any:
    """Gradients multiplied by `factor` (an average's 1/n); a delayed-scaling state left as it is."""
    scaled = lambda tree: jax.tree_util.tree_map(lambda g: g * factor, tree)  # noqa: E731
    return grads.replace(params=scaled(grads.params)) if isinstance(grads, Fp8Gradients) else scaled(grads)


def _on_params(fn: Callable[[Any], Any], grads: Any) -> Any:
    """`fn` (a sharding constraint of the parameters' layout) applied to the gradients of the params only."""
    return grads.replace(params=fn(grads.params)) if isinstance(grads, Fp8Gradients) else fn(grads)


def split_params(params: Any, config: ml_collections.ConfigDict) -> tuple[Any, Any]:
    """(trainable, frozen) halves of a params tree by jaxscale.config.finetune.trainable, the frozen half cast
    to finetune.frozen_dtype (`frozen_leaf`); ({}: nothing frozen) when every parameter trains. Boxed leaves keep
    their box, except NF4 kernels (replicated)."""
    if finetune.trains_everything(config):
        return params, {}
    flat = traverse_util.flatten_dict(params, sep="/")
    train = {k: v for k, v in flat.items() if finetune.trainable(k, config)}
    frozen = {k: frozen_leaf(k, v, config) for k, v in flat.items() if k not in train}
    return traverse_util.unflatten_dict(train, sep="/"), traverse_util.unflatten_dict(frozen, sep="/")


def stored_params(params: Any, config: ml_collections.ConfigDict) -> Any:
    """The trained parameters as the state stores them: float32, or bfloat16 under model.param_dtype=bfloat16 (the
    weights with no master copy; their boxes, where boxed, kept)."""
    dtype = jnp.dtype(config.model.param_dtype)
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def frozen_leaf(path: str, value: Any, config: ml_collections.ConfigDict) -> Any:
    """A frozen parameter as the state stores it: a projection kernel or stacked expert weight under
    finetune.frozen_dtype=nf4 (finetune.nf4_kernel) quantized to NF4 (jaxscale.model.nf4.quantize, each of nn.scan's
    stacked layers and each expert apart: finetune.nf4_stacked), anything else cast to finetune.stored_dtype."""
    if finetune.nf4_kernel(path, config):
        names = finetune.nf4_stacked_names(path, config)
        return nf4.quantize(nn.meta.unbox(value), stacked=len(names), names=names)
    dtype = jnp.dtype(finetune.stored_dtype(config))
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), value)


def param_columns(state: TrainState) -> dict[str, int]:
    """A row's parameter counts of a (real or abstract) state: the model's (`params`) and those that train."""
    return {"params": models.count_params(model_params(state.params, state.frozen)),
            "trainable_params": models.count_params(state.params)}  # fmt: skip


def model_params(params: Any, frozen: Any) -> Any:
    """The model's whole params tree: the trained `params` and the `frozen` ones together."""
    if not frozen:
        return params
    merged = {**traverse_util.flatten_dict(frozen, sep="/"), **traverse_util.flatten_dict(params, sep="/")}
    return traverse_util.unflatten_dict(merged, sep="/")


def batch_shape(config: ml_collections.ConfigDict) -> Batch:
    """Abstract batch (ShapeDtypeStructs) for ahead-of-time lowering."""
    shape = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32)
    return Batch(inputs=shape, labels=shape)


def abstract_inputs(config: ml_collections.ConfigDict, init_fn: Callable[[], TrainState] | None = None):
    """(state, metrics, batch) of the train step as ShapeDtypeStructs, for ahead-of-time lowering.

    Pass the `init_fn` whose real state the compiled step will be called with (see make_init_fn).
    """
    state = jax.eval_shape(init_fn or make_init_fn(config))
    return state, jax.eval_shape(init_metrics), batch_shape(config)


def make_optimizer(opt: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """The reference optimizer: warm-up to the peak, then exponential decay; Adam by default."""
    schedule = optax.warmup_exponential_decay_schedule(
        init_value=0.0,
        peak_value=opt.learning_rate,
        warmup_steps=opt.warmup_steps,
        transition_steps=opt.transition_steps,
        decay_rate=opt.decay_rate,
    )
    # optimizer.state_dtype: the first moment (Adam's mu, SGD's momentum trace) in that dtype, through optax's
    # own mu_dtype / accumulator_dtype; Adam's second moment stays float32 (docs/finetune.md says why).
    mu = None if opt.state_dtype in ("float32", "int8") else jnp.dtype(opt.state_dtype)
    optimizers: dict[str, Callable[[], optax.GradientTransformation]] = {
        "adam": lambda: optax.adam(schedule, b1=opt.b1, b2=opt.b2, mu_dtype=mu),
        "adamw": lambda: optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mu_dtype=mu),
        "sgd": lambda: optax.sgd(schedule, momentum=opt.b1, accumulator_dtype=mu),
        # optax's defaults: factored second moments, no first moment, updates scaled by the parameters' RMS.
        "adafactor": lambda: optax.adafactor(schedule),
    }
    if opt.state_dtype == "int8":  # Adam's two moments block-wise quantized to 8 bits (validated: adam, adamw only)
        decay = opt.weight_decay if opt.name == "adamw" else None
        optimizers[opt.name] = lambda: quantized_state.adam_8bit(schedule, b1=opt.b1, b2=opt.b2, weight_decay=decay)
    tx = optimizers[opt.name]()
    if opt.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip_norm), tx)
    return offload.offloaded_optimizer(tx) if opt.offload_state else tx  # state on the host: jaxscale.train.offload


def make_model(config: ml_collections.ConfigDict, train: bool = True) -> nn.Module:
    """The module of config.model.family (gpt or llama) with the config's hyper-parameters."""
    return models.build(step_model(config), train=train)


def make_init_fn(config: ml_collections.ConfigDict, boxed: bool = False) -> Callable[[], TrainState]:
    """A function that builds the initial train state (float32 params, optimizer state, dropout key; the
    frozen parameters apart, in finetune.frozen_dtype, with no optimizer state: `split_params`).

    The model and optimizer are made once here, so every state the function returns (abstract through
    jax.eval_shape, or real through jax.jit) has the same static fields and fits one compiled step.

    Args:
      config: the run config.
      boxed: keep Flax's `LogicallyPartitioned` boxes around the parameters and the optimizer moments
        that mirror them (jaxscale.train.sharding reads their logical axis names); the default returns
        plain arrays, the state the train step takes.
    """
    model, init_model, tx = make_model(config), make_model(config, train=False), make_optimizer(config.optimizer)

    def init_fn() -> TrainState:
        init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.train.seed))
        tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
        variables = init_model.init(init_rng, tokens)
        params, frozen = split_params(variables["params"], config)
        # the optimizer's state made for the float32 params (its moments float32 whatever model.param_dtype)
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_rng, frozen=frozen,
                                  fp8_meta=variables.get(fp8.OVERWRITE, {}))  # fmt: skip
        if config.model.param_dtype == "bfloat16":  # no float32 master copy: jaxscale.train.bf16_weights
            rounding = config.optimizer.bf16_rounding
            weights = stored_params(params, config)
            compensation = bf16_weights.init_compensation(params, rounding)
            state = state.replace(params=weights, bf16_rounding=rounding, compensation=compensation)
        return state if boxed else nf4.unbox(state)  # an NF4 kernel stays one (its own unbox is its use)

    return init_fn


def init_metrics() -> Metrics:
    return {name: jnp.zeros((), jnp.float32) for name in ("loss_sum", "correct", "tokens")}


def _scored(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy [...] of float32 logits [..., V] against integer labels [...], and the summed
    correct predictions: what both losses (whole and chunked) compute from their logits."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss, (jnp.argmax(logits, axis=-1) == labels).sum().astype(jnp.float32)


def next_token_loss(
    params: Any, apply_fn: Callable, batch: Batch, rng: jax.Array, into: backward_accumulation.Into | None = None
) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy of predicting batch.labels, and the summed metrics of this minibatch. `into`: the
    minibatches' accumulator, which the backward pass adds the layers' and the embedding's gradients into
    (jaxscale.train.backward_accumulation); None: plain."""
    if into is not None:
        apply_fn = backward_accumulation.accumulating(apply_fn, into)
    # [B, T, V] float32; `sown`: a mixture of experts' weighted router losses, added to the loss (none: dense)
    logits, sown = apply_fn({"params": params}, batch.inputs, rngs={"dropout": rng}, mutable=[models.AUX_LOSS])
    loss, correct = _scored(logits, batch.labels)  # [B, T], a scalar
    metrics = {"loss_sum": loss.sum(), "correct": correct, "tokens": jnp.asarray(loss.size, jnp.float32)}
    return models.add_aux_losses(loss.mean(), sown), metrics


def chunked_next_token_loss(
    params: Any,
    apply_fn: Callable,
    batch: Batch,
    rng: jax.Array,
    head_fn: Callable[[Any, jax.Array], jax.Array],
    chunk_len: int,
    into: backward_accumulation.Into | None = None,
) -> tuple[jax.Array, Metrics]:
    """next_token_loss with the output head and the loss computed over chunks of `chunk_len` positions.

    The model runs up to its final norm; a lax.scan then takes each chunk of the sequence (every sequence
    of the batch, so the batch's layout on a mesh is kept), computes its [B, C, V] float32 logits, their
    log-softmax and cross-entropy, and sums them. Each chunk is under jax.checkpoint, so the backward pass
    recomputes its logits instead of keeping them: no [B, T, V] array is ever alive, only one [B, C, V]
    chunk (torchtitan's chunked loss, MaxText's vocabulary tiling). Same function as next_token_loss. `into`: as
    next_token_loss's, the head's gradient added into it too (backward_accumulation.chunks_into).
    """
    if into is not None:
        apply_fn = backward_accumulation.accumulating(apply_fn, into)
    features, sown = apply_fn(
        {"params": params}, batch.inputs, features_only=True, rngs={"dropout": rng}, mutable=[models.AUX_LOSS]
    )  # [B, T, H]; sown: as next_token_loss's
    rows, seq, hidden = features.shape
    chunks = seq // chunk_len
    # [n, B, C, ...]: chunk i holds positions i*C ... (i+1)*C - 1 of every sequence.
    xs = features.reshape(rows, chunks, chunk_len, hidden).swapaxes(0, 1)
    labels = batch.labels.reshape(rows, chunks, chunk_len).swapaxes(0, 1)

    @jax.checkpoint  # keep nothing of a chunk: the backward pass recomputes its logits
    def chunk_sums(params: Any, x: jax.Array, chunk_labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, correct = _scored(head_fn(params, x), chunk_labels)  # [B, C] from [B, C, V] float32 logits
        return loss.sum(), correct

    def body(carry, chunk):
        loss_sum, correct = chunk_sums(params, *chunk)
        return (carry[0] + loss_sum, carry[1] + correct), None

    zero = jnp.zeros((), jnp.float32)
    with jax.named_scope("chunked_loss"):
        if into is None:
            (loss_sum, correct), _ = jax.lax.scan(body, (zero, zero), (xs, labels))
        else:  # the head's parameters alone differentiated in the loop (head_logits reads "embed" or "output")
            path = ("embed",) if "output" not in params else ("output",)
            loss_sum, correct = backward_accumulation.chunks_into(
                into, path, lambda head, x, y: chunk_sums({path[0]: head}, x, y), params[path[0]], xs, labels
            )
    tokens = rows * seq
    metrics = {"loss_sum": loss_sum, "correct": correct, "tokens": jnp.asarray(tokens, jnp.float32)}
    return models.add_aux_losses(loss_sum / tokens, sown), metrics


LossFn = Callable[[Any, Callable, Batch, jax.Array], tuple[jax.Array, Metrics]]


def make_loss_fn(config: ml_collections.ConfigDict) -> LossFn:
    """The step's loss: next_token_loss, or its chunked form when train.loss_chunk_len > 0."""
    chunk_len = config.train.loss_chunk_len
    if not chunk_len:
        return next_token_loss
    head_fn = models.head_fn(step_model(config))
    return functools.partial(chunked_next_token_loss, head_fn=head_fn, chunk_len=chunk_len)


def _tree_add(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, a, b)


def constrain_batch(batch: Batch, leading: tuple[str | None, ...] = ()) -> Batch:
    """Token arrays split along the batch over the mesh (logical ("batch", "seq")); a no-op off a mesh."""
    return jax.tree_util.tree_map(lambda x: nn.with_logical_constraint(x, (*leading, "batch", "seq")), batch)


def accumulate_gradients(
    grad_fn: Callable[[Any, Batch, jax.Array], tuple[Any, Metrics]],
    params: Any,
    batch: Batch,
    rng: jax.Array,
    num_minibatches: int,
    method: str = "scan",
    constrain_grads: Callable[[Any], Any] | None = None,
    into: bool = False,
) -> tuple[Any, Metrics]:
    """Splits the batch into minibatches, averages their gradients and sums their metrics.

    Args:
      grad_fn: (params, minibatch, rng) -> (grads, metrics) for one minibatch.
      params: the parameters differentiated.
      batch: leaves [batch, ...], batch divisible by num_minibatches.
      rng: dropout key; minibatch i uses fold_in(rng, i), the same in both methods.
      num_minibatches: 1 means no accumulation.
      method: "scan" (one lax.scan body, one minibatch's activations live at a time) or "loop" (unrolled,
        the reference; XLA may keep every minibatch's activations alive at once).
      constrain_grads: on a mesh, pins the gradient accumulator to the parameters' layout (FSDP keeps it
        sharded); None off a mesh.
      into: grad_fn takes the accumulator as an optional fourth argument and returns it with the minibatch's
        gradient added (jaxscale.train.backward_accumulation: inside the backward pass); without it, the
        minibatch's gradient alone. Only the scan method's body passes it.
    Returns:
      (grads averaged over minibatches, metrics summed over minibatches); with delayed FP8 scaling (Fp8Gradients)
      the new scaling state is the minibatches' maximum (`_accumulate`).
    """
    if num_minibatches == 1:
        return grad_fn(params, batch, jax.random.fold_in(rng, 0))
    minibatch_size = batch.inputs.shape[0] // num_minibatches
    if method == "loop":
        grads = metrics = None
        for i in range(num_minibatches):
            with jax.named_scope(f"minibatch_{i}"):
                minibatch = jax.tree_util.tree_map(
                    lambda x, i=i: x[i * minibatch_size : (i + 1) * minibatch_size], batch
                )
                step_grads, step_metrics = grad_fn(params, minibatch, jax.random.fold_in(rng, i))
            grads = step_grads if grads is None else _accumulate(grads, step_grads)
            metrics = step_metrics if metrics is None else _tree_add(metrics, step_metrics)
    elif method == "scan":
        # [n, B/n, ...]: minibatch i is rows i*B/n ... (i+1)*B/n - 1, as in the loop.
        minibatches = jax.tree_util.tree_map(lambda x: x.reshape(num_minibatches, minibatch_size, *x.shape[1:]), batch)
        minibatches = constrain_batch(minibatches, leading=(None,))  # on a mesh each minibatch spans every device
        first = jax.tree_util.tree_map(lambda x: x[0], minibatches)
        carry_shape = jax.eval_shape(grad_fn, params, first, rng)  # size the accumulator without running
        carry = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), carry_shape)
        if constrain_grads is not None:
            carry = (constrain_grads(carry[0]), carry[1])

        def body(carry, xs):
            index, minibatch = xs
            with jax.named_scope("minibatch"):
                key = jax.random.fold_in(rng, index)
                if into:  # the accumulator comes back with this minibatch's gradient in it
                    grads, metrics = grad_fn(params, minibatch, key, carry[0])
                    return (grads, _tree_add(carry[1], metrics)), None
                grads, metrics = grad_fn(params, minibatch, key)
                return (_accumulate(carry[0], grads), _tree_add(carry[1], metrics)), None

        (grads, metrics), _ = jax.lax.scan(body, carry, (jnp.arange(num_minibatches), minibatches))
    else:
        raise ValueError(f"train.accumulate: unknown {method!r}; allowed: scan, loop")
    return _scale(grads, 1 / num_minibatches), metrics


@dataclasses.dataclass(frozen=True)
class LocalAccumulation:
    """How a mesh step accumulates gradients on each device and reduces them once a step (data parallelism and
    ZeRO-1/2 with several minibatches; jaxscale.train.sharding.local_accumulation builds it).

    Each minibatch is cut into `count` groups of rows, one per batch-splitting device (the rows that device holds
    anyway), and the gradient is taken per group under `jax.vmap(..., spmd_axis_name=axes)`: the group axis is
    split over `axes`, so a device's gradient is its own rows' and no collective runs inside the accumulation.
    After the last minibatch the groups' gradients are summed: XLA's one all-reduce (or reduce-scatter) a step,
    as PyTorch DDP's `no_sync`, llm.c and Megatron's distributed optimizer accumulate. Each group draws its
    dropout masks from the step's key folded with its index (one mask per device, as every DDP rank does), so
    with dropout the masks differ from the single-device program's; without dropout it is the same function.

    Attributes:
      axes: the mesh axes the groups are split over (those the batch is split over).
      count: the number of groups (the product of those axes' sizes).
      rules: the logical-to-mesh table inside a group (the batch no longer split: the group axis is).
      carry: NamedShardings of the [count, ...] gradient accumulator (each device one whole copy).
    """

    axes: tuple[str, ...]
    count: int
    rules: tuple
    carry: Any


GROUP_AXIS = "device_groups"  # the vmap axis of LocalAccumulation's groups (a statistic over them: model.axes)


def _per_group(grad_fn: Callable, local: LocalAccumulation) -> Callable:
    """`grad_fn` taken per group of rows of its minibatch: gradients and metrics with a leading [count] axis. The
    groups' vmap axis is named (GROUP_AXIS, in jaxscale.model.axes.device_groups while it traces), so that a
    statistic of the whole minibatch (a mixture of experts' load balance) can be averaged over the groups."""

    def grouped(params, minibatch, minibatch_rng, *acc):  # acc: accumulate_gradients' `into` accumulator [count, ...]
        # [B, T] -> [count, B / count, T]: group g holds the rows of the g-th batch-splitting device.
        groups = jax.tree_util.tree_map(lambda x: x.reshape(local.count, -1, *x.shape[1:]), minibatch)
        keys = jax.vmap(lambda g: jax.random.fold_in(minibatch_rng, g))(jnp.arange(local.count))
        axes = (None, 0, 0, *(0,) * len(acc))
        per_group = jax.vmap(grad_fn, in_axes=axes, axis_name=GROUP_AXIS, spmd_axis_name=local.axes)
        with nn.logical_axis_rules(local.rules), model_axes.device_groups(GROUP_AXIS):
            grads, metrics = per_group(params, groups, keys, *acc)
        return _on_params(functools.partial(jax.lax.with_sharding_constraint, shardings=local.carry), grads), metrics

    return grouped


def batch_gradients(
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    num_minibatches: int,
    accumulate: str,
    grad_shardings: Any = None,
    loss_fn: LossFn = next_token_loss,
    local: LocalAccumulation | None = None,
    in_backward: bool = False,
) -> tuple[Any, Metrics]:
    """Gradients of the mean next-token loss over `batch` (accumulated over its minibatches) and the summed
    metrics: the train step's work before the optimizer.

    `in_backward` (jaxscale.config.spec.accumulates_in_backward): with several minibatches, each scanned layer's
    gradient is added into the accumulator inside the backward pass (jaxscale.train.backward_accumulation).

    `grad_shardings` (on a mesh: the parameters' NamedShardings, see jaxscale.train.sharding) pins every
    minibatch's gradients and their accumulator to the parameters' layout; None off a mesh. With `local` and
    several minibatches the accumulator holds each device's own gradients instead (LocalAccumulation), reduced
    to `grad_shardings` once after the last minibatch.
    """

    def constrain_grads(grads: Any) -> Any:
        if grad_shardings is None:
            return grads
        return _on_params(functools.partial(jax.lax.with_sharding_constraint, shardings=grad_shardings), grads)

    def loss_of_trained(trained, minibatch, minibatch_rng, into):  # the frozen params are constants here
        apply_fn, params = state.apply_fn, trained
        if isinstance(trained, Fp8Gradients):  # delayed FP8 scaling: its state differentiated beside the params
            apply_fn, params = fp8.with_state(apply_fn, trained.fp8_meta), trained.params
        accumulating = {} if into is None else {"into": into}
        return loss_fn(model_params(params, state.frozen), apply_fn, minibatch, minibatch_rng, **accumulating)

    def grad_fn(params, minibatch, minibatch_rng, acc=None):
        """The minibatch's gradient; given the accumulator `acc` (accumulate_gradients' `into`), the accumulator
        with it added, the layers' inside the backward pass (jaxscale.train.backward_accumulation)."""
        into = None if acc is None else backward_accumulation.Into(acc)
        (_, step_metrics), grads = jax.value_and_grad(loss_of_trained, has_aux=True)(
            params, constrain_batch(minibatch), minibatch_rng, into
        )
        return (grads if into is None else into.join(grads)), step_metrics

    def constrained_grad_fn(params, minibatch, minibatch_rng, *acc):
        grads, step_metrics = grad_fn(params, minibatch, minibatch_rng, *acc)
        return constrain_grads(grads), step_metrics

    trained = Fp8Gradients(state.params, state.fp8_meta) if state.fp8_meta else state.params
    into = in_backward and num_minibatches > 1 and accumulate == "scan"  # grad_fn given the accumulator
    if local is None or num_minibatches == 1:
        return accumulate_gradients(
            constrained_grad_fn, trained, batch, rng, num_minibatches, accumulate, constrain_grads, into
        )
    carry = functools.partial(_on_params, functools.partial(jax.lax.with_sharding_constraint, shardings=local.carry))
    grads, metrics = accumulate_gradients(
        _per_group(grad_fn, local), trained, batch, rng, num_minibatches, accumulate, carry, into
    )
    with jax.named_scope("reduce_gradients"):  # the step's one sum over the devices that split the batch
        # each group's gradient is of its own rows' mean loss: the batch's is their mean (equal groups); each
        # group's delayed-scaling state saw its own rows: the batch's is their maximum
        mean = lambda tree: jax.tree_util.tree_map(lambda g: g.sum(0) / local.count, tree)  # noqa: E731
        if isinstance(grads, Fp8Gradients):
            grads = Fp8Gradients(mean(grads.params), jax.tree_util.tree_map(lambda m: m.max(0), grads.fp8_meta))
        else:
            grads = mean(grads)
        grads = constrain_grads(grads)
    return grads, jax.tree_util.tree_map(lambda m: m.sum(0), metrics)


def train_step(
    state: TrainState,
    metrics: Metrics,
    batch: Batch,
    num_minibatches: int,
    accumulate: str,
    grad_shardings: Any = None,
    loss_fn: LossFn = next_token_loss,
    local: LocalAccumulation | None = None,
    in_backward: bool = False,
):
    """One optimizer step over `batch`; metrics are added to the running sums (no host sync).

    `grad_shardings`, `loss_fn`, `local`, `in_backward`: see batch_gradients (None off a mesh; the whole-logits
    loss; accumulation after each minibatch's backward).
    """
    rng, step_rng = jax.random.split(state.rng)
    with jax.named_scope("accumulate"):
        grads, step_metrics = batch_gradients(
            state, batch, step_rng, num_minibatches, accumulate, grad_shardings, loss_fn, local, in_backward
        )
    with jax.named_scope("optimizer"):
        # a delayed FP8 scaling state is replaced, never optimized (as flax.training.train_state does)
        if isinstance(grads, Fp8Gradients):
            state = state.apply_gradients(grads=grads.params, rng=rng, fp8_meta=grads.fp8_meta)
        else:
            state = state.apply_gradients(grads=grads, rng=rng)
    return state, _tree_add(metrics, step_metrics)


def step_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """train_step's keyword arguments that the config fixes: accumulation and the loss."""
    return dict(
        num_minibatches=config.train.num_minibatches,
        accumulate=config.train.accumulate,
        loss_fn=make_loss_fn(config),
        in_backward=accumulates_in_backward(config),
    )


def make_train_step(config: ml_collections.ConfigDict) -> Callable:
    """The jitted step (state, metrics, batch) -> (state, metrics), with state and metrics donated: train_step, or with
    optimizer.in_backward the step that updates each layer inside the backward pass (jaxscale.train.fused_step)."""
    if config.optimizer.in_backward:
        step = functools.partial(fused_step.fused_train_step, loss_fn=make_loss_fn(config))
        return jax.jit(step, donate_argnums=(0, 1))
    return jax.jit(functools.partial(train_step, **step_options(config)), donate_argnums=(0, 1))

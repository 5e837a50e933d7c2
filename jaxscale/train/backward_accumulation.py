"""Gradient accumulation inside the backward pass (train.grad_accumulation=in_backward; "auto" where it applies).

A step that accumulates minibatches with `jax.grad` makes each minibatch's whole gradient tree and then adds it to
the accumulator, so the two are whole at once: for nn.scan's stacked layers the backward loop writes every layer's
gradient into a fresh [L, ...] buffer, and the chunked loss's loop sums the head's into a fresh one. PyTorch
accumulates into `param.grad` in place as each gradient is made (DDP's no_sync, Megatron's main_grad buffers); here
the layers' and the chunked head's gradients are made inside the accumulator too, so a step holds one gradient (the
accumulator) and about a layer's more, not two whole gradients (the compiled plans: docs/memory.md):

- the layer stack: the model runs as usual until it calls its stack (a method interceptor, as
  jaxscale.train.fused_step's), and there the stack is one `jax.custom_vjp` function of (stacked parameters,
  accumulator, input). Its forward pass is a `lax.scan` over the layers in which each layer runs under `jax.vjp`:
  the layer's residuals (the remat policy's and the closed form's choice, exactly as under nn.scan) are the loop's
  outputs, except a residual that is one of the layer's own parameters, which the backward reads from the stacked
  parameters instead of a stacked copy. Its backward pass is a reverse `lax.scan` whose carry holds the input's
  cotangent and the accumulator: layer i's VJP is rebuilt from its residuals and its parameter gradient added into
  the accumulator's slice i (a dynamic-update-slice of a loop carry: in place);
- the chunked loss's head (train.loss_chunk_len > 0): a custom_vjp loop over the chunks whose backward recomputes
  each chunk's logits (as jax.checkpoint did) and adds the head's gradient into the accumulator in the loop's carry
  (a tied table's lookup share too: XLA folds the lookup's scatter-add into the running sum).

What each takes comes back as that parameter's gradient, already the accumulator's plus the minibatch's; every
other parameter (the embedding, whose scatter-add XLA already folds into the accumulator, norm scales, biases, GPT's
positions, an unchunked head) is added after the backward pass as before
(`Into.join`). Each layer's dropout key is the stack's key folded with the layer's index (not nn.scan's split): a
different draw of the same distribution; without dropout the function is the same, which
tests/train/test_backward_accumulation.py checks against the plain step's gradients.

A mixture of experts' layers sow their router losses (jaxscale.model.moe): each layer under `jax.vjp` returns its
output and the sum of what it sowed, the stack returns the layers' sum beside its output and sows it once, so the
train step adds it to the loss as it adds nn.scan's per-layer leaves, and the backward pass gives each layer the
sum's cotangent with its output's.

Where it applies (jaxscale.config.spec.accumulates_in_backward, the rule the analytic memory model reads too):
nn.scan's stacked layers, several minibatches under train.accumulate=scan, every parameter trained, no sown state
the step reads back (delayed FP8 scaling); elsewhere, or with train.grad_accumulation=after_backward, each
minibatch's whole gradient is made and then added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxscale import model as models
from jaxscale.model.stack import Transformer, maybe_remat
from jaxscale.train.fused_step import STACK, is_stack_call, subtree


class Into:
    """A minibatch's accumulator (a tree like the trained parameters) and the parts of it the backward pass has
    taken to add its gradients into (`take`, at trace time); `join` makes the new accumulator."""

    def __init__(self, acc: Any):
        self.acc, self.taken = acc, set()

    def take(self, path: tuple[str, ...]) -> Any:
        """The accumulator's part at `path`, which the caller adds its gradient into (the gradient at `path` that
        comes back is then the accumulator's plus the minibatch's)."""
        assert path not in self.taken, f"{'/'.join(path)} is already accumulated into"
        self.taken.add(path)
        return subtree(self.acc, path)

    def join(self, grads: Any) -> Any:
        """The new accumulator: the parts taken as they came back in `grads`, every other leaf added to the old."""

        def leaf(path: tuple, a: jax.Array, g: jax.Array) -> jax.Array:
            keys = tuple(getattr(k, "key", None) for k in path)
            return g if any(keys[: len(t)] == t for t in self.taken) else a + g

        return jax.tree_util.tree_map_with_path(leaf, self.acc, grads)


def _layer_fn(module: Transformer) -> Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """(layer params, input [B, T, H], dropout key, layer index) -> (the layer's output, the sum of the losses it
    sowed into the "aux_loss" collection, a float32 scalar: 0 for a layer that sows none): nn.scan's body, one
    layer."""
    block = maybe_remat(module.block, "Block", module.config)(module.config, module.train)

    def layer(p: Any, h: jax.Array, key: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
        (y, _), sown = block.apply(
            {"params": p}, h, None, rngs={"dropout": jax.random.fold_in(key, index)}, mutable=[models.AUX_LOSS]
        )
        layer.sows = bool(jax.tree_util.tree_leaves(sown))  # known at trace time: whether the stack has losses to sow
        return y, models.add_aux_losses(jnp.zeros((), jnp.float32), sown)

    return layer


def _stack_vjp(layer: Callable, layers: int) -> Callable:
    """The layer stack as a custom_vjp function (params [L, ...], accumulator [L, ...], x, key) -> (output, the
    layers' sown losses summed), whose backward adds each layer's parameter gradient into the accumulator and
    returns it as the params' cotangent."""
    spec: dict = {}  # the residuals' tree structure and which leaves are the layer's own parameters (trace time)

    def forward_scan(params: Any, x: jax.Array, key: jax.Array):
        def body(carry, xs):
            h, losses = carry
            p, index = xs
            (y, loss), pullback = jax.vjp(lambda p_, h_: layer(p_, h_, key, index), p, h)
            leaves, spec["tree"] = jax.tree_util.tree_flatten(pullback)
            own = {id(leaf): n for n, leaf in enumerate(jax.tree_util.tree_leaves(p))}
            spec["own"] = [own.get(id(leaf)) for leaf in leaves]  # a residual that is parameter n: read, not kept
            return (y, losses + loss), [leaf for leaf, n in zip(leaves, spec["own"], strict=True) if n is None]

        return jax.lax.scan(body, (x, jnp.zeros((), jnp.float32)), (params, jnp.arange(layers)))

    @jax.custom_vjp
    def stack(params: Any, acc: Any, x: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        return forward_scan(params, x, key)[0]

    def stack_fwd(params, acc, x, key):
        out, kept = forward_scan(params, x, key)
        return out, (params, acc, kept)

    def stack_bwd(residuals, cotangents):
        params, acc, kept = residuals
        ct_loss = cotangents[1]  # each layer's sown losses enter the sum with the same cotangent

        def body(carry, xs):
            ct, total = carry
            index, kept_i = xs
            own = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a: a[index], params))
            kept_i = iter(kept_i)
            leaves = [next(kept_i) if n is None else own[n] for n in spec["own"]]
            grads, ct = jax.tree_util.tree_unflatten(spec["tree"], leaves)((ct, ct_loss))
            total = jax.tree_util.tree_map(
                lambda a, g: jax.lax.dynamic_update_index_in_dim(a, a[index] + g.astype(a.dtype), index, 0),
                total, grads,
            )  # fmt: skip
            return (ct, total), None

        (ct_x, total), _ = jax.lax.scan(body, (cotangents[0], acc), (jnp.arange(layers), kept), reverse=True)
        return total, None, ct_x, None

    stack.defvjp(stack_fwd, stack_bwd)
    return stack


def accumulating(apply_fn: Callable, into: Into) -> Callable:
    """`apply_fn` whose layer stack (`_stack_vjp`) adds its parameters' gradients into `into`'s accumulator in the
    backward pass."""

    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        def interceptor(next_fun, call_args, call_kwargs, context):
            if is_stack_call(context):
                module = context.module
                params, layers = module.variables["params"]["blocks"], module.config.num_layers
                key = module.make_rng("dropout") if module.train else jax.random.PRNGKey(0)
                layer = _layer_fn(module)
                with jax.named_scope("blocks"):
                    y, losses = _stack_vjp(layer, layers)(params, into.take(STACK), call_args[0], key)
                if layer.sows:  # the layers' losses (a mixture of experts' router losses), summed over layers
                    module.sow(models.AUX_LOSS, "blocks", losses)
                return y
            return next_fun(*call_args, **call_kwargs)

        with nn.intercept_methods(interceptor):
            return apply_fn(variables, *args, **kwargs)

    return apply


def chunks_into(
    into: Into,
    path: tuple[str, ...],
    chunk_sums: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
    head: Any,
    xs: jax.Array,
    labels: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The chunked loss's sums over chunks (loss, correct) of `chunk_sums(head, x_chunk, labels_chunk)`, `head` the
    parameters at `path`, whose backward recomputes each chunk's logits and adds the head's gradient into the
    accumulator's part at `path` in the loop's carry (and gives each chunk's input cotangent)."""
    acc = into.take(path)

    def sums(head: Any, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(carry, chunk):
            loss, correct = chunk_sums(head, *chunk)
            return (carry[0] + loss, carry[1] + correct), None

        zero = jnp.zeros((), jnp.float32)
        return jax.lax.scan(body, (zero, zero), (xs, labels))[0]

    @jax.custom_vjp
    def loop(head: Any, acc: Any, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        return sums(head, xs)

    def loop_fwd(head, acc, xs):
        return sums(head, xs), (head, acc, xs)

    def loop_bwd(residuals, cotangents):
        head, acc, xs = residuals
        ct_loss = cotangents[0]

        def body(total, chunk):
            x, chunk_labels = chunk
            _, pullback = jax.vjp(lambda h_, x_: chunk_sums(h_, x_, chunk_labels)[0], head, x)
            grads, ct_x = pullback(ct_loss)
            return jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), total, grads), ct_x

        total, ct_xs = jax.lax.scan(body, acc, (xs, labels))
        return total, None, ct_xs

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(head, acc, xs)

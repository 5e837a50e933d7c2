"""The optimizer step inside the backward pass (optimizer.in_backward): each scanned layer is updated as soon as its
gradient exists, so the model's whole gradient never does.

torchtune's `optimizer_in_bwd` (one optimizer per parameter, stepped by a post-accumulate-grad hook, the gradient
freed at once) and LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
Resources", arXiv 2306.09782: the update fused into the backward pass) do this in PyTorch; JAX's `jax.grad` returns
the whole gradient tree, so here the step's backward pass is written out by hand over nn.scan's stacked layers:

1. forward: the embedding (under `jax.vjp`), then a `lax.scan` over the layers that keeps only each layer's input
   ([L, B, T, H]: what model.remat=Block keeps), then the head and the loss (under `jax.vjp`);
2. the head's VJP: the head's gradients and the cotangent of the last layer's output; the parameters only the head
   reads (output projection, final norm) are updated here, and their gradients die;
3. a reverse `lax.scan` over the layers whose carry holds the stacked layer parameters, their optimizer state (and
   Kahan's buffers): layer i's forward is recomputed from its saved input under `jax.vjp`, its gradient taken, the
   optimizer applied to layer i's slice of parameters and state, and the result written back into the carry
   (dynamic-update-slice of a loop carry: in place). One layer's gradient exists at a time;
4. the embedding's VJP and the update of the parameters it reads (the token embedding, GPT's positions; with tied
   embeddings the head's share of the table's gradient waits for this).

The optimizer is optax's, called on one layer's (or the outer parameters') view of its state: every subtree of the
state that mirrors the parameters is cut to the same part (its step counts are the whole step's, and the counts
that come back from the last, outer call are kept). That is the same update as the whole tree's for an optimizer
that works per parameter (Adam, AdamW, SGD, the 8-bit Adam: per block of whole layers); global-norm clipping, a
factored optimizer's per-parameter RMS (adafactor over a stacked leaf) and accumulation over minibatches need the
whole gradient and are refused by config validation. Each layer's forward is computed twice (once in step 1, once in
step 3), as model.remat=Block does anyway; with dropout, the layers' masks come from the step's key folded with the
layer's index (not nn.scan's split), a different draw of the same distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxscale.config.defaults import INT8_BLOCK_SIZE
from jaxscale.config.quantization import dynamic_map, moment_blocks
from jaxscale.model.stack import Transformer
from jaxscale.train import bf16_weights, quantized_state
from jaxscale.train.quantized_state import QuantizedMoment

STACK = ("transformer", "blocks")  # where nn.scan's stacked layer parameters live in the params tree
EMBED_READS = ("embed", "pos_emb")  # top-level parameters the embedding reads (the rest outside STACK: the head's)


class _StackInput(Exception):
    """Raised by the interceptor at the layer stack's call: the embedding's output and the stack module."""

    def __init__(self, x: jax.Array, module: Transformer):
        super().__init__("the layer stack's input")
        self.x, self.module = x, module


def is_stack_call(context: Any) -> bool:
    """Whether an interceptor's `context` is the model calling its layer stack (Transformer.__call__)."""
    return isinstance(context.module, Transformer) and context.method_name == "__call__"


def embed_forward(apply_fn: Callable, outer: Any, inputs: jax.Array, rng: jax.Array) -> tuple[jax.Array, Transformer]:
    """The model up to its layer stack: the stack's input [B, T, H] and the stack module (its block class, config and
    train flag), by running the model until it calls the stack (a method interceptor stops it there)."""

    def interceptor(next_fun, args, kwargs, context):
        if is_stack_call(context):
            raise _StackInput(args[0], context.module)
        return next_fun(*args, **kwargs)

    try:
        with nn.intercept_methods(interceptor):
            apply_fn({"params": outer}, inputs, rngs={"dropout": rng})
    except _StackInput as stop:
        return stop.x, stop.module
    raise ValueError("optimizer.in_backward: the model never called its layer stack (model.scan_layers must be true)")


def with_stack_output(apply_fn: Callable, stack_output: jax.Array) -> Callable:
    """`apply_fn` whose layer stack returns `stack_output` instead of computing it: the head and the loss of given
    final-layer activations (the embedding's work is unused and removed by XLA)."""

    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        def interceptor(next_fun, call_args, call_kwargs, context):
            return stack_output if is_stack_call(context) else next_fun(*call_args, **call_kwargs)

        with nn.intercept_methods(interceptor):
            return apply_fn(variables, *args, **kwargs)

    return apply


def _mirrors(treedef: Any) -> Callable[[Any], bool]:
    """Whether a node of an optimizer state has `treedef`'s structure as a prefix (a moment tree of those params)."""

    def test(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        try:
            treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            return False
        return True

    return test


def subtree(tree: Any, path: tuple[str, ...]) -> Any:
    """The part of a nested dict `tree` at `path` (STACK: the stacked layers')."""
    for key in path:
        tree = tree[key]
    return tree


def _without(tree: dict, path: tuple[str, ...]) -> dict:
    """A copy of the nested dict `tree` without `path` (and without a parent left empty)."""
    head, *rest = path
    if not rest:
        return {k: v for k, v in tree.items() if k != head}
    inner = _without(tree[head], tuple(rest))
    return {k: v for k, v in tree.items() if k != head} | ({head: inner} if inner else {})


def _with(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    head, *rest = path
    return {**tree, head: value if not rest else _with(tree.get(head, {}), tuple(rest), value)}


def _by_layer(leaf: Any, param: jax.Array, signed: bool) -> Any:
    """A stacked optimizer-state leaf with its layers on a leading axis, for a loop over the layers: an array as it is
    ([L, ...]); an 8-bit moment whose layers are whole blocks as it is too (its blocks start after the layers' axis,
    jaxscale.config.quantization.moment_blocks, so its codes and absmax are [L, ...] and layer l's are a layer's
    8-bit moment); an 8-bit moment whose layers are not (a small stacked bias or norm: under 2048 elements a layer)
    dequantized to float32 like its parameter `param` (the update dequantizes it anyway; `_stacked` quantizes it
    back, block for block as the whole tree's step does). `signed`: the first moment's map (True) or the second's."""
    if not isinstance(leaf, QuantizedMoment) or (moment_blocks(param.shape, INT8_BLOCK_SIZE) or 0) > 0:
        return leaf
    return quantized_state.dequantize_blockwise(leaf, dynamic_map(signed), param.shape)


def _stacked(leaf: Any, before: Any, signed: bool) -> Any:
    """_by_layer's inverse (`before`: the leaf as the state held it)."""
    if not isinstance(before, QuantizedMoment) or isinstance(leaf, QuantizedMoment):
        return leaf
    return quantized_state.quantize_blockwise(leaf, dynamic_map(signed))


def _is_moment(x: Any) -> bool:
    return isinstance(x, QuantizedMoment)


def _at(tree: Any, index: jax.Array) -> Any:
    """Layer `index` of a tree of stacked leaves (an 8-bit moment in _by_layer's form: its codes' and scales' row)."""
    return jax.tree_util.tree_map(lambda a: a[index], tree)


def _put(tree: Any, new: Any, index: jax.Array) -> Any:
    """`tree` with layer `index` replaced by `new` (a dynamic-update-slice: in place in a loop's carry)."""
    return jax.tree_util.tree_map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), index, 0),
                                  tree, new)  # fmt: skip


class _StateParts:
    """An optimizer state cut into the subtrees that mirror the parameters (`nodes`) and the rest (step counts):
    `view(nodes)` rebuilds a state with other nodes in their place (a part's, for a part of the parameters),
    `nodes_of(state)` reads them back from such a state, `counts_of(state)` its other leaves."""

    def __init__(self, opt_state: Any, params_def: Any):
        paths, self.skeleton = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_mirrors(params_def))
        leaves = [leaf for _, leaf in paths]
        self.mirrored = [_mirrors(params_def)(leaf) for leaf in leaves]
        # each node's 8-bit map: the second moment's (Adam's nu) unsigned, any other signed
        self.signed = [getattr(path[-1], "name", None) != "nu" for (path, leaf), m in zip(paths, self.mirrored,
                                                                                       strict=True) if m]  # fmt: skip
        self.nodes = [leaf for leaf, m in zip(leaves, self.mirrored, strict=True) if m]
        self.counts = [leaf for leaf, m in zip(leaves, self.mirrored, strict=True) if not m]

    def view(self, nodes: list, counts: list | None = None) -> Any:
        nodes, counts = iter(nodes), iter(self.counts if counts is None else counts)
        return self.skeleton.unflatten([next(nodes) if m else next(counts) for m in self.mirrored])

    def nodes_of(self, state: Any) -> list:
        leaves = self.skeleton.flatten_up_to(state)
        return [leaf for leaf, m in zip(leaves, self.mirrored, strict=True) if m]

    def counts_of(self, state: Any) -> list:
        leaves = self.skeleton.flatten_up_to(state)
        return [leaf for leaf, m in zip(leaves, self.mirrored, strict=True) if not m]


def _pick(tree: dict, names: tuple[str, ...]) -> dict:
    return {name: tree[name] for name in names}


def fused_train_step(state: Any, metrics: dict, batch: Any, loss_fn: Callable, paged: bool = False) -> tuple[Any, dict]:
    """One optimizer step over `batch` (one minibatch) with each layer's update inside the backward pass: the same
    parameters and optimizer state as jaxscale.train.step.train_step's (for the optimizers and fields validation
    allows), and the batch's metrics added to the running sums. `loss_fn`: jaxscale.train.step.make_loss_fn's."""
    rng, step_rng = jax.random.split(state.rng)
    dropout = jax.random.fold_in(step_rng, 0)  # the one minibatch's key, as accumulate_gradients draws it
    update_key = jax.random.fold_in(state.rng, 0x5EED)  # the step's rounding key, as TrainState.apply_gradients's
    tx, rounding, params = state.tx, state.bf16_rounding, state.params
    stacked, outer = subtree(params, STACK), _without(params, STACK)
    layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    embed_names = tuple(name for name in outer if name in EMBED_READS)
    head_names = tuple(name for name in outer if name not in EMBED_READS)
    parts = _StateParts(state.opt_state, jax.tree_util.tree_structure(params))
    compensation = state.compensation or None  # Kahan's buffers, like params

    def step_on(part_params: Any, grads: Any, key: jax.Array, nodes: list, part_compensation: Any = None):
        """The optimizer on one part of the parameters, given that part's state `nodes`: (params, state view,
        compensation), new."""
        return bf16_weights.optimizer_step(tx, grads, parts.view(nodes), part_params, rounding, key, part_compensation)

    # 1. forward: the embedding (its VJP kept), each layer keeping only its input, the head and loss (VJP kept)
    captured = {}

    def embedding(embed_params: dict) -> jax.Array:
        x, captured["stack"] = embed_forward(state.apply_fn, {**outer, **embed_params}, batch.inputs, dropout)
        return x

    with jax.named_scope("embed"):
        x, embed_vjp = jax.vjp(embedding, _pick(outer, embed_names))
    stack = captured["stack"]
    block = stack.block(stack.config, stack.train)

    def layer(p: Any, h: jax.Array, index: jax.Array) -> jax.Array:
        return block.apply({"params": p}, h, None, rngs={"dropout": jax.random.fold_in(dropout, index)})[0]

    def forward(h: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        p, index = xs
        return layer(p, h, index), h

    with jax.named_scope("layers_forward"):
        top, inputs = jax.lax.scan(forward, x, (stacked, jnp.arange(layers)))  # inputs: [L, B, T, H]

    def head_loss(o: dict, h: jax.Array):
        return loss_fn(o, with_stack_output(state.apply_fn, h), batch, dropout)

    with jax.named_scope("head"):
        loss, head_vjp, step_metrics = jax.vjp(head_loss, outer, top, has_aux=True)
        head_grads, cotangent = head_vjp(jnp.ones_like(loss))

    # 2. the parameters only the head reads, updated before the layers' backward pass (the barrier orders it)
    with jax.named_scope("head_update"):
        new_head, head_view, head_compensation = step_on(
            _pick(outer, head_names), _pick(head_grads, head_names), jax.random.fold_in(update_key, layers),
            [_pick(node, head_names) for node in parts.nodes],
            part_compensation=None if compensation is None else _pick(compensation, head_names),
        )  # fmt: skip
        new_head, head_view, head_compensation, cotangent = jax.lax.optimization_barrier(
            (new_head, head_view, head_compensation, cotangent)
        )

    # 3. the layers, last to first: recompute, differentiate, update in place
    def backward(carry: tuple, xs: tuple) -> tuple[tuple, list | None]:
        cot, layer_params, nodes, layer_compensation = carry
        h, index, streamed = xs
        p = _at(layer_params, index)
        _, vjp = jax.vjp(lambda p_, h_: layer(p_, h_, index), p, h)
        grads, cot = vjp(cot)
        new_p, new_view, new_compensation = step_on(
            p, grads, jax.random.fold_in(update_key, index),
            streamed if paged else [_at(node, index) for node in nodes],
            part_compensation=None if layer_compensation is None else _at(layer_compensation, index),
        )  # fmt: skip
        # the barrier makes every new slice whole before any is written back (XLA:CPU copies the loop's carry
        # regardless, so there the step holds more than the plain one: docs/finetune.md); paged, the new slices
        # are host arrays already and stay out of it
        new_nodes = parts.nodes_of(new_view)
        if paged:  # the new slices are host arrays (the optimizer sent them), the loop's output
            new_p, new_compensation = jax.lax.optimization_barrier((new_p, new_compensation))
        else:
            new_p, new_nodes, new_compensation = jax.lax.optimization_barrier((new_p, new_nodes, new_compensation))
            nodes = [_put(node, new, index) for node, new in zip(nodes, new_nodes, strict=True)]
        if layer_compensation is not None:
            layer_compensation = _put(layer_compensation, new_compensation, index)
        return (cot, _put(layer_params, new_p, index), nodes, layer_compensation), new_nodes if paged else None

    def by_layer(node: Any, signed: bool) -> Any:
        return jax.tree_util.tree_map(lambda leaf, p: _by_layer(leaf, p, signed), subtree(node, STACK), stacked,
                                      is_leaf=_is_moment)  # fmt: skip

    layer_nodes = [by_layer(node, signed) for node, signed in zip(parts.nodes, parts.signed, strict=True)]
    layer_compensation = None if compensation is None else subtree(compensation, STACK)
    carried, streamed = ([], layer_nodes) if paged else (layer_nodes, None)
    with jax.named_scope("layers_backward"):
        (cotangent, new_stack, carried, layer_compensation), pages = jax.lax.scan(
            backward, (cotangent, stacked, carried, layer_compensation), (inputs, jnp.arange(layers), streamed),
            reverse=True,
        )  # fmt: skip
    layer_nodes = pages if paged else carried
    layer_nodes = [jax.tree_util.tree_map(lambda before, leaf, signed=signed: _stacked(leaf, before, signed),
                                          subtree(node, STACK), new, is_leaf=_is_moment)
                   for node, new, signed in zip(parts.nodes, layer_nodes, parts.signed, strict=True)]  # fmt: skip

    # 4. the embedding's gradient (with the head's share of a tied table) and its parameters' update
    with jax.named_scope("embed_update"):
        (embed_grads,) = embed_vjp(cotangent)
        embed_grads = jax.tree_util.tree_map(jnp.add, embed_grads, _pick(head_grads, embed_names))
        new_embed, embed_view, embed_compensation = step_on(
            _pick(outer, embed_names), embed_grads, jax.random.fold_in(update_key, layers + 1),
            [_pick(node, embed_names) for node in parts.nodes],
            part_compensation=None if compensation is None else _pick(compensation, embed_names),
        )  # fmt: skip

    def whole(head_part: dict, stack_part: Any, embed_part: dict) -> dict:
        return _with({**head_part, **embed_part}, STACK, stack_part)

    nodes = [whole(h, s, e) for h, s, e in zip(parts.nodes_of(head_view), layer_nodes, parts.nodes_of(embed_view),
                                               strict=True)]  # fmt: skip
    opt_state = parts.view(nodes, parts.counts_of(embed_view))  # the counts: each call's are the step's
    new_params = whole(new_head, new_stack, new_embed)
    new_compensation = {} if compensation is None else whole(head_compensation, layer_compensation, embed_compensation)
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=opt_state,
                              compensation=new_compensation, rng=rng)  # fmt: skip
    return new_state, jax.tree_util.tree_map(jnp.add, metrics, step_metrics)

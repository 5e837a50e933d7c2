"""The mixture of experts (jaxscale.model.moe): the router against NumPy, the three dispatches computing the same
loss and gradients, dropped tokens counted, the router losses in the train loss (scanned or not), the dense model
untouched, the presets' parameters and the FLOPs counted by hand, the analytic state under expert parallelism
against the layout's shards, and one-line errors for what is not built."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, load_config, loss_and_grads, slow_except, stack_layers

from jaxscale import train
from jaxscale.config import ConfigError, base_config, step_model, validate
from jaxscale.measure import flops, memory, params
from jaxscale.model import count_params, moe
from jaxscale.model.llama import qk_norm, rms_norm
from jaxscale.plan import gpu_plan


def _moe(**model_fields):
    """tiny-moe in float32 (4 experts of width 32, 2 per token), with `model_fields` changed."""
    config = base_config("tiny-moe", "moe")
    config.model.dtype = "float32"
    config.model.update(model_fields)
    validate(config)
    return config


def _batch(config, rows: int = 4):
    return train.make_batch(jax.random.PRNGKey(1), rows, config.data.seq_len, config.model.vocab_size)


def _params(config):
    return train.make_init_fn(config)().params


# --- the router, against NumPy ---------------------------------------------------------------------------------


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk", "softmax_topk_norm"])
def test_routing_weights_are_each_models_normalisation(routing):
    """Mixtral: softmax of the top-k logits; OLMoE: top k of the softmax over all experts; Qwen3: the same
    renormalised. NumPy, one token at a time (float64), at 1e-6."""
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 5, 8)), np.float64)
    weights, experts = moe.route(jnp.asarray(logits, jnp.float32), 3, routing)
    for token, row in zip(np.ndindex(3, 5), logits.reshape(-1, 8), strict=True):
        top = np.argsort(-row)[:3]
        assert list(np.asarray(experts[token])) == list(top)
        if routing == "topk_softmax":
            expected = _np_softmax(row[top])
        else:
            expected = _np_softmax(row)[top]
            if routing == "softmax_topk_norm":
                expected = expected / expected.sum()
        np.testing.assert_allclose(np.asarray(weights[token]), expected, rtol=1e-6)


def test_mixtral_routing_equals_qwen3s_renormalised_softmax():
    """The softmax of the top-k logits is the top k of the full softmax renormalised (exp(l_i - lse) / sum over the
    top k): HF's Mixtral computes the latter; both names give the same numbers, at 1e-6."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (64, 16)) * 3
    a, b = moe.route(logits, 4, "topk_softmax"), moe.route(logits, 4, "softmax_topk_norm")
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), rtol=1e-6)


def test_load_balancing_and_z_loss_against_numpy():
    """HF's load_balancing_loss_func (a token counts once per chosen expert) and ST-MoE's z-loss, written in NumPy;
    a uniform router scores k (here 2), a router sending every token to the same two experts scores E (4)."""
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (6, 10, 4)), np.float64) * 2
    _, experts = moe.route(jnp.asarray(logits, jnp.float32), 2, "topk_softmax")
    mask = np.zeros((60, 4))
    for n, chosen in enumerate(np.asarray(experts).reshape(60, 2)):
        mask[n, chosen] = 1
    expected = 4 * np.sum(mask.mean(0) * _np_softmax(logits).reshape(60, 4).mean(0))
    got = moe.load_balancing_loss(jnp.asarray(logits, jnp.float32), experts)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(moe.z_loss(jnp.asarray(logits, jnp.float32))), np.mean(lse**2), rtol=1e-5)
    uniform = jnp.zeros((10, 4))  # P_e = 1/4 whatever the choices: E x sum_e f_e / E = k
    assert float(moe.load_balancing_loss(uniform, moe.route(uniform, 2, "topk_softmax")[1])) == pytest.approx(2.0)
    collapsed = jnp.tile(jnp.asarray([[9.0, 9.0, 0.0, 0.0]]), (10, 1))  # f = P = (1, 1, 0, 0) and (.5, .5, 0, 0)
    collapsed_loss = moe.load_balancing_loss(collapsed, moe.route(collapsed, 2, "topk_softmax")[1])
    assert float(collapsed_loss) == pytest.approx(4.0, rel=1e-3)


def _np_balance(logits: np.ndarray, experts: np.ndarray) -> float:
    """HF's load_balancing_loss_func over the tokens of `logits` [..., E] with `experts` [..., k], in NumPy."""
    num_experts, k = logits.shape[-1], experts.shape[-1]
    mask = np.zeros((experts.size // k, num_experts))
    for n, chosen in enumerate(experts.reshape(-1, k)):
        mask[n, chosen] = 1
    return num_experts * np.sum(mask.mean(0) * _np_softmax(logits).reshape(-1, num_experts).mean(0))


@pytest.mark.parametrize("groups", [2, 3, 6])
def test_the_balance_loss_per_group_is_the_mean_of_each_groups_own(groups):
    """model.moe_balance_scope device / sequence: the rows split into `groups` equal groups, each group's f and P its
    own (NumPy, as above), the products averaged; not the whole batch's product (the two differ here by > 1%)."""
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (6, 10, 4)), np.float64) * 2
    _, experts = moe.route(jnp.asarray(logits, jnp.float32), 2, "topk_softmax")
    experts = np.asarray(experts)
    per = 6 // groups
    expected = np.mean([_np_balance(logits[g * per : (g + 1) * per], experts[g * per : (g + 1) * per])
                        for g in range(groups)])  # fmt: skip
    got = moe.load_balancing_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(experts), groups)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    assert abs(expected - _np_balance(logits, experts)) > 0.01 * expected
    assert moe.balance_groups("sequence", 6) == 6 and moe.balance_groups("minibatch", 6) == 1
    assert moe.balance_groups("device", 6) == 1  # no mesh in context: one device holds every row


# --- the layer against a NumPy reference, the dispatches against each other -----------------------------------


def _layer(config, dispatch: str, rows: int = 2):
    """A standalone MoE layer of `config` (params and input drawn at random) applied with `dispatch`."""
    cfg = step_model(config)
    x = jax.random.normal(jax.random.PRNGKey(5), (rows, config.data.seq_len, cfg.hidden_size))
    variables = nn.meta.unbox(moe.MoE(cfg, train=False).init(jax.random.PRNGKey(6), x))
    layer = moe.MoE(dataclasses.replace(cfg, moe_dispatch=dispatch), train=False)
    out, sown = layer.apply(variables, x, mutable=[moe.METRICS])
    return x, variables["params"], out, sown


def _np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * scale


def test_dense_dispatch_is_the_routed_swiglu_sum_in_numpy():
    """Each token: RMSNorm, router softmax over all experts renormalised over its top 2 (Mixtral), the sum of the
    chosen experts' down(silu(gate) * up) weighted; NumPy float64, one token at a time, at 1e-5."""
    config = _moe()
    x, p, out, _ = _layer(config, "dense")
    x, p = np.asarray(x, np.float64), jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    h = _np_rms(x, p["pre_norm"]["scale"], config.model.norm_epsilon)
    expected = np.zeros_like(x)
    for b, t in np.ndindex(*x.shape[:2]):
        probs = _np_softmax(h[b, t] @ p["router"]["kernel"])
        top = np.argsort(-probs)[:2]
        for e, weight in zip(top, probs[top] / probs[top].sum(), strict=True):
            gate, up = h[b, t] @ p["experts"]["gate"][e], h[b, t] @ p["experts"]["up"][e]
            hidden = gate / (1 + np.exp(-gate)) * up
            expected[b, t] += weight * (hidden @ p["experts"]["down"][e])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


def _np_dropped(experts: np.ndarray, slots: int, num_experts: int) -> tuple[int, np.ndarray]:
    """GShard's priority in NumPy: per sequence, every token's first choice (in order), then every second choice;
    an expert takes `slots` of them. Returns (dropped choices, kept mask [B, T, k])."""
    kept = np.zeros(experts.shape, bool)
    for b in range(experts.shape[0]):
        load = np.zeros(num_experts, int)
        for i in range(experts.shape[2]):
            for t in range(experts.shape[1]):
                e = experts[b, t, i]
                if load[e] < slots:
                    load[e] += 1
                    kept[b, t, i] = True
    return int((~kept).sum()), kept


@pytest.mark.parametrize("dispatch", ["capacity", "scatter"])
def test_capacity_drops_past_the_slots_and_counts_the_drops(dispatch):
    """Factor 0.5: 32 tokens x 2 choices / 4 experts x 0.5 = 8 slots an expert per sequence. The sown count is
    NumPy's priority rule's, and the output is the dense layer's without the dropped choices (recomputed here from
    the dense layer's per-expert terms), for the one-hot einsums and for the scatter and gather alike."""
    config = _moe(moe_capacity_factor=0.5)
    assert moe.capacity(32, 2, 4, 0.5) == 8
    x, p, out, sown = _layer(config, dispatch)
    h = rms_norm(step_model(config), "n").apply({"params": p["pre_norm"]}, x)
    weights, experts = moe.route(h @ p["router"]["kernel"], 2, "topk_softmax")
    dropped, kept = _np_dropped(np.asarray(experts), 8, 4)
    assert dropped > 0 and float(sown[moe.METRICS]["dropped"][0]) == dropped
    w = {name: p["experts"][name] for name in ("gate", "up", "down")}
    kept_weights = jnp.where(jnp.asarray(kept), weights, 0.0)  # a dropped choice adds nothing
    np.testing.assert_allclose(np.asarray(out), np.asarray(moe.dense_dispatch(h, kept_weights, experts, w)),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


# Tolerances of the dispatch comparisons (float32): the same products summed in other orders.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize(
    "dispatch, routing",
    slow_except([(d, r) for d in ("capacity", "scatter", "ragged") for r in ("topk_softmax", "softmax_topk")],
                lambda case: case in {("capacity", "topk_softmax"), ("scatter", "softmax_topk"),
                                      ("ragged", "softmax_topk")}),
)  # fmt: skip
def test_dispatches_compute_the_dense_reference_loss_and_gradients(dispatch, routing):
    """Capacity with factor E / k (= 2: every expert can take every token, so none drops) and dropless ragged give
    the dense dispatch's loss and every parameter's gradient (router included, through the routing weights and
    the load-balancing and z losses), float32, at rtol 1e-5 / atol 1e-6."""
    fields = dict(moe_routing=routing, moe_capacity_factor=2.0, moe_aux_loss_weight=0.1, moe_z_loss_weight=0.01)
    config, reference = _moe(moe_dispatch=dispatch, **fields), _moe(moe_dispatch="dense", **fields)
    params_, batch = _params(reference), _batch(reference)
    loss, grads = loss_and_grads(config, params_, batch)
    expected_loss, expected_grads = loss_and_grads(reference, params_, batch)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=RTOL)
    assert_trees_close(grads, expected_grads, rtol=RTOL, atol=ATOL)
    router_grad = grads["transformer"]["block_0"]["mlp"]["router"]["kernel"]
    assert float(jnp.abs(router_grad).max()) > 1e-4  # the routing is differentiated, not constant
    if dispatch in ("capacity", "scatter"):
        _, _, _, sown = _layer(config, dispatch)
        assert float(sown[moe.METRICS]["dropped"][0]) == 0.0


def test_scatter_dispatch_drops_as_capacity_does_with_the_same_loss_and_gradients():
    """At factor 0.5 (8 slots an expert, some choices dropped) the scatter and gather give the one-hot einsums'
    loss and every gradient: the same function, dropped choices included."""
    fields = dict(moe_capacity_factor=0.5, moe_aux_loss_weight=0.1)
    config, reference = _moe(moe_dispatch="scatter", **fields), _moe(moe_dispatch="capacity", **fields)
    params_, batch = _params(reference), _batch(reference)
    loss, grads = loss_and_grads(config, params_, batch)
    expected_loss, expected_grads = loss_and_grads(reference, params_, batch)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=RTOL)
    assert_trees_close(grads, expected_grads, rtol=RTOL, atol=ATOL)
    _, _, _, sown = _layer(config, "scatter")
    assert float(sown[moe.METRICS]["dropped"][0]) > 0


@pytest.mark.parametrize("group", [1, 3])
def test_move_rows_gradient_is_the_gathers_transpose_without_a_scatter(group):
    """move_rows against JAX's own autodiff of the same gather (take_along_axis on the rows with a zero row after
    them, whose transpose is a scatter-add): result rows read source rows, each source row read by at most `group`
    of them (the dispatch: a token by its k slots; the combine: a slot by one choice), some by none, some result rows
    reading the zero row (a dropped choice, an empty slot). Same value and gradient (float32), and the gradient's
    program holds no scatter, which is what keeps an unrolled layer from holding a zero buffer from its forward pass
    to its backward (docs/measurements.md, the OLMoE paragraph)."""
    rng = np.random.default_rng(0)
    batch, rows, hidden, read = 2, 10, 4, 7  # `read` of the source rows are read, each by `group` result rows
    index = np.stack([rng.permutation(np.concatenate([np.repeat(rng.permutation(rows)[:read], group), [rows] * 2]))
                      for _ in range(batch)]).astype(np.int32)  # fmt: skip
    back = np.full((batch, rows * group), index.shape[1], np.int32)  # by hand: where each source row went
    for b, m in np.ndindex(batch, rows):
        went = np.flatnonzero(index[b] == m)
        back[b, m * group : m * group + len(went)] = went
    x = jnp.asarray(rng.standard_normal((batch, rows, hidden)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((batch, index.shape[1], hidden)), jnp.float32)

    def plain(x):
        padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
        return (jnp.take_along_axis(padded, jnp.asarray(index)[..., None], axis=1) * weights).sum()

    def moved(x):
        return (moe.move_rows(x, jnp.asarray(index), jnp.asarray(back), group) * weights).sum()

    np.testing.assert_allclose(float(moved(x)), float(plain(x)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(moved)(x)), np.asarray(jax.grad(plain)(x)), rtol=1e-6, atol=1e-6)
    assert "scatter" in str(jax.make_jaxpr(jax.grad(plain))(x))
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(moved))(x))


def _compiled_flops(fn, *shapes) -> float:
    """FLOPs of `fn` on bf16 arguments of `shapes` from XLA's cost analysis of the compiled program (no data)."""
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


def test_the_one_hot_einsums_cost_more_than_qwen3s_experts_as_docs_say():
    """docs/models.md's figures for Qwen3-30B-A3B at sequence 4096 (128 experts, 8 a token, H 2048, F 768, factor
    1.25): XLA's cost analysis of one dispatch einsum [T, E, C] x [T, H] and of the experts' three forward matmuls
    on the T x k routed copies, against the sentence's 6.9e11 and 3.1e11."""
    t, e, k, h, f = 4096, 128, 8, 2048, 768
    c = moe.capacity(t, k, e, 1.25)
    einsum = _compiled_flops(lambda d, x: jnp.einsum("tec,th->ech", d, x), (t, e, c), (t, h))
    experts = 3 * _compiled_flops(lambda x, w: x @ w, (t * k, h), (h, f))
    text = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    written = (f"each einsum is {einsum:.1e} FLOPs", f"forward matmuls, {experts:.1e})")
    assert all(phrase.replace("e+", "e") in " ".join(text.split()) for phrase in written)


# --- the router losses in the train loss; the dense model untouched --------------------------------------------


def _router_logits(config, params_, batch) -> list[np.ndarray]:
    """Each layer's router logits, captured from the model's modules (capture_intermediates)."""
    model = train.make_model(config, train=False)
    _, state = model.apply({"params": params_}, batch.inputs, capture_intermediates=True)
    blocks = state["intermediates"]["transformer"]
    return [np.asarray(blocks[f"block_{i}"]["mlp"]["router"]["__call__"][0], np.float64) for i in range(2)]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_train_loss_adds_the_weighted_router_losses_averaged_over_layers(scan_layers):
    """next_token_loss = cross-entropy of the logits + 0.1 x mean over layers of HF's load-balancing loss + 0.01 x
    mean of ST-MoE's z-loss, both written in NumPy from the captured router logits; scanned layers (the sown
    collection stacked by nn.scan) give the same, at 1e-5."""
    config = _moe(moe_aux_loss_weight=0.1, moe_z_loss_weight=0.01)
    params_, batch = _params(config), _batch(config)
    logits = train.make_model(config, train=False).apply({"params": params_}, batch.inputs)
    cross_entropy = float(optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels).mean())
    balance, zloss = [], []
    for layer in _router_logits(config, params_, batch):
        flat = layer.reshape(-1, 4)
        top = np.argsort(-flat, axis=-1)[:, :2]
        mask = np.zeros_like(flat)
        np.put_along_axis(mask, top, 1.0, axis=-1)
        balance.append(4 * np.sum(mask.mean(0) * _np_softmax(flat).mean(0)))
        zloss.append(np.mean(np.log(np.exp(flat).sum(-1)) ** 2))
    expected = cross_entropy + 0.1 * np.mean(balance) + 0.01 * np.mean(zloss)
    if scan_layers:
        config.model.scan_layers = True
        params_ = stack_layers(params_, 2)
    loss, _ = loss_and_grads(config, params_, batch)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(loss) - cross_entropy > 0.1  # the router losses are in it (about 0.1 x k = 0.2 at init)


def test_the_chunked_loss_adds_the_router_losses_too():
    """train.loss_chunk_len=8: the chunked head and loss give the whole-logits loss, router losses included, at
    float32 rtol 1e-6."""
    config = _moe(moe_z_loss_weight=0.01)
    params_, batch = _params(config), _batch(config)
    whole = float(loss_and_grads(config, params_, batch)[0])
    config.train.loss_chunk_len = 8
    model, loss_fn = train.make_model(config), train.make_loss_fn(config)
    chunked = jax.jit(lambda p: loss_fn(p, model.apply, batch, jax.random.PRNGKey(0))[0])(params_)
    np.testing.assert_allclose(float(chunked), whole, rtol=1e-6)
    logits = model.apply({"params": params_}, batch.inputs, rngs={"dropout": jax.random.PRNGKey(0)})
    assert whole - float(optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels).mean()) > 0.005


def test_remat_of_the_moe_keeps_its_losses_and_gradients():
    """nn.remat around the MoE ("MLP") and the whole block recompute it and still sow its losses: loss and
    gradients equal the plain model's, float32, at rtol 1e-5."""
    config = _moe(moe_z_loss_weight=0.01)
    params_, batch = _params(config), _batch(config)
    expected = loss_and_grads(config, params_, batch)
    for remat in (("MLP",), ("Block",)):
        loss, grads = loss_and_grads(_moe(moe_z_loss_weight=0.01, remat=remat), params_, batch)
        np.testing.assert_allclose(float(loss), float(expected[0]), rtol=1e-5)
        assert_trees_close(grads, expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_dense_model_computes_exactly_what_it_did(scan_layers):
    """tiny-llama's train loss and gradients equal, bit for bit, those of the plain function the step computed
    before MoE: the mean cross-entropy of the model's logits (nothing sown, nothing added), scanned or not."""
    config = base_config("tiny-llama", "dense")
    config.model.update(dtype="float32", dropout_rate=0.0, scan_layers=scan_layers)
    params_, batch = _params(config), _batch(config)
    model = train.make_model(config)

    def plain(p):
        logits = model.apply({"params": p}, batch.inputs, rngs={"dropout": jax.random.PRNGKey(0)})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels).mean()

    loss, grads = loss_and_grads(config, params_, batch)
    expected_loss, expected_grads = jax.jit(jax.value_and_grad(plain))(params_)
    assert float(loss) == float(expected_loss)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- shapes, qk-norm, dense first layers -----------------------------------------------------------------------


def _model_shapes(config) -> dict[str, tuple[int, ...]]:
    state = jax.eval_shape(train.make_init_fn(config))
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


@pytest.mark.parametrize(
    "fields",
    [dict(scan_layers=True), dict(first_dense_layers=1, num_shared_experts=2),
     dict(qk_norm="head", num_attention_heads=8), dict(qk_norm="full", scan_layers=True)],
    ids=["scanned", "dense_first_and_shared", "qk_norm_head_more_heads", "qk_norm_full_scanned"],
)  # fmt: skip
def test_analytic_shapes_are_the_moe_models_leaf_by_leaf(fields):
    config = _moe(**fields)
    shapes = _model_shapes(config)
    assert params.param_shapes(config.model) == shapes
    assert params.param_count(config.model) == sum(math.prod(s) for s in shapes.values())
    if fields.get("first_dense_layers"):
        assert "transformer/block_0/mlp/gate/kernel" in shapes and "transformer/block_1/mlp/experts/gate" in shapes
        assert shapes["transformer/block_1/mlp/shared/up/kernel"] == (64, 2 * 32)


@pytest.mark.parametrize(
    "mesh,fields",
    [((1, 1, 1, 1, 4), {}), ((1, 2, 2, 1, 2), dict(scan_layers=True)),
     ((2, 2, 1, 1, 2), dict(first_dense_layers=1, num_shared_experts=2)), ((1, 2, 1, 1, 2), {"mesh.zero_stage": 1}),
     ((2, 1, 1, 1, 2), {"mesh.zero_stage": 1})],
    ids=str,
)  # fmt: skip
def test_analytic_state_under_expert_parallelism_is_the_layouts_shards(mesh, fields):
    """mesh (data, fsdp, tensor, context, expert): the analytic memory model's parameters, Adam state and gradients
    per device (the experts and router / mesh.expert, every other parameter's embed axis / the state axes fsdp x
    context x expert; ZeRO-1 over expert alone splits only the Adam state) against the shard shapes of the step's
    real layout, built on an abstract mesh (no devices)."""
    from jax.sharding import AbstractMesh, AxisType

    from jaxscale.train import sharding

    config = _moe(**{k: v for k, v in fields.items() if "." not in k})
    config.mesh.update({k.split(".")[1]: v for k, v in fields.items() if "." in k})
    config.mesh.update(dict(zip(("data", "fsdp", "tensor", "context", "expert"), mesh, strict=True)))
    config.optimizer.name, config.data.batch_size = "adam", 16
    config.train.grad_accumulation = "after_backward"  # two whole gradients, laid out as the layout's (below)
    validate(config)
    shape = sharding.mesh_shape(config).physical
    init_fn = train.make_init_fn(config)
    abstract = AbstractMesh(shape, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
    layout = sharding.make_layout(config, abstract, init_fn)
    state = sharding.abstract_inputs(config, layout, init_fn)[0]
    held = sharding.state_bytes_per_device(state)
    row = memory.analytic_memory(config)
    assert row["analytic_params_bytes"] == held["params"]
    assert 0 <= held["optimizer"] - row["analytic_optimizer_bytes"] <= 16  # Adam's step counters
    grads = sum(4 * math.prod(g.shard_shape(p.shape))
                for p, g in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(layout.grads),
                                strict=True))  # fmt: skip
    assert row["analytic_grads_bytes"] == 2 * grads  # a minibatch's gradients and their accumulator
    gate = "transformer/blocks/mlp/experts/gate" if config.model.scan_layers else "transformer/block_1/mlp/experts/gate"
    node, whole = layout.state.params, _model_shapes(config)[gate]  # [(L,) E, H, F]
    for key in gate.split("/"):
        node = node[key]
    assert node.shard_shape(whole)[-3] == whole[-3] // mesh[4]  # each device holds E / mesh.expert experts


@pytest.mark.parametrize("kind", ["head", "full"])
def test_qk_norm_normalizes_per_head_or_over_all_heads(kind):
    """RMSNorm over head_dim (Qwen3) or over heads x head_dim together (OLMoE), against NumPy, at 1e-5."""
    cfg = step_model(_moe(qk_norm=kind))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 16)) * 3
    module = qk_norm(cfg, "q_norm", "heads")
    variables = nn.meta.unbox(module.init(jax.random.PRNGKey(1), x))
    scale = jax.random.normal(jax.random.PRNGKey(2), variables["params"]["scale"].shape)
    out = module.apply({"params": {"scale": scale}}, x)
    xs = np.asarray(x, np.float64)
    axes = (-1,) if kind == "head" else (-2, -1)
    expected = xs / np.sqrt(np.mean(xs**2, axis=axes, keepdims=True) + cfg.norm_epsilon) * np.asarray(scale)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


# --- the presets' parameters, by hand -----------------------------------------------------------------------


def _llama_moe_count(v, h, layers, heads, kv_heads, hd, experts, k, fe, qk_norm_size, tied=False):
    """(total, active) written out: embedding V·H, per layer two norm scales 2H, q H·(heads·hd), k and v
    2·H·(kv_heads·hd), out (heads·hd)·H, the q/k norm scales, router H·E, E experts of 3·H·F_e; final norm H,
    untied head H·V. Active: no embedding lookup, k experts of the E."""
    attention = 2 * h + h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + qk_norm_size
    expert = 3 * h * fe
    total = v * h + layers * (attention + h * experts + experts * expert) + h + (0 if tied else h * v)
    active = layers * (attention + h * experts + k * expert) + h + h * v
    return total, active


PRESETS = {  # preset: (hand count (total, active), docs/models.md's figures, the issue's in billions to its digits)
    "mixtral-8x7b": (_llama_moe_count(32000, 4096, 32, 32, 8, 128, 8, 2, 14336, 0),
                     (46_702_792_704, 12_748_853_248), (46.70, 12.75)),
    "olmoe-1b-7b": (_llama_moe_count(50304, 2048, 16, 16, 16, 128, 64, 8, 1024, 2048 + 2048),
                    (6_919_161_856, 1_178_994_688), (6.92, None)),
    "qwen3-30b-a3b": (_llama_moe_count(151936, 2048, 48, 32, 4, 128, 128, 8, 768, 128 + 128),
                      (30_532_122_624, 3_041_867_776), (30.53, None)),
    "tiny-moe": (_llama_moe_count(128, 64, 2, 4, 2, 16, 4, 2, 32, 0, tied=True), (82_752, 58_176), (None, None)),
}  # fmt: skip


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_parameter_counts_by_hand(preset):
    """The initialised model's count (jax.eval_shape: nothing allocated), the analytic count and the active count
    equal the hand arithmetic and docs/models.md's table, and round to the issue's figures (46.70B and 12.75B
    active, 6.92B, 30.53B)."""
    config = base_config(preset, "count")
    validate(config)
    (total, active), documented, (issue_total, issue_active) = PRESETS[preset]
    assert (total, active) == documented
    assert count_params(jax.eval_shape(train.make_init_fn(config)).params) == total
    assert params.param_count(config.model) == total
    assert params.active_param_count(config.model) == flops.non_embedding_params(config.model) == active
    if issue_total is not None:
        assert round(total / 1e9, 2) == issue_total
    if issue_active is not None:
        assert round(active / 1e9, 2) == issue_active


# --- FLOPs, by hand ----------------------------------------------------------------------------------------------


def test_moe_flops_count_the_k_active_experts_and_the_router_by_hand():
    """tiny-moe (H 64, 4 query and 2 K/V heads of 16, E 4, k 2, F_e 32, 1 shared expert, V 128 tied, T 32, 8
    sequences): per token and layer up 2·2·H·(k + 1)·F_e, down 2·(k + 1)·F_e·H, router 2·H·E; model FLOPs
    6·N_active + 12·L·Q·T per token; hardware FLOPs 3 x the forward matmuls (no remat). With a dense first layer
    the sums over the layers are a SwiGLU's plus an MoE's."""
    config = _moe(num_shared_experts=1)
    h, e, k, fe, v, t, layers, tokens = 64, 4, 2, 32, 128, 32, 2, 8 * 32
    per_token = flops.forward_matmul_flops_per_token(config)
    assert per_token["up"] == 2 * 2 * h * (k + 1) * fe and per_token["down"] == 2 * (k + 1) * fe * h
    assert per_token["router"] == 2 * h * e
    qkv, out = 2 * h * (64 + 2 * 32), 2 * 64 * h
    attention = 2 * 2 * t * 64  # QK^T and AV over the full square, 4 heads x 16
    n_active = layers * (2 * h + h * 64 + 2 * h * 32 + 64 * h + h * e + (k + 1) * 3 * h * fe) + h + v * h  # tied
    assert flops.model_flops_per_step(config) == tokens * (6 * n_active + 12 * layers * 64 * t)
    forward = layers * (qkv + out + per_token["up"] + per_token["down"] + 2 * h * e + attention) + 2 * h * v
    backward = layers * (qkv + out + per_token["up"] + per_token["down"] + 2 * h * e + 2 * attention) + 2 * h * v
    weights = layers * (qkv + out + per_token["up"] + per_token["down"] + 2 * h * e) + 2 * h * v
    assert flops.hardware_flops_per_step(config) == tokens * (forward + backward + weights)

    dense_first = _moe(first_dense_layers=1)  # block 0 a SwiGLU of width 192, block 1 the experts (no shared one)
    attention_params = 2 * h + h * 64 + 2 * h * 32 + 64 * h
    n_active = 2 * attention_params + 3 * h * 192 + (h * e + k * 3 * h * fe) + h + v * h
    assert flops.model_flops_per_step(dense_first) == tokens * (6 * n_active + 12 * layers * 64 * t)
    mlp = (2 * 2 * h * 192 + 2 * 192 * h) + (2 * 2 * h * k * fe + 2 * k * fe * h + 2 * h * e)  # both layers' MLPs
    forward = layers * (qkv + out + attention) + mlp + 2 * h * v
    backward = layers * (qkv + out + 2 * attention) + mlp + 2 * h * v
    weights = layers * (qkv + out) + mlp + 2 * h * v
    assert flops.hardware_flops_per_step(dense_first) == pytest.approx(tokens * (forward + backward + weights))


@pytest.mark.parametrize("dispatch", slow_except(["ragged", "capacity", "dense"], lambda d: d == "ragged"))
def test_a_bfloat16_train_step_runs_and_learns(dispatch):
    """configs/bf16_remat.py at tiny-moe (bf16, scanned layers, remat of MLP and Attn, 2 minibatches): two jitted
    steps (the learning rate warms up from 0 at the first) give a finite loss and change the router and experts."""
    config = load_config("bf16_remat", "tiny-moe")
    config.model.moe_dispatch = dispatch
    validate(config)
    state, metrics = train.make_init_fn(config)(), train.init_metrics()
    before = jax.tree_util.tree_map(np.asarray, state.params["transformer"]["blocks"]["mlp"])  # state is donated
    batch, step = _batch(config, config.data.batch_size), train.make_train_step(config)
    for _ in range(2):
        state, metrics = step(state, metrics, batch)
    after = state.params["transformer"]["blocks"]["mlp"]
    assert np.isfinite(float(metrics["loss_sum"])) and float(metrics["tokens"]) == 2 * 8 * 32
    for name in ("router", "experts"):
        changed = jax.tree_util.tree_map(lambda a, b: bool(np.any(a != np.asarray(b))), before[name], after[name])
        assert all(jax.tree_util.tree_leaves(changed)), name


# --- one-line errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, fields, field",
    [
        ("tiny", dict(num_experts=4), "model.num_experts"),
        ("tiny-moe", dict(experts_per_token=5), "model.experts_per_token"),
        ("tiny-moe", dict(moe_dispatch="megablocks"), "model.moe_dispatch"),
        ("tiny-moe", dict(moe_routing="sigmoid"), "model.moe_routing"),
        ("tiny-moe", dict(moe_capacity_factor=0.0), "model.moe_capacity_factor"),
        ("tiny-moe", dict(first_dense_layers=1, scan_layers=True), "model.first_dense_layers"),
        ("tiny-moe", dict(first_dense_layers=2), "model.first_dense_layers"),
        ("tiny-llama", dict(first_dense_layers=1), "model.first_dense_layers"),
        ("tiny-moe", dict(lora_rank=4, lora_targets=("mlp",)), "model.lora_targets"),
        ("tiny-moe", dict(qk_norm="layer"), "model.qk_norm"),
        ("tiny", dict(qk_norm="head"), "model.qk_norm"),
    ],
)
def test_what_is_not_built_is_a_one_line_error_naming_the_field(preset, fields, field):
    config = base_config(preset, "bad")
    config.model.update(fields)
    with pytest.raises(ConfigError, match=f"^{field}: ") as error:
        validate(config)
    assert "\n" not in str(error.value)


def test_docs_adam_state_per_gpu_for_the_moe_presets_on_8_gpus():
    """docs/models.md's Adam figures: float32 weights, gradients and two moments, 16 bytes a parameter of the
    presets' exact counts (the hand counts above), over 8 GPUs: 93 GB (Mixtral 8x7B) and 61 GB (Qwen3-30B-A3B)."""
    text = " ".join((Path(__file__).parents[2] / "docs" / "models.md").read_text().split())
    mixtral, qwen3 = (16 * params.param_count(load_config("bf16", p).model) / 8 / 1e9
                      for p in ("mixtral-8x7b", "qwen3-30b-a3b"))  # fmt: skip
    assert f"{mixtral:.0f} GB a GPU for Mixtral and {qwen3:.0f} GB for Qwen3" in text


def test_docs_olmoe_full_fine_tuning_and_expert_figures():
    """docs/models.md's OLMoE-1B-7B figures from the preset's exact counts: float32 weights and gradients, 8 bytes a
    parameter, 55 GB; its routed experts, 16 layers x 64 x 3 x 2048 x 1024 = 6.44e9 (by hand), 6.4B."""
    text = " ".join((Path(__file__).parents[2] / "docs" / "models.md").read_text().split())
    model = load_config("bf16", "olmoe-1b-7b").model
    experts = 16 * 64 * 3 * 2048 * 1024
    assert params.inactive_expert_params(model) + 16 * 8 * 3 * 2048 * 1024 == experts  # E - k of them, + the k
    assert f"6.9B float32 weights and gradients alone are {8 * params.param_count(model) / 1e9:.0f} GB" in text
    assert f"the {experts / 1e9:.1f}B expert parameters" in text


# --- the closed form: what the MoE layer's backward reads, kept, the rest recomputed ---------------------------------


@pytest.mark.parametrize(
    "dispatch, scan",
    slow_except([(d, s) for d in ("scatter", "capacity", "ragged", "dense") for s in (True, False)],
                lambda case: case == ("scatter", True)),
)  # fmt: skip
def test_the_closed_form_gives_autodiffs_loss_and_gradients(dispatch, scan):
    """model.residuals=closed_form on a mixture of experts keeps the tagged tensors (the norm's output, the router's
    logits, the dispatched tokens, gate, up, hidden, the outputs the combine reads) and recomputes the routing and
    the elementwise rest: the loss (both router losses in it, at 10x their defaults) and every gradient equal
    autodiff's residuals' (float32)."""
    batch = _batch(_moe())
    results = []
    for residuals in ("autodiff", "closed_form"):
        config = _moe(moe_dispatch=dispatch, scan_layers=scan, residuals=residuals, remat=(), moe_aux_loss_weight=0.1,
                      moe_z_loss_weight=0.01)  # fmt: skip
        results.append(loss_and_grads(config, _params(config), batch))
    (loss, grads), (closed_loss, closed_grads) = results
    assert abs(float(loss) - float(closed_loss)) < 1e-6
    assert_trees_close(closed_grads, grads, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
def test_the_scanned_loop_keeps_the_moe_layers_closed_form():
    """tiny-moe scanned, planned for an H100 (bf16, 2 layers, one sequence of 1,024, the scatter dispatch): the
    forward loop's stacked outputs (compiled_scan_saved_bytes) per token per layer are the hand count of what the
    layer's backward reads, in bytes a token: the attention's as the dense Llama's (its input and norm output, q,
    k, v, the attention output: 2 bytes an element; the log-sum-exp 4 a head) and the MoE MLP's: its input and norm
    output (2 h each), the router's float32 logits (4 E), the experts' tokens and their gate, up and hidden at GShard's
    capacity C = ceil(factor x T x k / E) slots an expert (2 x E C / T x (h + 3 F)), and the k choices' outputs the
    combine reads (2 k h)."""
    config = load_config("bf16", "tiny-moe")
    config.model.update(dtype="bfloat16", num_layers=2, max_seq_len=1024, remat=(), residuals="closed_form",
                        attention="flash", scan_layers=True, moe_dispatch="scatter")  # fmt: skip
    config.data.update(batch_size=1, seq_len=1024)
    config.train.num_minibatches = 1
    validate(config)
    m, tokens = config.model, 1024
    h, heads, kv = m.hidden_size, m.hidden_size // m.head_dim, m.num_kv_heads * m.head_dim
    e, k, f = m.num_experts, m.experts_per_token, m.moe_hidden_size
    slots = math.ceil(m.moe_capacity_factor * tokens * k / e)
    attention = 2 * (2 * h + h + 2 * kv + h) + 4 * heads
    routed = 2 * (2 * h) + 4 * e + 2 * e * slots * (h + 3 * f) / tokens + 2 * k * h
    saved = gpu_plan.plan_for_target(config, "h100", gemm="cublas", in_process=True)["compiled_scan_saved_bytes"]
    assert saved / (2 * tokens) == attention + routed
    analytic = memory.analytic_memory(config)  # the memory model's closed form, which this layer keeps
    assert analytic["analytic_closed_form_per_layer_bytes"] / tokens == attention + routed
    assert analytic["analytic_activation_per_layer_bytes"] == analytic["analytic_closed_form_per_layer_bytes"]

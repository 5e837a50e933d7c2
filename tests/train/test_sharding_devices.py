"""Every mesh computes what one device computes (float32): same initial parameters, loss, gradients and step.

Needs 8 devices: tests/train/test_sharding.py runs this file in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8; in an ordinary test process it is skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale import train
from jaxscale.config import base_config, validate
from jaxscale.config.spec import RunSpec, accumulates_in_backward
from jaxscale.measure import hlo, memory
from jaxscale.measure.params import param_count
from jaxscale.train import sharding
from jaxscale.train.quantized_state import QuantizedMoment

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see tests/train/test_sharding.py)")

# Float32 everywhere; a sharded program adds its partial sums in another order, nothing else differs.
RTOL = 2e-5  # the per-step losses of the text-data test
# _assert_close: each leaf within SUM_ORDER_K x float32 eps x sqrt(SUM_TERMS) x its largest magnitude.
SUM_ORDER_K, SUM_TERMS = 4, 16 * 32  # the gradients sum over batch_size x seq_len tokens (_config, tiny presets)


def _config(mesh, preset="tiny", **changes):
    config = base_config(preset, "mesh")
    config.model.dtype = "float32"
    config.model.dropout_rate = 0.0
    config.data.batch_size, config.train.num_minibatches = 16, 2
    config.optimizer.update(name="sgd", warmup_steps=0, learning_rate=0.5, b1=0.0)  # params move by -0.5 * grads
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.context = tuple(mesh) + (1,) * (4 - len(mesh))
    for dotted, value in changes.items():
        group, field = dotted.split(".")
        config[group][field] = value
    validate(config)
    return config


def _gradients(placement, state, batch):
    """loss sums and gradients of train.batch_gradients (the step's work before the optimizer)."""
    config, layout = placement.config, placement.layout
    fn = functools.partial(
        train.batch_gradients,
        rng=jax.random.PRNGKey(5),
        num_minibatches=config.train.num_minibatches,
        accumulate=config.train.accumulate,
        grad_shardings=None if layout is None else layout.grads,
        local=None if layout is None else layout.local,  # DP and ZeRO-1/2: accumulated per device, reduced once
    )
    if layout is None:
        return jax.jit(fn)(state, batch)
    jitted = jax.jit(fn, in_shardings=(layout.state, layout.batch), out_shardings=(layout.grads, None))
    with layout.activate():
        return jitted(state, batch)


def _everything(config, devices=None, step: bool = True):
    """(initial params, (grads, metrics), (params, metrics) after one train step or None) on the config's mesh."""
    placement = sharding.placement(config, devices)
    batch = train.make_batch(
        jax.random.PRNGKey(1), config.data.batch_size, config.data.seq_len, config.model.vocab_size
    )
    batch = placement.place_batch(batch)
    state = placement.init_state()
    initial = jax.device_get(state.params)
    grads = jax.device_get(_gradients(placement, state, batch))
    stepped = None
    if step:
        stepped = jax.device_get(placement.step()(state, placement.init_metrics(), batch))
        stepped = (stepped[0].params, stepped[1])
    return initial, grads, stepped, placement


def _one_device(preset: str, changes: tuple, step: bool):
    """One device's _everything for the (key, value) `changes` less a layout's fields (mesh.*), computed once a
    process for each function: the layouts of one function share it."""
    return _one_device_of(preset, tuple(item for item in changes if not item[0].startswith("mesh.")), step)


@functools.cache
def _one_device_of(preset: str, changes: tuple, step: bool):
    return _everything(_config((1, 1, 1), preset, **dict(changes)), step=step)


def _assert_close(a, b):
    """Equal up to the order of float32 sums: |a - b| <= k x eps x sqrt(n) x max|b| in every leaf.

    A mesh adds the same terms as one device in another order (per-device partial sums, then a collective).
    Each addition rounds by at most eps/2 of the running sum, which is of the order of the leaf's largest
    value S (the partial sums of a leaf are no larger in scale than the leaf itself); over n terms the
    roundings add like a random walk, ~sqrt(n) x eps/2 x S, and two orders differ by about sqrt(2) times that.
    n is the number of tokens a gradient sums over (SUM_TERMS = 512), k = SUM_ORDER_K = 4 leaves headroom for
    the sums inside the matmuls before it: every mesh of this file measured at most 0.5 x eps x sqrt(n) x S
    (llama on 4x1x2: 2.3e-7 on an embedding gradient of scale 0.4, within 1.1e-5 x 0.4 = 4.3e-6). A layout
    error is orders of magnitude beyond it: a gradient scaled by 2 or missing one device's share of the batch
    is off by about S/8 to S, 10^4 times the bound.
    A leaf of zeros must be zeros.
    """
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    eps = float(np.finfo(np.float32).eps)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.abs(y).max()) if y.size else 0.0
        np.testing.assert_allclose(x, y, rtol=0, atol=SUM_ORDER_K * eps * np.sqrt(SUM_TERMS) * scale)


def _assert_same_function(mesh, step=False, preset="tiny", **changes):
    """The mesh on the first prod(mesh) of the 8 devices (a mesh must use every device it is given)."""
    one = _one_device(preset, tuple(sorted(changes.items())), step)
    devices = int(np.prod(mesh)) * changes.get("mesh.stage", 1)  # a pipeline's stages multiply the mesh
    many = _everything(_config(mesh, preset, **changes), jax.devices()[:devices], step)
    assert many[3].layout is not None and many[3].layout.devices == devices
    _assert_close(many[0], one[0])  # the sharded init draws the same numbers
    _assert_close(many[1], one[1])  # loss sums, accuracy counts and every gradient
    assert float(many[1][1]["tokens"]) == 16 * 32 and float(many[1][1]["loss_sum"]) > 0
    if step:
        _assert_close(many[2], one[2])  # the parameters after one optimizer step, and the running metrics


# The Llama whole-step tests below (2x2x2, ZeRO-1, context parallel, 1x2x2x2) compute one function, so _one_device
# computes its reference once a process (2 compiles each test saves): scanned layers, Block remat, 2 minibatches
# (_config's), the chunked attention that the context-parallel ring needs (the reference kernel on a Llama mesh is
# the LoRA test's, and the GPT 2x2x2 test's).
LLAMA_STEP = {"model.attention": "chunked", "model.scan_layers": True, "model.remat": ("Block",)}


def test_remat_scan_accumulation_and_dropout_on_a_2x2x2_mesh_equal_one_device():
    """Data, FSDP and tensor parallel at once, with scanned layers, remat of MLP and Attn, 4 minibatches in
    lax.scan, and dropout, whose masks are drawn identically in shards (JAX's partitionable threefry);
    gradients, and the parameters after a whole train step."""
    _assert_same_function(
        (2, 2, 2),
        step=True,
        **{"model.scan_layers": True, "model.remat": ("MLP", "Attn"), "train.num_minibatches": 4,
           "model.dropout_rate": 0.1},
    )  # fmt: skip


def test_llama_with_remat_scan_and_accumulation_on_a_2x2x2_mesh_equals_one_device():
    """The Llama family (RMSNorm, SwiGLU, RoPE, 2 K/V heads for 4 query heads, tied embeddings): its K/V
    heads and SwiGLU width split over tensor, embed over fsdp, the batch over data x fsdp; the gradients and the
    parameters after a whole step (LLAMA_STEP; remat of MLP and Attn with 4 minibatches on a mesh is the gpt case's
    above, and on a Llama mesh test_llama_layouts_equal_one_device's, -m slow)."""
    _assert_same_function((2, 2, 2), step=True, preset="tiny-llama", **LLAMA_STEP)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh,changes",
    [
        ((1, 8, 1), {}),
        ((1, 1, 2), {"model.remat": ("Block",), "model.remat_policy": "save_qkv_proj"}),
        ((4, 1, 2), {"model.attention": "xla", "model.tie_embeddings": False, "train.accumulate": "loop"}),
    ],
)
def test_llama_layouts_equal_one_device(mesh, changes):
    _assert_same_function(mesh, step=mesh == (1, 8, 1), preset="tiny-llama", **changes)  # FSDP: a whole step too


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(8, 1, 1), (1, 8, 1), (2, 2, 2)])
def test_mesh_equals_one_device(mesh):
    """Each layout on its own (the default tiny model: unrolled layers, 2 minibatches in lax.scan)."""
    _assert_same_function(mesh, step=True)


@pytest.mark.slow
def test_tensor_parallel_on_two_devices_equals_one_device():
    """1x1x2 on the first 2 of the 8 devices."""
    _assert_same_function((1, 1, 2), step=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh,changes",
    [
        ((1, 2, 4), {"train.accumulate": "loop", "model.remat": ("Block",), "model.attention": "xla"}),
        ((4, 2, 1), {"model.scan_layers": True, "model.remat": ("Block",), "model.remat_policy": "dots_saveable"}),
        ((1, 1, 4), {"model.scan_layers": True, "train.num_minibatches": 1}),
    ],
)
def test_more_variants_on_a_mesh_equal_one_device(mesh, changes):
    _assert_same_function(mesh, **changes)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 8, 1), (8, 1, 1)])
def test_bf16_mesh_with_float32_gradient_sums_equals_one_device_within_bf16(mesh):
    """bf16 compute: the mesh sums its weight gradients in float32 (model.reduce_dtype, jaxscale.model.precision),
    one device computes Flax's default program; the gradients agree within bf16 rounding of their scale."""
    changes = {"model.dtype": "bfloat16"}
    one = _one_device("tiny-llama", tuple(sorted(changes.items())), False)
    many = _everything(_config(mesh, "tiny-llama", **changes), jax.devices()[:8], False)
    for x, y in zip(jax.tree_util.tree_leaves(many[1][0]), jax.tree_util.tree_leaves(one[1][0]), strict=True):
        scale = float(np.abs(np.asarray(y)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(x) / scale, np.asarray(y) / scale, atol=2e-2)


def test_bf16_weights_under_fsdp_give_one_devices_gradients_within_bf16():
    """model.param_dtype=bfloat16 (no float32 master copy) on 8 FSDP devices: the weights are sharded and gathered in
    bf16 and their bf16 gradients agree with one device's within bf16 rounding of their scale (as the bf16-compute
    mesh test above holds; a wrong layout is off by the gradient's scale)."""
    changes = {"model.param_dtype": "bfloat16", "model.scan_layers": True}
    one = _one_device("tiny", tuple(sorted(changes.items())), False)
    many = _everything(_config((1, 8, 1), "tiny", **changes), jax.devices()[:8], False)
    leaves = jax.tree_util.tree_leaves(many[0])
    assert leaves and all(leaf.dtype == jnp.bfloat16 for leaf in leaves if leaf.ndim > 1)
    for x, y in zip(jax.tree_util.tree_leaves(many[1][0]), jax.tree_util.tree_leaves(one[1][0]), strict=True):
        assert x.dtype == y.dtype == jnp.bfloat16
        scale = float(np.abs(np.asarray(y, np.float32)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(x, np.float32) / scale, np.asarray(y, np.float32) / scale, atol=2e-2)


def _bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds of a tree's arrays (rank >= 1), from the arrays' own addressable shards."""
    held: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        if leaf.ndim:
            for shard in leaf.addressable_shards:
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


@pytest.mark.parametrize("preset,mesh", [("tiny", (1, 2, 4)), ("tiny-llama", (2, 2, 2))])
def test_each_device_holds_its_hand_counted_share_of_params_and_adam_state(preset, mesh):
    """The initial state's real shards: every device holds 4 bytes x the hand-counted parameters of its share
    (each parameter's shape divided by the mesh axes its names map to), and Adam's two moments twice that."""
    from test_sharding import hand_count_per_device

    config = _config(mesh, preset, **{"model.scan_layers": True})
    config.optimizer.name = "adam"
    state = sharding.placement(config).init_state()
    expected = 4 * hand_count_per_device(config.model, mesh[1], mesh[2])
    assert _bytes_per_device(state.params) == {device.id: expected for device in jax.devices()}
    assert _bytes_per_device(state.opt_state) == {device.id: 2 * expected for device in jax.devices()}
    whole = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.params))
    assert expected < 1.1 * whole / (mesh[1] * mesh[2])  # split fsdp x tensor ways (norms, some biases aside)


# Pipeline parallelism (jaxscale.model.pipeline): the scanned stack in mesh.stage stages, microbatches streamed through
# them in one loop; 4 layers so that 4 stages, or 2 stages visited twice, each hold one.
PIPELINE = {"model.scan_layers": True, "model.num_layers": 4}


@pytest.mark.parametrize(
    "mesh,preset,changes",
    [
        # circular (each of 2 stages visited twice) x FSDP x tensor, Llama, a whole train step
        ((1, 2, 2), "tiny-llama", {"mesh.stage": 2, "mesh.pipeline_repeats": 2, "model.remat": ("Block",)}),
        # GPipe over 4 stages x data 2, GPT, 4 microbatches in flight
        ((2, 1, 1), "tiny", {"mesh.stage": 4, "mesh.pipeline_microbatches": 4}),
        pytest.param((2, 1, 2), "tiny-llama", {"mesh.stage": 2, "mesh.sequence_parallel": True},
                     marks=pytest.mark.slow),
        pytest.param((2, 2, 1), "tiny-llama", {"mesh.stage": 2, "mesh.zero_stage": 1, "mesh.pipeline_microbatches": 2},
                     marks=pytest.mark.slow),
        pytest.param((1, 1, 1), "tiny", {"mesh.stage": 8, "model.num_layers": 8, "mesh.pipeline_microbatches": 2},
                     marks=pytest.mark.slow),
    ],
)
def test_pipeline_stages_equal_one_device(mesh, preset, changes):
    """The pipelined stack computes one device's function: loss sums, every gradient (the first case also the
    parameters after a whole step), on stage x (data, fsdp, tensor) meshes; and each device holds only its stage's
    layers of every stacked parameter."""
    changes = {**PIPELINE, **changes}
    _assert_same_function(mesh, step=changes.get("model.remat") is not None, preset=preset, **changes)
    config = _config(mesh, preset, **changes)
    state = sharding.placement(config, jax.devices()[:8]).init_state()
    for leaf in jax.tree_util.tree_leaves(state.params["transformer"]["blocks"]):
        assert leaf.shape[0] == config.model.num_layers
        held = {shard.data.shape[0] for shard in leaf.addressable_shards}
        assert held == {config.model.num_layers // config.mesh.stage}


def test_pipeline_hands_activations_on_by_collective_permutes_and_reduces_gradients_once_a_step():
    """GPipe over 2 stages x data 4, 4 microbatches (5 iterations), one minibatch, float32. Hand counts: a data group's
    4 rows are 4 x 32 x 64 x 4 = 32768 bytes, a microbatch one row, 8192. The stage hand-offs are collective-permutes
    of one microbatch each, once an iteration, whose pairs join the two stages (a device and the one 4 places on:
    the aligned block of 8). The embedding and the head split their positions over the stages, so the loop's input is
    gathered over them once, and each finished microbatch goes to them by an all-to-all, once an iteration. The
    all-reduces over the 4 data-parallel devices run once a step and carry each device's share of the parameters
    (summed from the layout's shards; the tied table's two gradient terms add its 32 KiB again: within 10%), not once
    an iteration (without per-device groups XLA reduced every iteration's weight gradients: 5x). Over the 2 stages:
    the input's cotangent, one microbatch an iteration, and once a step the table's gradient (its two terms)."""
    from jaxscale.measure import collectives, hlo, layer_loop

    config = _config((4, 1, 1), "tiny-llama", **PIPELINE, **{"mesh.stage": 2, "mesh.pipeline_microbatches": 4,
                                                               "train.num_minibatches": 1})  # fmt: skip
    placement = sharding.placement(config, jax.devices()[:8])
    text = placement.step().lower(*placement.abstract_inputs()).compile().as_text()
    found = collectives.count_collectives(hlo.parse(text))
    rows, microbatch, iterations, table = 4 * 32 * 64 * 4, 1 * 32 * 64 * 4, 5, 128 * 64 * 4
    assert layer_loop.pipeline_iterations(text) == iterations  # the row's compiled_pipeline_iterations
    kinds = lambda kind, group=None: [c for c in found if c.kind == kind and group in (None, c.group_size)]  # noqa: E731
    assert {(c.bytes, c.executions, c.pair_span) for c in kinds("collective-permute")} == {
        (microbatch, iterations, 8)}  # fmt: skip
    assert {(c.bytes, c.executions, c.group_size) for c in kinds("all-gather")} == {(rows, 1, 2)}
    assert {(c.bytes, c.executions, c.group_size) for c in kinds("all-to-all")} == {(microbatch, iterations, 2)}
    params = sharding.state_bytes_per_device(placement.abstract_inputs()[0])["params"]
    over_data = [c for c in kinds("all-reduce", 4) if c.bytes > 4]  # a scalar's 4 bytes: the loss
    assert {c.executions for c in over_data} == {1}
    assert params <= sum(c.bytes for c in over_data) <= 1.1 * params
    over_stages = [c for c in kinds("all-reduce", 2) if c.bytes > 4]
    assert {(c.bytes, c.executions) for c in over_stages if c.executions > 1} == {(microbatch, iterations)}
    assert 2 * table <= sum(c.bytes for c in over_stages if c.executions == 1) <= 2 * table + 1024


def test_fsdp_in_a_pipeline_gathers_each_weight_once_a_pass_with_pipeline_gather_once():
    """2 stages x FSDP 4, GPipe with 4 microbatches (5 iterations), one minibatch: by default each stage's weights are
    all-gathered over fsdp in every iteration (inside the loop: at least 5 executions of each); with
    mesh.pipeline_gather_once they are gathered once a pass and no gather runs in the loop; the gradients equal one
    device's either way."""
    from jaxscale.measure import collectives, hlo

    fields = {**PIPELINE, "mesh.stage": 2, "mesh.pipeline_microbatches": 4, "train.num_minibatches": 1}
    _assert_same_function((1, 4, 1), preset="tiny-llama", **fields, **{"mesh.pipeline_gather_once": True})

    def gathers(once: bool) -> set[int]:
        config = _config((1, 4, 1), "tiny-llama", **fields, **{"mesh.pipeline_gather_once": once})
        placement = sharding.placement(config, jax.devices()[:8])
        text = placement.step().lower(*placement.abstract_inputs()).compile().as_text()
        found = collectives.count_collectives(hlo.parse(text))
        return {c.executions for c in found if c.kind == "all-gather" and c.bytes > 4096}  # the weights, not the loss

    assert max(gathers(False)) >= 5  # once per iteration at least (here per iteration and layer: 10)
    assert gathers(True) == {1}


@pytest.mark.parametrize("visits", [2, 3, 5])
def test_circular_weights_reach_their_stages_by_one_all_to_all(visits):
    """pipeline.stage_major on 4 stages x tensor 2: a stack [L, 6, 4] split over the stages in contiguous blocks (and
    over tensor on its last dimension) comes out as the one-device reshape [L] -> [v, p, n] -> [p, v, n] gives it,
    with v = 2 (v < p), 3 (neither divides the other) and 5 (Megatron's virtual pipeline 5 on 8 stages, here 4);
    compiled, its only collective is one all-to-all."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxscale.measure import collectives, hlo
    from jaxscale.model import pipeline

    p, n = 4, 2
    layers = p * visits * n
    mesh = Mesh(np.array(jax.devices()).reshape(p, 2), ("stage", "tensor"))
    stack = jnp.arange(layers * 6 * 4, dtype=jnp.float32).reshape(layers, 6, 4)
    want = np.swapaxes(np.asarray(stack).reshape(visits, p, n, 6, 4), 0, 1)
    with jax.set_mesh(mesh):
        placed = jax.device_put(stack, NamedSharding(mesh, PartitionSpec("stage", None, "tensor")))
        fn = jax.jit(lambda x: pipeline.stage_major(x, p, visits, (None, "tensor")))
        np.testing.assert_array_equal(np.asarray(fn(placed)), want)
        text = fn.lower(placed).compile().as_text()
    assert [c.kind for c in collectives.count_collectives(hlo.parse(text))] == ["all-to-all"]


def test_pipeline_keeps_tensor_parallel_weight_gradients_split():
    """2 stages x data 2 x tensor 2, 2 minibatches: each data-parallel group's weights (and so their gradients) are laid
    out as the stage's own, split over tensor, so the step gathers no weights: its all-gathers are the loop's input
    (positions gathered over the stages) and the loss's few bytes, under half a device's parameters (when the groups'
    weights were named only by their group and stage dimensions, XLA gathered every weight gradient whole over
    tensor, 5.5x the parameters' bytes a step)."""
    from jaxscale.measure import collectives, hlo

    config = _config((2, 1, 2), "tiny-llama", **PIPELINE, **{"mesh.stage": 2, "mesh.pipeline_microbatches": 4,
                                                               "model.remat": ("Block",)})  # fmt: skip
    placement = sharding.placement(config, jax.devices()[:8])
    text = placement.step().lower(*placement.abstract_inputs()).compile().as_text()
    gathered = sum(c.bytes * c.executions for c in collectives.count_collectives(hlo.parse(text))
                   if c.kind == "all-gather")  # fmt: skip
    assert gathered < 0.5 * sharding.state_bytes_per_device(placement.abstract_inputs()[0])["params"]


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_zero_stages_1_and_2_equal_one_device(stage):
    """ZeRO-1 and ZeRO-2 over fsdp (x data parallel), with scanned layers, Block remat and 2 minibatches (LLAMA_STEP):
    gradients and the parameters after a whole train step equal one device's. (ZeRO-2's fast whole-step check is
    test_fsdp_tensor_sequence_and_context_parallel_at_once_equal_one_device.)"""
    _assert_same_function((2, 4, 1), step=True, preset="tiny-llama", **{"mesh.zero_stage": stage, **LLAMA_STEP})


@pytest.mark.parametrize("mesh,stage", [
    # data parallel: each device accumulates its own rows (local accumulation, under jax.vmap). In the default suite
    # the mesh tests above run in_backward (the default) against one device's in_backward, and
    # tests/train/test_backward_accumulation.py holds one device's to after_backward's
    pytest.param((8, 1, 1), 3, marks=pytest.mark.slow),
    pytest.param((2, 4, 1), 1, marks=pytest.mark.slow),
    pytest.param((2, 4, 1), 2, marks=pytest.mark.slow),
    pytest.param((1, 8, 1), 3, marks=pytest.mark.slow),
])  # fmt: skip
def test_accumulation_inside_the_backward_pass_on_a_mesh_equals_one_devices_plain_accumulation(mesh, stage):
    """Two minibatches whose layers' gradients are added into the accumulator inside the backward pass
    (train.grad_accumulation=in_backward, jaxscale.train.backward_accumulation) on data parallelism, ZeRO-1, ZeRO-2
    and FSDP: the gradients and the parameters after a whole step equal one device's plain accumulation's."""
    changes = {**LLAMA_STEP, "mesh.zero_stage": stage}  # two minibatches (_config)
    one = _one_device("tiny-llama", tuple(sorted({**changes, "train.grad_accumulation": "after_backward"}.items())),
                      True)  # fmt: skip
    config = _config(mesh, "tiny-llama", **changes, **{"train.grad_accumulation": "in_backward"})
    many = _everything(config, jax.devices(), True)
    _assert_close(many[1], one[1])
    _assert_close(many[2], one[2])


def test_local_accumulation_with_dropout_is_each_devices_own_rows_and_key():
    """Data parallel x ZeRO-1 with 2 minibatches and dropout: each device accumulates the gradients of its own rows
    and reduces them once a step (sharding.local_accumulation), drawing its dropout masks from the minibatch's
    key folded with its index in the batch split. Its gradients equal a reference written out on one device:
    for each minibatch i and device g, the gradient of the mean loss over g's rows of minibatch i with key
    fold_in(fold_in(rng, i), g), averaged over i and g."""
    config = _config((2, 2, 1), "tiny", **{"mesh.zero_stage": 1, "model.dropout_rate": 0.1})
    initial, (grads, metrics), _, placement = _everything(config, jax.devices()[:4], step=False)
    assert placement.layout.local is not None and placement.layout.local.count == 4
    one = _config((1, 1, 1), "tiny", **{"model.dropout_rate": 0.1})
    state = sharding.placement(one).init_state()
    batch = train.make_batch(jax.random.PRNGKey(1), 16, one.data.seq_len, one.model.vocab_size)
    rng, minibatches, groups = jax.random.PRNGKey(5), 2, 4
    rows = 16 // minibatches // groups

    def loss(params, inputs, labels, key):
        return train.next_token_loss(params, state.apply_fn, train.Batch(inputs, labels), key)[0]

    grad = jax.jit(jax.grad(loss))
    total = None
    for i in range(minibatches):
        for g in range(groups):
            start = i * 16 // minibatches + g * rows
            key = jax.random.fold_in(jax.random.fold_in(rng, i), g)
            part = grad(state.params, batch.inputs[start : start + rows], batch.labels[start : start + rows], key)
            total = part if total is None else jax.tree_util.tree_map(jnp.add, total, part)
    reference = jax.tree_util.tree_map(lambda x: x / (minibatches * groups), total)
    _assert_close(initial, jax.device_get(state.params))
    _assert_close(grads, jax.device_get(reference))
    assert float(metrics["tokens"]) == 16 * 32


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_1_and_2_split_the_adam_state_and_keep_the_parameters_whole(stage):
    """The initial state's real shards under ZeRO-1/2 on 1x4x2: every device holds its tensor-parallel share of
    the parameters whole over fsdp (4 bytes x hand_count(fsdp=1)), and Adam's two moments split fsdp ways too
    (2 x 4 bytes x hand_count(fsdp=4)); the reduced gradients' layout is the moments' at both stages (ZeRO-1's were
    the parameters', all-reduced whole, before issue 41)."""
    from test_sharding import hand_count_per_device

    config = _config((1, 4, 2), "tiny-llama", **{"model.scan_layers": True, "mesh.zero_stage": stage})
    config.optimizer.name = "adam"
    placement = sharding.placement(config)
    state = placement.init_state()
    whole, split = (4 * hand_count_per_device(config.model, fsdp, 2) for fsdp in (1, 4))
    assert _bytes_per_device(state.params) == {device.id: whole for device in jax.devices()}
    assert _bytes_per_device(state.opt_state) == {device.id: 2 * split for device in jax.devices()}
    row = memory.analytic_memory(config)  # the analytic model's state terms are the real shards
    assert (row["analytic_params_bytes"], row["analytic_optimizer_bytes"]) == (whole, 2 * split)
    grads = placement.layout.grads
    kernel = ("transformer", "blocks", "mlp", "up", "kernel")  # [L, H, F]: (layers, embed, mlp)
    spec = functools.reduce(lambda node, key: node[key], kernel, grads).spec
    assert tuple(spec) == ("stage", ("fsdp", "context", "expert"), "tensor")  # layers over a pipeline's stages (1)


@pytest.mark.slow
def test_sequence_parallel_with_tensor_parallel_equals_one_device():
    """Megatron sequence parallelism: on 4x1x2 the residual stream (norms, residual adds) is split along the
    sequence over tensor, with scanned layers, remat of Attn and MLP and 4 minibatches; gradients and the
    parameters after a step equal one device's. (Its fast whole-step check is the 1x2x2x2 test below.)"""
    _assert_same_function(
        (4, 1, 2),
        step=True,
        preset="tiny-llama",
        **{"mesh.sequence_parallel": True, "model.scan_layers": True, "model.remat": ("MLP", "Attn"),
           "train.num_minibatches": 4},
    )  # fmt: skip


@pytest.mark.slow
def test_gpt_sequence_parallel_with_fsdp_and_dropout_free_equals_one_device():
    """The GPT family (LayerNorm, biases, learned positions) under 1x2x4 with sequence parallelism, unrolled."""
    _assert_same_function((1, 2, 4), step=True, **{"mesh.sequence_parallel": True})


def test_context_parallel_with_remat_scan_and_accumulation_equals_one_device():
    """Context parallelism over 4 devices (x 2 data parallel): the sequence split in the balanced order,
    attention as a ring of chunked blocks, with scanned layers, Block remat and 2 minibatches (LLAMA_STEP); gradients
    and the parameters after a step equal one device's chunked attention in natural order."""
    _assert_same_function((2, 1, 1, 4), step=True, preset="tiny-llama", **LLAMA_STEP)


def test_fsdp_tensor_sequence_and_context_parallel_at_once_equal_one_device():
    """1x2x2x2: FSDP over fsdp x context, tensor parallelism with sequence parallelism, and a ring of 2, at
    ZeRO stage 2 (LLAMA_STEP: with Block remat); the gradients and the parameters after a whole train step."""
    _assert_same_function(
        (1, 2, 2, 2),
        step=True,
        preset="tiny-llama",
        **{"mesh.sequence_parallel": True, "mesh.zero_stage": 2, **LLAMA_STEP},
    )


@pytest.mark.slow
def test_gpt_context_parallel_over_8_equals_one_device():
    """The GPT family (learned positions, permuted with the tokens) on a ring of 8: chunks of 2 positions."""
    _assert_same_function((1, 1, 1, 8), step=True, **{"model.attention": "chunked"})


def test_fsdp_init_builds_each_shard_where_it_lives():
    """Under 1x8x1 the jitted init writes its outputs in shards: no device's buffers hold the whole state."""
    config = _config((1, 8, 1), **{"model.scan_layers": True})
    placement = sharding.placement(config)
    compiled = jax.jit(placement.init_fn, out_shardings=placement.layout.state).lower().compile()
    analysis = compiled.memory_analysis()
    whole = sum(
        leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(jax.eval_shape(placement.init_fn))
    )
    assert analysis.output_size_in_bytes < whole / 6  # about 1/8 (the replicated scalars aside)
    assert analysis.output_size_in_bytes + analysis.temp_size_in_bytes < whole / 2
    kernel = placement.init_state().params["transformer"]["blocks"]["mlp"]["up"]["kernel"]  # [L, H, 4H]
    assert kernel.addressable_shards[0].data.shape == (2, 64 // 8, 256)


def test_place_batch_splits_the_rows_over_data_and_fsdp():
    config = _config((2, 2, 2))
    placement = sharding.placement(config)
    batch = placement.place_batch(train.make_batch(jax.random.PRNGKey(1), 16, 32, 128))
    shards = {shard.device.id: shard.data.shape for shard in batch.inputs.addressable_shards}
    assert set(shards.values()) == {(4, 32)} and len(shards) == 8  # 16 rows / (data x fsdp = 4), whole over tensor
    assert sharding.process_rows(placement.layout.batch.inputs, (16, 32)) == slice(0, 16)  # one process feeds all rows


def test_text_data_with_validation_on_a_mesh_gives_the_losses_of_one_device(pydoc_bytes, tmp_path):
    """The run's loop on prepared text (grain loader, prefetch, validation) feeds a 2x2x2 mesh the same
    batches as one device: training and validation losses agree (float32, no dropout)."""
    from conftest import text_config

    from jaxscale import run

    rows = {}
    for mesh in ((1, 1, 1), (2, 2, 2)):
        config = text_config("bf16", "tiny", pydoc_bytes, steps=3, warmup_steps=1, eval_every=2)
        config.model.update(dtype="float32", dropout_rate=0.0)
        config.profile.steps = 0
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
        validate(config)
        compiled, placement, _, _ = run.compile_step(config)
        assert (placement.layout is None) == (mesh == (1, 1, 1))
        row = {"name": "x".join(map(str, mesh)), "tokens_per_step": config.data.batch_size * config.data.seq_len}
        run.execute(config, compiled, placement, tmp_path / row["name"], row, progress=False)
        rows[mesh] = row
    one, many = rows[(1, 1, 1)], rows[(2, 2, 2)]
    assert len(one["loss_all"]) == 4 and one["validation_steps"] == many["validation_steps"] == [2, 4]
    np.testing.assert_allclose(many["loss_all"], one["loss_all"], rtol=RTOL)
    np.testing.assert_allclose(many["validation_loss_all"], one["validation_loss_all"], rtol=RTOL)


def test_lora_adapters_over_a_frozen_bf16_base_on_a_2x2x2_mesh_equal_one_device():
    """LoRA on every projection of the Llama, the base frozen in bfloat16: adapters split like their projections
    (rank axis whole), no gradient or optimizer state for the frozen half. Two steps, so the second moves A too
    (its gradient is zero while B is): the trained parameters after both, on the mesh and on one device."""
    changes = {"model.scan_layers": True, "model.lora_rank": 4,
               "model.lora_targets": ("all",), "finetune.train": "adapters"}  # fmt: skip

    def two_steps(mesh):
        config = _config(mesh, "tiny-llama", **changes)
        placement = sharding.placement(config, jax.devices()[: int(np.prod(mesh))])
        batch = placement.place_batch(
            train.make_batch(jax.random.PRNGKey(1), config.data.batch_size, config.data.seq_len, 128)
        )
        state, metrics, step = placement.init_state(), placement.init_metrics(), placement.step()
        initial_a = jax.device_get(state.params["transformer"]["blocks"]["attn"]["q"]["lora_a"])
        for _ in range(2):
            state, metrics = step(state, metrics, batch)
        return jax.device_get((state.params, state.frozen, metrics)), initial_a

    (one, initial_a), (many, _) = two_steps((1, 1, 1)), two_steps((2, 2, 2))
    assert all(k.endswith(("lora_a", "lora_b")) for k in _paths(one[0]))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(many[1])} == {np.dtype(jnp.bfloat16)}
    _assert_close(many, one)
    assert not np.allclose(one[0]["transformer"]["blocks"]["attn"]["q"]["lora_a"], initial_a)


def _paths(tree) -> list[str]:
    return ["/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# FP8's tensorwise scales couple the rows of a minibatch, so a layout computes one device's function only where it
# groups the same rows: one minibatch a step (with accumulation each device splits its own rows into minibatches, and
# under DP / ZeRO-1's once-a-step reduction each device scales its own rows, as torchtitan's ranks do; measured here:
# 7% to 18% of a gradient's largest value off one device's, the same recipe on other numbers). And an element whose
# float32 input differs by a sum order can round to the neighbouring FP8 value (a step of 6% to 12%): measured at most
# 3.2e-5 of a leaf's largest value. FP8_RTOL separates the two by 30x either way.
FP8_RTOL = 1e-3


@pytest.mark.parametrize("mesh", [(1, 8, 1), pytest.param((8, 1, 1), marks=pytest.mark.slow),
                                  pytest.param((2, 2, 2), marks=pytest.mark.slow)])  # fmt: skip
def test_fp8_matmuls_on_a_mesh_equal_one_device(mesh):
    """model.fp8 = "dynamic", one minibatch a step: each tensor's scale is its amax over the whole (sharded) tensor,
    a max the partitioner reduces exactly, so every device rounds as one device does."""
    changes = {"model.fp8": "dynamic", "train.num_minibatches": 1}
    one = _one_device("tiny", tuple(sorted(changes.items())), False)
    many = _everything(_config(mesh, **changes), jax.devices()[: int(np.prod(mesh))], step=False)
    for x, y in zip(jax.tree_util.tree_leaves(many[1]), jax.tree_util.tree_leaves(one[1]), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=0, atol=FP8_RTOL * float(np.abs(y).max()))


# --- expert parallelism (mesh.expert; jaxscale.model.moe) -------------------------------------------------------

# tiny-moe: 4 experts, 2 per token, 32 positions. A capacity factor of E / k = 2 gives ceil(2 x 32 x 2 / 4) = 32
# slots per expert per sequence, as many as a sequence has tokens: no token is dropped and the capacity dispatch is
# the exact routed sum, the function one device computes. The z-loss is on so that both router losses count.
MOE = {"model.moe_capacity_factor": 2.0, "model.moe_z_loss_weight": 1e-3}


def _moe_config(mesh, dispatch="capacity", **changes):
    """tiny-moe on mesh (data, fsdp, tensor, context, expert)."""
    return _config(mesh[:4], "tiny-moe", **{"mesh.expert": mesh[4], "model.moe_dispatch": dispatch, **MOE, **changes})


def _assert_moe_same_function(mesh, dispatch="capacity", step=False, **changes):
    changes = {"model.moe_dispatch": dispatch, **MOE, **changes}
    one = _one_device("tiny-moe", tuple(sorted(changes.items())), step)
    config = _moe_config(mesh, **changes)
    devices = sharding.mesh_shape(config).devices
    many = _everything(config, jax.devices()[:devices], step)
    assert many[3].layout.mesh.shape["expert"] == mesh[4] and many[3].layout.devices == devices
    _assert_close(many[0], one[0])
    _assert_close(many[1], one[1])  # loss sums (router losses included) and every gradient, the router's too
    assert float(many[1][1]["tokens"]) == 16 * 32 and float(many[1][1]["loss_sum"]) > 0
    if step:
        _assert_close(many[2], one[2])
    return many


@pytest.mark.parametrize(
    "mesh,dispatch,step",
    [
        pytest.param((2, 1, 1, 1, 4), "capacity", True, marks=pytest.mark.slow),  # 4 ways: one expert a device
        ((2, 2, 1, 1, 2), "capacity", False),  # with FSDP (ZeRO-3) and data parallelism
        pytest.param((1, 1, 2, 1, 4), "capacity", False, marks=pytest.mark.slow),  # with tensor parallelism
        pytest.param((2, 1, 1, 1, 4), "scatter", True, marks=pytest.mark.slow),  # capacity's slots by index
        pytest.param((2, 2, 1, 1, 2), "ragged", False, marks=pytest.mark.slow),  # the weights gathered, no exchange
        pytest.param((2, 1, 1, 1, 4), "dense", False, marks=pytest.mark.slow),
    ],
)
def test_moe_expert_parallel_equals_one_device(mesh, dispatch, step):
    """Experts split over mesh.expert (2 or 4), the batch over data x fsdp x expert: the loss, its router losses
    and every gradient (router included) equal one device's, and with step the parameters after a whole step. The
    capacity dispatch exchanges the tokens by all-to-all (the test below); the ragged and dense ones take no
    constraint, and the partitioner computes them by gathering the experts' weights: the same function too."""
    many = _assert_moe_same_function(mesh, dispatch, step)
    kernel = many[3].layout.state.params["transformer"]["block_0"]["mlp"]["experts"]["gate"]  # [E, H, F]
    assert kernel.spec[0] == "expert"


@pytest.mark.slow
def test_moe_expert_parallel_with_scan_remat_and_zero1_equals_one_device():
    """Scanned layers, Block remat, 2 minibatches and ZeRO-1 over fsdp 2 x expert 4 (whose auto reduction is then
    every minibatch's: config.accumulates_locally), the parameters after a whole step."""
    from jaxscale.config import accumulates_locally

    assert accumulates_locally(_moe_config((1, 2, 1, 1, 4), **{"mesh.zero_stage": 1})) is False
    _assert_moe_same_function(
        (1, 2, 1, 1, 4), step=True, **{"model.scan_layers": True, "model.remat": ("Block",), "mesh.zero_stage": 1}
    )


def test_qlora_moe_with_nf4_experts_on_an_expert_mesh_equals_one_device():
    """QLoRA of tiny-moe (LoRA rank 4 on attention over a base frozen in NF4: every projection kernel and expert
    weight) on 2 data x 2 expert devices: the stacked experts' codes are split by expert as their bf16 twin's weights
    are (each device holds its 2 experts'), and the loss and the adapters' gradients equal one device's."""
    qlora = {"model.lora_rank": 4, "model.lora_targets": ("attention",), "finetune.frozen_dtype": "nf4"}
    many = _assert_moe_same_function((2, 1, 1, 1, 2), "capacity", False, **qlora)
    gate = many[3].layout.state.frozen["transformer"]["block_0"]["mlp"]["experts"]["gate"]
    assert gate.codes.spec[0] == gate.absmax_codes.spec[0] == "expert"
    assert gate.codes.shard_shape((4, 1024))[0] == 2  # [E, 64 x 32 / 2 bytes] of codes: two experts a device
    config = _moe_config((2, 1, 1, 1, 2), **{**MOE, **qlora})
    state = sharding.placement(config, jax.devices()[:4]).init_state()
    held: dict[int, int] = {}  # every array's shards, scalars (a kernel's NF4 offset) included
    for leaf in jax.tree_util.tree_leaves((state.params, state.frozen)):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    assert set(held.values()) == {memory.analytic_memory(config)["analytic_params_bytes"]}


# The load-balancing loss under per-device accumulation (data parallelism and ZeRO-1 reduce once a step): 4
# minibatches of 8 rows on 8 devices, one row a device a minibatch; the preset's dispatch (the default), a
# load-balance weight of 0.1 so that its gradient is a tenth of the router's (MOE's z-loss on too), no drops.
BALANCE = {**MOE, "data.batch_size": 32, "train.num_minibatches": 4, "model.moe_aux_loss_weight": 0.1}


def _balance_config(mesh, **changes):
    return _config(mesh, "tiny-moe", **{**BALANCE, **changes})


@pytest.mark.parametrize(
    "mesh, changes",
    [
        # data parallelism, the layers scanned: accumulated inside the backward pass (the default, "auto"), the router
        # losses through the stack's output (jaxscale.train.backward_accumulation); unrolled, after it
        ((8, 1, 1), {"model.scan_layers": True}),
        pytest.param((8, 1, 1), {}, marks=pytest.mark.slow),
        pytest.param((1, 8, 1), {"mesh.zero_stage": 1}, marks=pytest.mark.slow),  # ZeRO-1: the same accumulation
        pytest.param((8, 1, 1), {"model.moe_dispatch": "ragged"}, marks=pytest.mark.slow),  # reduced every minibatch
        pytest.param((8, 1, 1), {"model.moe_balance_scope": "sequence"}, marks=pytest.mark.slow),
    ],
)
def test_moe_balance_loss_reduced_once_a_step_equals_one_device(mesh, changes):
    """Each device accumulates its own rows' gradients and the step reduces them once (LocalAccumulation), and the
    balance loss's f is every device's rows' (model.moe_balance_scope minibatch: a pmean over the device groups), so
    loss, gradients and the stepped parameters equal one device's at the float32 tolerance. With f of each device's
    own row (main at 52030f3, the scatter dispatch) 8,185 of a leaf's 8,192 gradients were beyond it (up to 0.027
    off), and the then default ragged dispatch raised NotImplementedError under the per-device jax.vmap; it now
    reduces every minibatch instead (auto) and is the same function too. The reference is one device's plain
    accumulation (each minibatch's whole gradient, then added), so the scanned case holds the accumulation inside the
    backward pass to it."""
    from jaxscale.config import accumulates_locally

    config = _balance_config(mesh, **changes)
    assert accumulates_locally(config) is (changes.get("model.moe_dispatch") != "ragged")
    assert accumulates_in_backward(config) is config.model.scan_layers
    assert config.model.moe_dispatch == changes.get("model.moe_dispatch", "scatter")  # the preset's default
    plain = {**BALANCE, **changes, "train.grad_accumulation": "after_backward"}  # one device's plain accumulation
    one = _one_device("tiny-moe", tuple(sorted(plain.items())), True)
    many = _everything(config, jax.devices()[:8], True)
    _assert_close(many[1], one[1])
    _assert_close(many[2], one[2])
    assert float(many[1][1]["tokens"]) == 32 * 32


def test_moe_device_balance_scope_is_each_devices_rows_whichever_the_reduction():
    """model.moe_balance_scope device takes f and P over each batch-splitting device's rows, Megatron-Core's default:
    the per-device accumulation (each vmap group its own statistics) and the reduction every minibatch (the
    partitioner's program, the rows regrouped by device in the model) compute the same gradients, and they differ
    from one device's (which holds every row) by far more than the float32 tolerance."""
    device = {"model.moe_balance_scope": "device"}
    local = _everything(_balance_config((8, 1, 1), **device), jax.devices()[:8], False)
    every = _everything(_balance_config((8, 1, 1), **device, **{"mesh.reduce_gradients": "minibatch"}),
                        jax.devices()[:8], False)  # fmt: skip
    assert local[3].layout.local is not None and every[3].layout.local is None
    _assert_close(local[1], every[1])
    one = _one_device("tiny-moe", tuple(sorted({**BALANCE, **device}.items())), False)
    router = lambda grads: np.asarray(grads[0]["transformer"]["block_0"]["mlp"]["router"]["kernel"])  # noqa: E731
    assert np.abs(router(local[1]) - router(one[1])).max() > 0.01 * np.abs(router(one[1])).max()


def _all_to_alls(config) -> int:
    """all-to-all instructions in the compiled train step of `config` on its mesh (XLA's HLO text)."""
    placement = sharding.placement(config, jax.devices()[: sharding.mesh_shape(config).devices])
    text = placement.step().lower(*placement.abstract_inputs()).compile().as_text()
    return sum(1 for line in text.splitlines() if " all-to-all(" in line or " all-to-all-start(" in line)


def test_moe_expert_parallel_program_exchanges_tokens_by_all_to_all():
    """The capacity dispatch (and the scatter one) on 2 data x 2 expert devices compiles to 4 all-to-alls per MoE layer:
    the tokens to their experts and back in the forward pass, the two transposed in the backward (hand count: 2 layers x
    4); the same 4 devices as 4 data-parallel ones (expert 1) compile none. One minibatch a step, so no other reshard of
    the batch adds one. (Without the dispatch's constraints the partitioner gathers the experts' weights instead: no
    all-to- all, so the first count fails.)"""
    one_minibatch = {"train.num_minibatches": 1}
    config = _moe_config((2, 1, 1, 1, 2), **one_minibatch)
    assert _all_to_alls(config) == 4 * config.model.num_layers
    assert _all_to_alls(_moe_config((2, 1, 1, 1, 2), "scatter", **one_minibatch)) == 4 * config.model.num_layers
    assert _all_to_alls(_moe_config((4, 1, 1, 1, 1), **one_minibatch)) == 0


def test_moe_expert_parallel_shards_the_experts_their_gradients_and_adam_state():
    """The initial state's real shards on 2 data x 2 fsdp x 2 expert: each device holds half of the stacked experts'
    expert axis (and half of their embed axis, FSDP), and a quarter of every other parameter (its embed axis split
    over fsdp x expert, the state axes), Adam's moments likewise: 4 bytes x a hand count, which the analytic memory
    model gives too.

    Hand count (tiny-moe: H 64, 4 heads of 16, 2 K/V heads, 2 layers, 4 experts of width 32, vocabulary 128, tied),
    every non-expert embed axis / (fsdp 2 x expert 2), the experts' and router's embed axis / fsdp 2 and their expert
    axis / expert 2: per layer two RMSNorm scales 2 x 64 / 4, q and out 2 x 64 x 64 / 4, k and v 2 x 64 x 32 / 4, the
    router 64 x 4 / (2 x 2), the experts 3 x 4 x 64 x 32 / (2 x 2); the embedding 128 x 64 / 4 and the final norm
    64 / 4. (Before the expert axis split the non-expert state, each of those was / 2: 28,960 elements, not 20,688.)"""
    config = _moe_config((2, 2, 1, 1, 2))
    config.optimizer.name = "adam"
    placement = sharding.placement(config)
    state = placement.init_state()
    gate = state.params["transformer"]["block_0"]["mlp"]["experts"]["gate"]  # [4, 64, 32]
    assert {shard.data.shape for shard in gate.addressable_shards} == {(2, 32, 32)}
    q = state.params["transformer"]["block_0"]["attn"]["q"]["kernel"]  # [64, 4, 16]
    assert {shard.data.shape for shard in q.addressable_shards} == {(16, 4, 16)}
    layer = 32 + 2 * 1024 + 2 * 512 + 64 + 3 * 2048
    expected = 4 * (2 * layer + 2048 + 16)
    assert expected == 4 * 20688
    assert _bytes_per_device(state.params) == {device.id: expected for device in jax.devices()}
    assert _bytes_per_device(state.opt_state) == {device.id: 2 * expected for device in jax.devices()}
    row = memory.analytic_memory(config)
    assert (row["analytic_params_bytes"], row["analytic_optimizer_bytes"]) == (expected, 2 * expected)
    grads = jax.tree_util.tree_map(lambda p, g: 4 * int(np.prod(g.shard_shape(p.shape))), state.params,
                                   placement.layout.grads)  # fmt: skip
    assert sum(jax.tree_util.tree_leaves(grads)) == expected  # split as the parameters are (ZeRO-3)
    assert row["analytic_grads_bytes"] == 2 * expected  # a minibatch's gradients and their accumulator


@pytest.mark.parametrize(
    "mesh,changes",
    [
        # one expert a device; the non-expert state split 4 ways over expert (slow: the 8-way case below is the claim)
        pytest.param((2, 1, 1, 1, 4), {}, marks=pytest.mark.slow),
        # 8 experts (capacity factor E / k = 4: no drops), one a device; the non-expert state split 8 ways (~7 s)
        ((1, 1, 1, 1, 8), {"model.num_experts": 8, "model.moe_capacity_factor": 4.0}),
    ],
    ids=str,
)
def test_moe_expert_parallel_devices_shard_the_non_expert_state_like_fsdp_and_equal_one_device(mesh, changes):
    """Expert parallelism without an fsdp axis (issue 41, item 4a): the expert-parallel devices also split every
    non-expert parameter (attention, embedding, norms) and its Adam state along its embed axis, as FSDP does, while
    the stacked experts stay split by expert. The loss and every gradient equal one device's (the float32 sum-order
    tolerance); an attention kernel's sharding names the expert axis; each device holds exactly the analytic model's
    parameter and Adam bytes (memory.analytic_memory), far below the replicated non-expert state of before."""
    many = _assert_moe_same_function(mesh, "capacity", False, **changes)
    block = many[3].layout.state.params["transformer"]["block_0"]
    assert "expert" in block["attn"]["q"]["kernel"].spec[0]  # [H, heads, head_dim]: H over fsdp x context x expert
    assert tuple(block["mlp"]["experts"]["gate"].spec)[:2] == ("expert", ("fsdp", "context"))  # [E, H, F]
    config = _moe_config(mesh, **{**MOE, **changes})
    config.optimizer.name = "adam"
    state = sharding.placement(config, jax.devices()[: sharding.mesh_shape(config).devices]).init_state()
    row = memory.analytic_memory(config)
    devices = {shard.device.id for shard in state.params["embed"]["embedding"].addressable_shards}
    assert len(devices) == mesh[0] * mesh[4]
    assert _bytes_per_device(state.params) == {device: row["analytic_params_bytes"] for device in devices}
    assert _bytes_per_device(state.opt_state) == {device: 2 * row["analytic_params_bytes"] for device in devices}
    assert row["analytic_optimizer_bytes"] == 2 * row["analytic_params_bytes"]
    # Every parameter is split mesh.expert ways: the experts and router by their expert axis, the rest by embed.
    assert row["analytic_params_bytes"] == 4 * param_count(config.model) // mesh[4]


# From the same state with filled histories, one step's amaxes are maxes of the same tensors computed in another sum
# order (measured, this test on 1x8x1: 1.1e-7 relative at most; 8x1x1 bit for bit). Its params differ more than
# FP8_RTOL's float32 sum orders: a gradient element whose FP8 rounding flips feeds the weight gradients of every layer
# below it (measured on one CPU, 1x8x1: 1.1e-3 of a leaf's largest value after one step, 3.0e-2 after two, with 3.1%
# on an amax of the second step; another CPU's sums stayed under 1e-3 for both steps). So one step is compared: its
# amaxes within NEXT_AMAX_RTOL and its params within FP8_STEP_RTOL. A state reduced over one device's rows only would
# be off by the spread of a max over 1/8 of the batch (>5%), 50x NEXT_AMAX_RTOL; a gradient from the wrong rows 7% to
# 18% of a leaf's largest value (FP8_RTOL's note), 14x FP8_STEP_RTOL.
NEXT_AMAX_RTOL = 1e-3
FP8_STEP_RTOL = 5e-3


def _delayed_steps(config, devices=None, state=None, keys: tuple[int, ...] = (1,)):
    """model.fp8=delayed: the states after each train step (from `state`, or the init), one a batch of PRNGKey(key)
    for each of `keys`."""
    placement = sharding.placement(config, devices)
    step, states = placement.step(), []
    fresh = placement.init_state()
    if state is not None:  # its values in this placement's state (whose static fields are this config's)
        state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(fresh), jax.tree_util.tree_leaves(state))
        state = jax.device_put(state, None if placement.layout is None else placement.layout.state)
    state = fresh if state is None else state
    for key in keys:
        batch = train.make_batch(jax.random.PRNGKey(key), config.data.batch_size, config.data.seq_len,
                                 config.model.vocab_size)  # fmt: skip
        state, _ = step(state, placement.init_metrics(), placement.place_batch(batch))
        states.append(jax.device_get(state))
    return states


@pytest.mark.parametrize("mesh, minibatches", [((1, 8, 1), 2), pytest.param((8, 1, 1), 1, marks=pytest.mark.slow)])
def test_delayed_fp8_on_a_mesh_equals_one_device(mesh, minibatches):
    """model.fp8 = "delayed" from a state one step in on one device (histories filled, so the scales are a tensor's
    own, as dynamic scaling's are): the amax each op records is a max over the whole (sharded) tensor, which the
    partitioner reduces exactly. After a step from that state the scaling state equals one device's within
    NEXT_AMAX_RTOL and the params within FP8_STEP_RTOL (the step after it starts from params that differ by FP8
    roundings: see NEXT_AMAX_RTOL). (The very first step quantizes at Flax's initial scale 1, where most gradients are
    e5m2 subnormals and a sum's order flips many roundings: compared from the init, the params differ by ~3x FP8_RTOL
    on 1x8x1.)"""
    changes = {"model.fp8": "delayed", "train.num_minibatches": minibatches}
    # One device's step compiled once: the warm-up step, then the compared step on the batch the mesh takes.
    warm, one = _delayed_steps(_config((1, 1, 1), **changes), keys=(1, 1))
    (many,) = _delayed_steps(_config(mesh, **changes), jax.devices()[: int(np.prod(mesh))], state=warm, keys=(1,))
    for x, y in zip(jax.tree_util.tree_leaves(many.fp8_meta), jax.tree_util.tree_leaves(one.fp8_meta), strict=True):
        np.testing.assert_allclose(x, y, rtol=NEXT_AMAX_RTOL, atol=0)
    for x, y in zip(jax.tree_util.tree_leaves(many.params), jax.tree_util.tree_leaves(one.params), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=0, atol=FP8_STEP_RTOL * float(np.abs(y).max()))


def test_delayed_fp8_data_parallel_accumulation_takes_the_max_of_every_devices_rows():
    """Data parallelism with 2 minibatches accumulates per device (LocalAccumulation): 16 rows, 2 minibatches of 8,
    8 devices, so each device's group of each minibatch is one row. The step's new scaling state is the elementwise
    max of the states one device returns for each row alone, its gradients their mean: both computed apart here."""
    config = _config((8, 1, 1), **{"model.fp8": "delayed"})
    placement = sharding.placement(config, jax.devices()[:8])
    assert placement.layout.local is not None and placement.layout.local.count == 8
    state = placement.init_state()
    batch = train.make_batch(jax.random.PRNGKey(1), 16, config.data.seq_len, config.model.vocab_size)
    fn = functools.partial(train.batch_gradients, rng=jax.random.PRNGKey(5), num_minibatches=2, accumulate="scan",
                           grad_shardings=placement.layout.grads, local=placement.layout.local)  # fmt: skip
    with placement.layout.activate():
        grads, _ = jax.device_get(jax.jit(fn)(state, placement.place_batch(batch)))
    single = jax.jit(functools.partial(train.batch_gradients, rng=jax.random.PRNGKey(5), num_minibatches=1,
                                       accumulate="scan"))  # fmt: skip
    host_state = jax.device_put(jax.device_get(state), jax.devices()[0])
    rows = [jax.device_get(single(host_state, jax.tree_util.tree_map(lambda x, r=r: x[r : r + 1], batch))[0])
            for r in range(16)]  # fmt: skip
    for x, *per_row in zip(*(jax.tree_util.tree_leaves(g.fp8_meta) for g in (grads, *rows)), strict=True):
        np.testing.assert_allclose(x, np.max(per_row, axis=0), rtol=1e-5, atol=0)
    _assert_close(grads.params, jax.tree_util.tree_map(lambda *g: np.mean(g, axis=0), *(r.params for r in rows)))


# 8-bit Adam (optimizer.state_dtype=int8, jaxscale.train.quantized_state) at a step size that moves the tiny weights.
INT8_ADAM = {"optimizer.name": "adam", "optimizer.state_dtype": "int8", "optimizer.learning_rate": 1e-2,
             "model.scan_layers": True}  # fmt: skip
_COLLECTIVE_OPS = tuple(f"{op}{end}" for op in hlo.COLLECTIVES for end in ("", "-start"))


def _int8_steps(config, devices=None, steps: int = 2):
    """(placement, state, per-step metrics, the compiled step's optimized HLO) after `steps` train steps on the
    config's mesh, batch i drawn from key i (one compile: the step is lowered from its abstract inputs and run)."""
    placement = sharding.placement(config, devices)
    compiled = placement.step().lower(*placement.abstract_inputs()).compile()
    state, metrics = placement.init_state(), []
    for i in range(steps):
        batch = train.make_batch(jax.random.PRNGKey(i), config.data.batch_size, config.data.seq_len,
                                 config.model.vocab_size)  # fmt: skip
        state, sums = compiled(state, placement.init_metrics(), placement.place_batch(batch))
        metrics.append(jax.device_get(sums))
    return placement, state, metrics, compiled.as_text()


@functools.cache
def _int8_one_device():
    """One device's _int8_steps of INT8_ADAM (shared by the meshes' tests): (final params, metrics, optimizer state)."""
    _, state, metrics, _ = _int8_steps(_config((1, 1, 1), **INT8_ADAM))
    return jax.device_get(state.params), metrics, jax.device_get(state.opt_state)


# Adam divides each moment by its own root mean square, and 8-bit moments round to the nearest of 256 codes: an element
# whose gradient is near zero, or whose moment lies near the midpoint between two codes, turns the gradients' sum-order
# differences into a larger difference of its update (float32 moments too). So the 8-bit parameters are NOT held to
# _assert_close's sum-order bound, only to this band. Measured over 2 steps at step size 1e-2 against one device, on
# the 8-bit tensors (6 tensors, 114,688 elements), in the tests' environment: 100 elements beyond _assert_close's
# bound under fsdp=8 (ZeRO-3) and 86 under data=2 x fsdp=4 (ZeRO-1), in every one of the 6 tensors; the largest
# difference 1.55e-4 (0.016 steps) and 1.41e-4 (0.014 steps), both in the fused qkv kernel. The band, 1/10 of a step
# (1e-3), is 6.4x the larger; a wrong block or shard moves an element by about a whole step.
STEP_BAND = 1 / 10


def _assert_within_a_step_band(params, one_params, mu, step_size: float):
    """Every parameter with 8-bit moments (`mu`: the optimizer's first moments) within STEP_BAND x `step_size` of one
    device's. The rest take optax's float32 Adam, whose division by the root mean square makes a gradient that is
    zero but for rounding (the key bias's: softmax ignores a constant added to a row's logits) anything."""
    quantized = jax.tree_util.tree_map(lambda _, m: isinstance(m, QuantizedMoment), params, mu)
    for x, y, q in zip(*(jax.tree_util.tree_leaves(t) for t in (params, one_params, quantized)), strict=True):
        if q:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=STEP_BAND * step_size)


def _uint8_collectives(hlo_text: str) -> list[str]:
    """The collectives of an optimized HLO module with a uint8 array among their operands or results."""
    module, found = hlo.parse(hlo_text), []
    for computation in module.computations.values():
        for op in computation.values():
            uint8 = hlo.shape_bytes(op.shape, "u8") + hlo.operand_bytes(op, computation, "u8")
            if op.opcode in _COLLECTIVE_OPS and uint8:
                found.append(f"{op.name} {op.shape}")
    return found


def _assert_int8_state_split_like_its_parameters(state, config, stage: int, devices) -> None:
    """The 8-bit codes of a kernel laid out like float32 moments (the parameter's names under the optimizer state's
    rules: at ZeRO-3 the parameter's own sharding, at ZeRO-1 split over the state axes while the parameter is whole),
    and each device holding exactly the analytic model's bytes of the state, less than half the whole state."""
    adam = state.opt_state[0]
    moment = adam.mu["transformer"]["blocks"]["mlp"]["up"]["kernel"]
    param = state.params["transformer"]["blocks"]["mlp"]["up"]["kernel"]
    assert moment.codes.dtype == jnp.uint8 and moment.codes.shape == param.shape
    # [layers, embed, mlp]: layers over a pipeline's stages (1 here)
    assert tuple(moment.codes.sharding.spec) == ("stage", ("fsdp", "context", "expert"), "tensor")
    assert tuple(param.sharding.spec) == tuple(moment.codes.sharding.spec if stage == 3 else ("stage", None, "tensor"))
    analytic = memory.optimizer_state_bytes(RunSpec.from_config(config))
    assert _bytes_per_device((adam.mu, adam.nu)) == {device.id: analytic for device in devices}
    whole = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves((adam.mu, adam.nu)))
    assert analytic < whole / 2, (analytic, whole)


@pytest.mark.parametrize("mesh,stage", [((1, 8, 1), 3), pytest.param((2, 4, 1), 1, marks=pytest.mark.slow)],
                         ids=["fsdp8_zero3", "dp2_fsdp4_zero1"])  # fmt: skip
def test_int8_adam_state_is_split_like_its_parameters_and_trains_as_one_device(mesh, stage):
    """8-bit Adam on a mesh against one device, after 2 steps.

    Exact claims: each step's loss sum, token and accuracy counts are one device's within _assert_close's
    sum-order bound (measured: at most 0.0082 of the bound at both meshes); the codes
    are laid out like float32 moments (the parameter's names under the optimizer state's rules: at ZeRO-3 the
    parameter's own sharding, at ZeRO-1 split over the state axes while the parameter is whole); each device holds
    exactly the analytic model's bytes of the state (memory.optimizer_state_bytes), less than half the whole state.

    Looser: the parameters with 8-bit moments are compared only within STEP_BAND (1/10) of a step, not to the
    sum-order bound, which about 1 in 1,000 of their elements exceeds (measured figures at STEP_BAND; the update on
    its own, from the same state and gradients, is test_int8_update_on_a_mesh_is_one_devices_bit_for_bit). The
    parameters with float32 moments (biases, norms, positions: optax's Adam) are not compared: the fused qkv bias,
    whose key part's gradient is zero but for rounding, differs by 0.18 (fsdp=8) and 0.15 (data=2 x fsdp=4) of a
    step. Not ruled out either: the compiled step all-gathers the codes of the one tensor whose blocks straddle the
    devices' shares (see the comment at the end)."""
    config = _config(mesh, **{**INT8_ADAM, "mesh.zero_stage": stage})
    placement, state, metrics, text = _int8_steps(config, jax.devices()[: int(np.prod(mesh))])
    one_params, one_metrics, _ = _int8_one_device()
    _assert_close(metrics, one_metrics)  # each step's loss sum, token and accuracy counts
    _assert_within_a_step_band(
        jax.device_get(state.params), one_params, state.opt_state[0].mu, config.optimizer.learning_rate
    )
    _assert_int8_state_split_like_its_parameters(state, config, stage, jax.devices()[: int(np.prod(mesh))])
    # The compiled step all-gathers the codes of the one tensor whose blocks straddle the devices' shares: at both
    # meshes two all-gathers of u8[2,32,4,48], the fused qkv kernel, whose 64 x 192 run splits into fsdp shares of 1536
    # elements, not whole blocks (at real sizes the shares are whole blocks). Until the update's chunks kept every
    # axis's split (quantized_state._chunk_counts, 2026-12-07) it also gathered chunks of the output kernel [64, 128]
    # (u8[1,2,8,128] at fsdp8, u8[1,2,16,128] at dp2_fsdp4), one chunk indexed across the fsdp split. Any other
    # tensor's codes gathered fails here.
    gathered = {found.split()[1].split("{")[0] for found in _uint8_collectives(text)}
    assert gathered <= {"u8[2,32,4,48]"}, gathered


def test_int8_state_under_zero_1_is_split_over_the_state_axes_while_the_parameters_stay_whole():
    """The layout half of the ZeRO-1 case above (its training half is slow): at data 2 x fsdp 4, ZeRO-1, the 8-bit
    codes of a kernel are split over fsdp as float32 moments are, the kernel itself is whole over fsdp, and each
    device holds exactly the analytic model's bytes of the state, less than half the whole state."""
    config = _config((2, 4, 1), **{**INT8_ADAM, "mesh.zero_stage": 1})
    state = sharding.placement(config, jax.devices()).init_state()
    _assert_int8_state_split_like_its_parameters(state, config, 1, jax.devices())


def test_int8_update_never_indexes_its_chunks_across_a_split_axis():
    """The 8-bit update's chunks on a parameter whose second axis is split over 8 devices (an expert stack [L, E, ...]
    at mesh.expert = 8) and so small a chunk that the first axis alone does not make enough of them: the compiled
    update moves no uint8 array between devices (its chunks once took one expert index each, and the partitioner
    gathered the whole tensor's codes every iteration: Mixtral 8x7B planned 138.5 GiB a GPU against float32 Adam's
    110.8). Its values are one device's: bit for bit with XLA's default CPU code generation (measured); with the
    tests' flags (LLVM's optimizations off, tests/conftest.py) the two programs' float32 arithmetic fuses apart: 29%
    of the update's elements differ by an ulp or so of their value (up to 1e-8 absolute, 2% of an element near zero)
    and one code of the second moment in 1,048,576 lies one code away (measured)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.train import quantized_state

    shape = (4, 8, 16, 2048)  # [L, E, rows, one block]: each device holds one E index
    tx = quantized_state.scale_by_adam_8bit(chunk_size=2048)  # a block a chunk (per device)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(keys[0], shape)}
    state = tx.init(params)
    state = tx.update({"w": jax.random.normal(keys[1], shape)}, state)[1]  # moments that are not all zero
    grads = {"w": jax.random.normal(keys[2], shape)}
    one = jax.device_get(jax.jit(tx.update)(grads, state))
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    split = NamedSharding(mesh, P(None, "expert"))

    def placed(x):
        return split if x.ndim >= 2 else NamedSharding(mesh, P())

    shardings = jax.tree_util.tree_map(placed, (grads, state))
    with jax.set_mesh(mesh):
        update = jax.jit(tx.update, in_shardings=shardings, out_shardings=jax.tree_util.tree_map(placed, one))
        compiled = update.lower(*jax.device_put((grads, state), shardings)).compile()
        many = jax.device_get(compiled(*jax.device_put((grads, state), shardings)))
    assert _uint8_collectives(compiled.as_text()) == []
    for x, y in zip(jax.tree_util.tree_leaves(many), jax.tree_util.tree_leaves(one), strict=True):
        if x.dtype == np.uint8:  # the codes: a neighbouring code where a moment lies on a rounding boundary
            assert np.mean(x != y) <= 1e-5 and np.abs(x.astype(int) - y).max() <= 1
        else:  # the absmax (equal, measured), the update within an ulp of its largest element
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-6 * np.abs(y).max())


def test_int8_update_on_a_mesh_is_one_devices_bit_for_bit():
    """The 8-bit update alone (the optimizer's, state.tx), on the same state (one device's after 2 steps) and
    gradients: under FSDP over 8, the codes split like the parameters, the new codes are one device's bit for bit
    (asserted) and the absmax and the update within rtol 1e-6 (asserted; the blocks do not depend on the mesh, a
    block's absmax is a maximum, exact in any order). Measured on this branch: every leaf bit for bit, the absmax
    and the update too, whether this test ran alone or after the other 8-bit steps in the same process; commit
    1699fa9 on an older main measured an ulp on 8% of one tensor's update when the other tests ran before (XLA
    fusing a multiply-add apart), hence the float tolerance."""
    config = _config((1, 8, 1), **INT8_ADAM)
    placement = sharding.placement(config, jax.devices()[:8])
    layout, state = placement.layout, placement.init_state()
    params, _, opt_state = _int8_one_device()
    keys = iter(jax.random.split(jax.random.PRNGKey(3), len(jax.tree_util.tree_leaves(params))))
    grads = jax.tree_util.tree_map(lambda p: 1e-2 * jax.random.normal(next(keys), p.shape), params)
    one = jax.device_get(jax.jit(state.tx.update)(grads, opt_state, params))
    inputs = jax.device_put((grads, opt_state, params), (layout.grads, layout.state.opt_state, layout.state.params))
    update = jax.jit(state.tx.update, out_shardings=(layout.grads, layout.state.opt_state))
    with layout.activate():
        many = jax.device_get(update(*inputs))
    for x, y in zip(jax.tree_util.tree_leaves(many), jax.tree_util.tree_leaves(one), strict=True):
        if x.dtype == np.uint8:
            np.testing.assert_array_equal(x, y)  # the codes
        else:  # the absmax (exact, measured) and the update: an ulp where a multiply-add fused apart (measured)
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=0)

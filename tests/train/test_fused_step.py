"""jaxscale.train.fused_step (optimizer.in_backward): each layer updated inside the backward pass gives the parameters
and optimizer state of the plain step (jax.grad of the whole loss, then the optimizer on the whole tree), the compiled
GPU plan holds no whole gradient, and what it cannot do is refused in one line naming the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale import train
from jaxscale.config import ConfigError, base_config, validate
from jaxscale.train import sharding
from jaxscale.train.quantized_state import QuantizedMoment

# One step from the same state: the two programs sum the same products in different fusions (XLA:CPU forms
# multiply-adds where it fuses), measured at most 1.5e-8 apart on parameters of order 0.1-1 and moments of order 1e-3.
ATOL, RTOL = 1e-6, 1e-5


def _config(preset: str, in_backward: bool = True, **fields):
    config = base_config(preset, "fused")
    config.model.scan_layers = True
    config.model.dropout_rate = 0.0  # the fused step draws each layer's dropout mask from its own key
    # autodiff's residuals: the same program both ways, so equal at float32's tolerance (under the closed form the
    # recomputation rounds differently between the two, and Adam's division by a near-zero moment magnifies it: 15
    # of 8,192 elements 1e-4 apart after a step)
    config.model.residuals = "autodiff"
    config.train.num_minibatches = 1
    config.data.batch_size, config.data.seq_len = 4, 32
    config.optimizer.in_backward = in_backward
    for dotted, value in fields.items():
        group, field = dotted.split("__")
        config[group][field] = value
    validate(config)
    return config


def _two_steps(preset: str, in_backward: bool, **fields):
    """The state after two steps (the second from moments the first made) on a fixed random batch."""
    config = _config(preset, in_backward, **fields)
    state = jax.jit(train.make_init_fn(config))()
    batch = train.make_batch(jax.random.PRNGKey(1), 4, 32, config.model.vocab_size)
    step, metrics = train.make_train_step(config), train.init_metrics()
    for _ in range(2):
        state, metrics = step(state, metrics, batch)
    return state, metrics


def _assert_same_state(fused, plain):
    assert jax.tree_util.tree_structure(fused.opt_state) == jax.tree_util.tree_structure(plain.opt_state)
    for name in ("params", "opt_state", "compensation"):
        pairs = zip(jax.tree_util.tree_leaves(getattr(fused, name)), jax.tree_util.tree_leaves(getattr(plain, name)),
                    strict=True)  # fmt: skip
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=ATOL, rtol=RTOL)
            else:  # step counts and 8-bit codes: equal, bar a code one step away where a moment sits on a midpoint
                assert np.mean(np.asarray(a) != np.asarray(b)) <= 1e-3, name
    assert int(fused.step) == int(plain.step) == 2


FAST = [
    ("tiny", dict()),  # Adam, float32 weights and moments, the untied head
    # AdamW's decay on 8-bit moments (whole blocks per layer, and small stacked leaves in float32 for the loop) over
    # bf16 weights with Kahan's buffers, the head tied to the embedding
    (
        "tiny-llama",
        dict(
            optimizer__name="adamw",
            optimizer__weight_decay=0.1,
            optimizer__state_dtype="int8",
            model__param_dtype="bfloat16",
            optimizer__bf16_rounding="kahan",
        ),
    ),  # fmt: skip
]
SLOW = [
    ("tiny", dict(optimizer__name="adamw", optimizer__weight_decay=0.1)),
    ("tiny", dict(optimizer__state_dtype="int8")),
    ("tiny-llama", dict(model__param_dtype="bfloat16", optimizer__bf16_rounding="nearest")),
    ("tiny-llama", dict(model__param_dtype="bfloat16", optimizer__bf16_rounding="master")),  # float32 copies per layer
    ("tiny", dict(optimizer__name="sgd")),
    ("tiny", dict(train__loss_chunk_len=8)),
]


@pytest.mark.parametrize("preset,fields", FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW])
def test_the_fused_step_gives_the_plain_steps_parameters_and_optimizer_state(preset, fields):
    fused, fused_metrics = _two_steps(preset, True, **fields)
    plain, plain_metrics = _two_steps(preset, False, **fields)
    _assert_same_state(fused, plain)
    for name in ("loss_sum", "correct", "tokens"):
        np.testing.assert_allclose(float(fused_metrics[name]), float(plain_metrics[name]), rtol=1e-6)
    if fields.get("optimizer__state_dtype") == "int8":  # the 8-bit state really is 8-bit in the stack
        moments = jax.tree_util.tree_leaves(fused.opt_state, is_leaf=lambda x: isinstance(x, QuantizedMoment))
        assert any(isinstance(m, QuantizedMoment) for m in moments)


@pytest.mark.slow
def test_stochastic_rounding_in_the_fused_step_lands_within_one_bf16_spacing_of_the_plain_step():
    """Stochastic rounding draws each layer's bits from its own key, so a weight may round the other way: never by
    more than one bf16 spacing of the weight, and the optimizer's float32 moments are the plain step's."""
    fused, _ = _two_steps("tiny", True, model__param_dtype="bfloat16", optimizer__bf16_rounding="stochastic")
    plain, _ = _two_steps("tiny", False, model__param_dtype="bfloat16", optimizer__bf16_rounding="stochastic")
    for a, b in zip(jax.tree_util.tree_leaves(fused.params), jax.tree_util.tree_leaves(plain.params), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.abs(a - b) <= np.abs(b) * 2**-7 + 1e-30)


def test_the_gpu_plan_of_the_fused_step_holds_one_layers_gradient_not_the_models():
    """Deviceless H100 plans of the tiny GPT (hidden 256, one sequence of 32: gradients dominate) with 2 and 4 layers,
    Block remat in the plain step so both recompute each layer. Two more layers add two layers' float32 gradients to
    the plain plan's temporaries (counted by hand below) and nothing like that to the fused plan's: it keeps only each
    layer's [B, T, H] input per layer. With optimizer.offload_state the state is paged a layer at a time."""
    from jaxscale.plan import target_compile, targets

    text = targets.target_config_text(targets.get_target("h100"))
    temp, peak = {}, {}
    for in_backward in (False, True):
        for layers in (2, 4):
            config = _config("tiny", in_backward, model__num_layers=layers, model__hidden_size=256,
                             model__head_dim=64, data__batch_size=1)  # fmt: skip
            config.model.remat = ("Block",)
            plan = target_compile.compile_for_target(config, text, 1, "cublas")
            temp[in_backward, layers] = plan["compiled_temp_bytes"]
            peak[in_backward, layers] = plan["compiled_peak_bytes"]
    h, f = 256, 4 * 256
    layer_grad = 4 * (h * 3 * h + 3 * h + h * h + h + h * f + f + f * h + h + 4 * h)  # float32, one GPT layer
    plain_growth = temp[False, 4] - temp[False, 2]
    fused_growth = temp[True, 4] - temp[True, 2]
    assert abs(plain_growth - 2 * layer_grad) <= 0.1 * 2 * layer_grad, (plain_growth, layer_grad)
    assert fused_growth <= 0.1 * layer_grad, (fused_growth, layer_grad)
    assert temp[True, 4] < temp[False, 4] - layer_grad
    # optimizer.offload_state pages the state a layer at a time: its moments are host arguments (2 float32 moments
    # of every parameter, counted from the abstract state), and the device's peak drops by most of them
    config = _config("tiny", True, model__num_layers=4, model__hidden_size=256, model__head_dim=64,
                     data__batch_size=1, optimizer__offload_state=True)  # fmt: skip
    config.model.remat = ("Block",)
    paged = target_compile.compile_for_target(config, text, 1, "cublas")
    abstract = jax.eval_shape(train.make_init_fn(config))
    moments = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(abstract.opt_state)
                  if leaf.ndim > 0)  # fmt: skip
    assert abs(paged["compiled_host_argument_bytes"] - moments) <= 64, (paged["compiled_host_argument_bytes"], moments)
    assert paged["compiled_device_peak_bytes"] <= peak[True, 4] - 0.8 * moments


@pytest.mark.parametrize(
    "fields,field",
    [
        (dict(train__num_minibatches=2, data__batch_size=8), "train.num_minibatches"),
        (dict(optimizer__grad_clip_norm=1.0), "optimizer.grad_clip_norm"),
        (dict(optimizer__name="adafactor"), "optimizer.name"),
        (dict(model__scan_layers=False), "model.scan_layers"),
        (dict(mesh__fsdp=2), "mesh.fsdp"),
        (dict(model__lora_rank=4), "finetune.train"),
        (dict(model__fp8="delayed"), "model.fp8"),
        (dict(train__offload_params=True), "train.offload_params"),
        (dict(optimizer__offload_state=True, optimizer__state_dtype="int8"), "optimizer.state_dtype"),
    ],
)
def test_what_needs_the_whole_gradient_is_refused_in_one_line_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as refused:
        _config("tiny", True, **fields)
    message = str(refused.value)
    assert message.startswith(field) and "\n" not in message and "in_backward" in message


def _placed_two_steps(**fields):
    """Two steps through the run's placement (the layout that puts an offloaded state in pinned host memory)."""
    config = _config("tiny", **fields)
    placement = sharding.placement(config)
    state, step, metrics = placement.init_state(), placement.step(), placement.init_metrics()
    batch = placement.place_batch(train.make_batch(jax.random.PRNGKey(1), 4, 32, config.model.vocab_size))
    for _ in range(2):
        state, metrics = step(state, metrics, batch)
    return state


def test_the_paged_state_stays_on_the_host_and_gives_the_plain_steps_values():
    """optimizer.offload_state with in_backward: the state lives in pinned host memory between steps and each layer's
    slice is brought to the device for its update; after two steps the parameters, moments and Kahan's buffers equal
    the plain step's with the state on the device (bf16 weights, Adam)."""
    fields = dict(model__param_dtype="bfloat16", optimizer__bf16_rounding="kahan")
    paged = _placed_two_steps(in_backward=True, optimizer__offload_state=True, **fields)
    plain = _placed_two_steps(in_backward=False, **fields)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(paged.opt_state)}
    assert kinds == {"pinned_host"}
    _assert_same_state(jax.tree_util.tree_map(np.asarray, paged), jax.tree_util.tree_map(np.asarray, plain))


def test_llama_8b_weights_and_8bit_state_alone_exceed_an_rtx_4090():
    """docs/finetune.md's RTX 4090 sentence: Llama 3.1 8B counted by hand (32 layers of q 4096 x 4096, k and v
    4096 x 1024, out 4096 x 4096, gate, up and down 4096 x 14336, two norms of 4096; embedding and untied output
    128,256 x 4096; final norm 4096) has 8,030,261,248 parameters; bf16 weights (2 bytes) and 8-bit Adam (two 1-byte
    moments and a float32 scale per 2048-element block, every leaf whole blocks) hold 4N + N/256 bytes, 29.9 GiB,
    in the analytic model as in this count, above the RTX 4090's 24 GiB before any activation."""
    from conftest import CONFIGS

    from jaxscale.config import load_config_file
    from jaxscale.measure import memory

    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    n = 32 * layer + 2 * 128_256 * 4096 + 4096
    assert n == 8_030_261_248
    config = load_config_file(CONFIGS / "bf16_remat.py", "llama3.1-8b")
    config.model.param_dtype, config.optimizer.state_dtype, config.optimizer.in_backward = "bfloat16", "int8", True
    config.train.num_minibatches, config.data.seq_len = 1, 2048
    validate(config)
    row = memory.analytic_memory(config)
    held = row["analytic_params_bytes"] + row["analytic_optimizer_bytes"]
    assert abs(held - (4 * n + n // 256)) <= 64, held  # the step counters' few bytes
    assert f"{held / 2**30:.1f}" == "29.9" and held > 24 * 2**30


def test_fits_lever_search_offers_the_update_in_the_backward_pass_where_the_step_allows_it():
    from jaxscale.plan import fit_levers

    def names(**fields):
        return [lever.name for lever in fit_levers.applicable(_config("tiny", False, **fields), False, None)]

    assert "in_backward" in names()
    assert "in_backward" not in names(train__num_minibatches=2, data__batch_size=8)  # accumulation: not offered
    assert "in_backward" not in names(model__scan_layers=False)

"""The 4-bit frozen base (QLoRA, jaxscale.model.nf4) against things derived apart from it.

The NF4 values against bitsandbytes' published table; block-wise quantization, double quantization, packing and
dequantization against a NumPy implementation of the paper's formulas (argmin over the maps, table lookups); the
packed bytes of a hand-made block; the bytes per weight by hand (the paper's 0.127 bits of constants); the model
with an NF4 base against the bf16 model whose kernels are the NF4 kernels dequantized (logits and adapter
gradients); the traced step holding no stacked compute-dtype kernel; training; the frozen state's bytes by hand.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_trees_close,
    bf16_shapes_in_gradient_step,
    nf4_dequantized_states,
    np_blockwise_quantize,
    slow_except,
    train_losses,
)

from jaxscale import train
from jaxscale.config import ConfigError, base_config, validate
from jaxscale.config.quantization import dynamic_map, nf4_map
from jaxscale.measure import memory
from jaxscale.model import nf4

# bitsandbytes' NF4 values as published (bitsandbytes/functional.py, get_4bit_type("nf4"); the same in its CUDA
# kernels' dDequantizeNF4), typed here.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]  # fmt: skip


def test_nf4_values_are_the_published_table():
    """The 16 values built from QLoRA's normal quantiles are bitsandbytes' table, 15 of them exactly and -0.6961928
    within 4 float32 ulps (bitsandbytes' quantiles pass through float32 arithmetic); 0 is exact, 7 negative values
    and 8 positive ones (the asymmetric type of the paper)."""
    code = nf4_map()
    assert code.dtype == np.float32 and code.shape == (16,) and np.all(np.diff(code) > 0)
    np.testing.assert_allclose(code, np.asarray(PUBLISHED_NF4, np.float32), rtol=3.5e-7, atol=0)
    assert (code != np.asarray(PUBLISHED_NF4, np.float32)).sum() <= 1
    assert code[7] == 0.0 and (code < 0).sum() == 7 and (code > 0).sum() == 8 and code[0] == -1 and code[-1] == 1


def np_nf4(kernel: np.ndarray) -> dict[str, np.ndarray]:
    """QLoRA's storage of one kernel in NumPy: NF4 indices per block of 64 (padded with the index of 0), two a byte
    with the even element high; the absmax less its mean, 8-bit indices of the signed dynamic map per block of 256;
    and the dequantized kernel, NF4 value x (dynamic value x scale + mean), in float32."""
    flat = kernel.astype(np.float32).reshape(-1)
    indices, absmax = np_blockwise_quantize(flat, nf4_map(), 64)
    padded = np.full(absmax.size * 64, 7, np.int64)
    padded[: flat.size] = indices
    codes = (padded[0::2] * 16 + padded[1::2]).astype(np.uint8)
    offset = np.float32(absmax.astype(np.float64).mean())
    absmax_codes, scales = np_blockwise_quantize(absmax - offset, dynamic_map(True), 256)
    absmax_back = dynamic_map(True)[absmax_codes] * np.repeat(scales, 256)[: absmax.size] + offset
    values = nf4_map()[padded] * np.repeat(absmax_back, 64)
    return {"codes": codes, "absmax_codes": absmax_codes.astype(np.uint8), "absmax_scales": scales,
            "absmax_offset": offset, "kernel": values[: flat.size].reshape(kernel.shape)}  # fmt: skip


def _kernel(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Normal weights whose scale changes from row to row (0.001 to 1), an all-zero run of rows, exact zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 0, size=(shape[0],) + (1,) * (len(shape) - 1))
    x[1:3] = 0.0
    x.reshape(-1)[::89] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("shape", [(96, 200), (4, 16, 40)], ids=["matrix", "heads"])
def test_quantize_and_dequantize_equal_numpy(shape):
    """Every stored array equals the NumPy implementation's (NF4 and absmax codes exactly, the offset and scales
    within float32 rounding of the mean); the dequantized kernel too (1e-6 relative). 96 x 200 = 300 blocks: two
    groups of absmax, the second partial."""
    kernel = _kernel(0, shape)
    weight, expected = nf4.quantize(jnp.asarray(kernel)), np_nf4(kernel)
    np.testing.assert_array_equal(np.asarray(weight.codes), expected["codes"])
    np.testing.assert_allclose(np.asarray(weight.absmax_offset), expected["absmax_offset"], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(weight.absmax_codes), expected["absmax_codes"])
    np.testing.assert_allclose(np.asarray(weight.absmax_scales), expected["absmax_scales"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nf4.dequantize(weight)), expected["kernel"], rtol=1e-6, atol=1e-9)
    assert weight.shape == shape and nf4.dequantize(weight, jnp.bfloat16).dtype == jnp.bfloat16


def test_stacked_layers_are_quantized_apart():
    """nn.scan's stacked kernel [L, ...]: each layer's arrays are those of the layer quantized alone."""
    kernel = _kernel(1, (3, 64, 48))
    stacked = nf4.quantize(jnp.asarray(kernel), stacked=1)
    for layer in range(3):
        alone = nf4.quantize(jnp.asarray(kernel[layer]))
        for name in ("codes", "absmax_codes", "absmax_scales", "absmax_offset"):
            np.testing.assert_array_equal(np.asarray(getattr(stacked, name)[layer]), np.asarray(getattr(alone, name)))
    np.testing.assert_array_equal(np.asarray(nf4.dequantize(stacked)[2]), np.asarray(nf4.dequantize(alone)))


def test_packed_bytes_of_a_hand_made_block():
    """One block of 64 with absmax 2: 2 -> NF4 index 15 (1.0), -2 -> 0 (-1.0), 0 -> 7, 0.16 -> 0.08 / ... the
    nearest of 0.0796 and 0.1609 to 0.08 is index 8; packed high nibble first: 0xF0, 0x78, then 0x77 (zeros)."""
    block = np.zeros(64, np.float32)
    block[:4] = [2.0, -2.0, 0.0, 0.16]
    weight = nf4.quantize(jnp.asarray(block))
    assert list(np.asarray(weight.codes)[:3]) == [0xF0, 0x78, 0x77] and weight.codes.shape == (32,)
    np.testing.assert_allclose(
        np.asarray(nf4.dequantize(weight))[:4], [2.0, -2.0, 0.0, 2 * PUBLISHED_NF4[8]], rtol=1e-6
    )


def test_bytes_per_weight_by_hand():
    """A 4096 x 4096 kernel: 262,144 blocks of 64 -> 8,388,608 bytes of codes + 262,144 absmax codes + 1,024 groups
    of 256 x 4 bytes + a 4-byte offset = 8,654,852 bytes: 4.1271 bits a weight, 0.1271 of them constants (the paper:
    8/64 + 32/(64 · 256) = 0.127); without double quantization the absmax alone would be 32/64 = 0.5."""
    shape = (4096, 4096)
    weight = jax.eval_shape(nf4.quantize, jax.ShapeDtypeStruct(shape, jnp.float32))
    assert nf4.nbytes(weight) == 8_388_608 + 262_144 + 4 * 1_024 + 4 == memory.nf4_kernel_bytes(shape)
    assert abs(8 * nf4.nbytes(weight) / 4096**2 - 4 - 0.127) < 5e-4
    stacked = jax.eval_shape(lambda k: nf4.quantize(k, stacked=1), jax.ShapeDtypeStruct((3, 64, 100), jnp.float32))
    assert nf4.nbytes(stacked) == memory.nf4_kernel_bytes((3, 64, 100), stacked=1) == 3 * (100 * 32 + 100 + 4 + 4)


def _config(family: str, scan: bool, frozen_dtype: str = "nf4", remat: tuple = (), **model):
    config = base_config("tiny" if family == "gpt" else "tiny-llama", family)
    config.model.update(scan_layers=scan, remat=remat, dropout_rate=0.0, lora_rank=4, lora_targets=("attention",),
                        **model)  # fmt: skip
    config.finetune.frozen_dtype = frozen_dtype
    validate(config)
    return config


def _dequantized_twin(config, state):
    """The bf16-frozen config and a state of it whose frozen kernels are the NF4 state's, dequantized to bfloat16,
    and whose adapters are the NF4 state's with every lora_b set to random values (adapters after some training)."""
    twin = _config(config.model.family, config.model.scan_layers, "bfloat16", tuple(config.model.remat))
    return (twin, *nf4_dequantized_states(state))


@pytest.mark.parametrize(
    "family,scan,remat",
    slow_except(
        [("gpt", True, ("Block",)), ("llama", False, ())],
        lambda case: case[0] == "gpt",
        ids=["gpt-scan-remat", "llama"],
    ),
)
def test_forward_and_adapter_gradients_equal_the_dequantized_bf16_model(family, scan, remat):
    """The NF4 model's logits and its adapters' gradients are those of the bf16 model whose frozen kernels are the NF4
    values dequantized (the same bf16 matmuls; 1e-6 relative), with trained (random) adapters; the gradients
    differ from zero."""
    config = _config(family, scan, remat=remat)
    state = jax.jit(train.make_init_fn(config))()
    twin, twin_state, state = _dequantized_twin(config, state)
    batch = train.make_batch(jax.random.PRNGKey(1), 4, config.data.seq_len, config.model.vocab_size)

    def logits(cfg, st):
        model = train.make_model(cfg, train=False)
        return jax.jit(model.apply)({"params": train.model_params(st.params, st.frozen)}, batch.inputs)

    np.testing.assert_allclose(np.asarray(logits(config, state)), np.asarray(logits(twin, twin_state)), rtol=1e-6,
                               atol=1e-6)  # fmt: skip
    gradients = jax.jit(train.batch_gradients, static_argnums=(3, 4))
    grads = gradients(state, batch, jax.random.PRNGKey(0), 2, "scan")[0]
    expected = gradients(twin_state, batch, jax.random.PRNGKey(0), 2, "scan")[0]
    assert_trees_close(grads, expected, rtol=1e-6, atol=1e-7)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(grads))


def test_the_scanned_step_holds_no_stacked_compute_dtype_kernel():
    """Under nn.scan without remat, the traced gradient step (every sub-jaxpr: the scan body, its transpose) holds
    the bf16 kernels one layer at a time: no array has a stacked kernel's shape [layers, ...] in bfloat16 (a
    dequantized kernel kept as the backward pass's residual would be one), and a single layer's kernel does occur."""
    config = _config("llama", True)
    state = jax.eval_shape(train.make_init_fn(config))
    kernels = [w.shape for w in jax.tree_util.tree_leaves(state.frozen, is_leaf=lambda x: isinstance(x, nf4.Nf4Weight))
               if isinstance(w, nf4.Nf4Weight)]  # fmt: skip
    shapes = bf16_shapes_in_gradient_step(config)
    assert kernels and not {tuple(k) for k in kernels} & shapes
    assert {tuple(k[1:]) for k in kernels} & shapes


def test_adapters_train_on_the_nf4_base():
    """Five steps on one batch, repeated: the loss falls, the adapters move and the NF4 codes are unchanged."""
    config = _config("gpt", True, remat=("Block",))
    config.optimizer.learning_rate = 1e-2
    config.data.batch_size, config.train.num_minibatches = 4, 1
    state = jax.jit(train.make_init_fn(config))()
    step, batch, losses = train.make_train_step(config), None, []
    batch = train.make_batch(jax.random.PRNGKey(0), 4, config.data.seq_len, config.model.vocab_size)
    frozen = jax.tree_util.tree_map(np.asarray, state.frozen)
    before = jax.tree_util.tree_map(np.asarray, state.params)
    for _ in range(5):
        state, metrics = step(state, train.init_metrics(), batch)
        losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
    assert losses[-1] < losses[0] - 0.05, losses
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.tree_util.tree_map(np.asarray, state.frozen), frozen)
    moved = jax.tree_util.tree_map(lambda a, b: bool(np.any(np.asarray(a) != b)), state.params, before)
    assert all(jax.tree_util.tree_leaves(moved))


def test_frozen_state_bytes_by_hand():
    """Tiny gpt, scanned (2 layers, hidden 64, MLP 256, vocab 128, 32 positions), LoRA on attention: per layer the
    NF4 kernels qkv 64 x 192 (192 blocks: 6,144 + 192 + 4 + 4 bytes), out 64 x 64 (64: 2,048 + 64 + 8), up and
    down 64 x 256 (256: 8,192 + 256 + 8 each): 25,376 bytes, 50,752 for 2; in bfloat16 the rest: the embedding
    128 x 64, positions 32 x 64, head 64 x 128 + 128, final norm 2 x 64, and per layer 2 norms (4 x 64) and the
    biases 192 + 64 + 256 + 64: (8,192 + 2,048 + 8,320 + 128 + 2 x 832) x 2 = 40,704 bytes. The analytic model
    counts the same."""
    config = _config("gpt", True)
    state = jax.jit(train.make_init_fn(config))()
    nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.frozen))
    assert nbytes == 50_752 + 40_704
    analytic = memory.analytic_memory(config)["analytic_params_bytes"]
    assert analytic == nbytes + sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.params))
    assert train.param_columns(state)["params"] == train.param_columns(jax.jit(train.make_init_fn(
        _config("gpt", True, "bfloat16")))())["params"]  # fmt: skip


NOT_ADAPTERS = (
    "finetune.frozen_dtype: nf4 is QLoRA's base, frozen in 4 bits under trained LoRA adapters: it needs "
    "finetune.train=adapters (or auto with model.lora_rank > 0), not all; or frozen_dtype=bfloat16"
)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(finetune__train="all"), NOT_ADAPTERS),
        (dict(model__lora_rank=0), NOT_ADAPTERS),
        (
            dict(model__fp8="dynamic"),
            "finetune.frozen_dtype: nf4 kernels are dequantized to model.dtype for their "
            "matmul, which model.fp8=dynamic would run in FP8; use one of the two (model.fp8=none)",
        ),
        (dict(finetune__frozen_dtype="int4"), "finetune.frozen_dtype: unknown 'int4'; allowed: float32, bfloat16, nf4"),
    ],
)
def test_bad_nf4_configs_are_one_line(fields, message):
    config = base_config("tiny", "gpt")
    config.model.lora_rank, config.finetune.frozen_dtype = 4, "nf4"
    for key, value in fields.items():
        group, name = key.split("__")
        config[group][name] = value
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == message


@pytest.mark.slow
def test_nf4_training_follows_the_bf16_base_within_a_band():
    """Ten steps of the tiny gpt with LoRA on attention: the NF4 base's losses within 0.05 of the bf16 base's (the
    model with the same adapters on the base rounded to 4 bits: a slightly different function from step 0)."""
    nf4_losses, _ = train_losses(_config("gpt", True, remat=("Block",)), 10)
    bf16_losses, _ = train_losses(_config("gpt", True, "bfloat16", remat=("Block",)), 10)
    assert np.all(np.isfinite(nf4_losses)) and np.max(np.abs(nf4_losses - bf16_losses)) < 0.05, (
        nf4_losses,
        bf16_losses,
    )

"""8-bit optimizer state (jaxscale.train.quantized_state) against things derived apart from it.

The dynamic quantization map against the data type decoded bit by bit from the paper's description; block-wise
quantization and dequantization against a NumPy implementation of the paper's formulas (argmin over the map, a
table lookup); the float32 path against optax's unmodified Adam; training against float32 Adam's losses; the
state's bytes against a hand count; a mesh run against one device.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, assert_trees_close, load_config, np_blockwise_quantize, train_losses, xla_flags_with
from jax.sharding import PartitionSpec

from jaxscale import train
from jaxscale.config import ConfigError, validate
from jaxscale.config.spec import RunSpec
from jaxscale.measure import memory
from jaxscale.train import quantized_state as q
from jaxscale.train import sharding


def paper_map(signed: bool) -> np.ndarray:
    """The 256 values of the 8-bit dynamic tree data type, decoded byte by byte (Dettmers et al. 2022, section 1.3:
    a sign bit, then as many zero bits as the exponent E (the value is scaled by 10**-E), an indicator bit 1, and
    the remaining bits a linear fraction: bin f of 2**k equal bins of [0.1, 1], its midpoint; section 2.2: the
    unsigned type for the second moment uses the sign bit as one more such bit). bitsandbytes' map keeps 7
    exponents, 10**0 ... 10**-6: the one byte outside them (signed: negative zero; unsigned: 00000001, whose
    indicator is the last bit, 10**-7) holds 1.0 instead."""
    values = []
    for byte in range(256):
        bits = [(byte >> (7 - i)) & 1 for i in range(8)]  # most significant first
        sign, rest = (-1.0 if bits[0] else 1.0, bits[1:]) if signed else (1.0, bits)
        if 1 not in rest:
            values.append(1.0 if sign < 0 else 0.0)  # +0 is zero; -0 is bitsandbytes' 1.0
            continue
        exponent = rest.index(1)
        fraction = rest[exponent + 1 :]
        if exponent == 7:  # unsigned 00000001: outside bitsandbytes' 7 exponents, its 1.0
            values.append(1.0)
            continue
        f = int("".join(map(str, fraction)) or "0", 2)
        values.append(sign * 10.0**-exponent * (0.1 + 0.9 * (f + 0.5) / 2 ** len(fraction)))
    return np.sort(np.asarray(values)).astype(np.float32)


def np_normalized(x: np.ndarray, absmax: np.ndarray, block: int) -> np.ndarray:
    flat = np.asarray(x, np.float32).reshape(-1)
    per = np.repeat(absmax, block)[: flat.size]
    return np.where(per > 0, flat / np.where(per > 0, per, 1), 0).astype(np.float32)


def assert_nearest_codes(actual, expected: np.ndarray, normalized: np.ndarray, code: np.ndarray) -> None:
    """Codes equal, except where an element lies within one float32 spacing of the midpoint between two
    neighbouring codes (a tie the two roundings may break apart): there either neighbour is nearest."""
    actual = np.asarray(actual, np.int64)
    differ = np.flatnonzero(actual != expected)
    assert np.all(np.abs(actual[differ] - expected[differ]) == 1), differ[:10]
    midpoints = (code[actual[differ]].astype(np.float64) + code[expected[differ]]) / 2
    assert np.all(np.abs(normalized[differ] - midpoints) <= np.spacing(np.abs(normalized[differ]))), differ[:10]
    assert differ.size <= max(1, actual.size // 1000)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dynamic_map_is_the_paper_data_type(signed):
    """bitsandbytes' create_dynamic_map (as quantized_state.dynamic_map builds it) is the byte-by-byte decoding,
    within 1e-6 relative (both computed in float64, rounded to float32: a few ulps)."""
    code = q.dynamic_map(signed)
    assert code.shape == (256,) and code.dtype == np.float32 and np.all(np.diff(code) > 0)
    np.testing.assert_allclose(code, paper_map(signed), rtol=1e-6, atol=0)
    # Hand-derived ends: signed -(1 - 0.9/128) (the top bin's midpoint) ... 1; unsigned 0, 10**-6 x 0.325 ... 1.
    ends = (-(1 - 0.9 / 128), 1.0) if signed else (0.0, 1.0)
    np.testing.assert_allclose((code[0], code[-1]), ends, rtol=1e-7)
    if not signed:
        np.testing.assert_allclose(code[1], 0.325e-6, rtol=1e-6)


def _moment_like(seed: int, size: int, block: int) -> np.ndarray:
    """Normal values whose scale changes from block to block (1e-6 ... 1e2), one all-zero block, exact zeros."""
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-6, 2, size=-(-size // block))
    x = rng.standard_normal(size) * np.repeat(scales, block)[:size]
    x[block : 2 * block] = 0.0  # an all-zero block
    x[::97] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("signed", [True, False], ids=["signed_mu", "unsigned_nu"])
@pytest.mark.parametrize("block", [2048, 256])
def test_blockwise_quantize_and_dequantize_equal_numpy(signed, block):
    """Codes and absmax equal the NumPy implementation (codes exact but for float32 ties, absmax exact); the
    dequantized values equal code[codes] x absmax, within half the largest gap between neighbouring codes times
    the block's absmax of the input (float32 rounding of the product aside: 1e-5 relative)."""
    code = paper_map(signed)
    size = 3 * block + block // 2  # a partial last block
    x = _moment_like(1, size, block)
    x = (x if signed else x * x).reshape(4, -1)  # any shape is flattened; the second moment is never negative
    stored = jax.jit(lambda v: q.quantize_blockwise(v, q.dynamic_map(signed), block))(jnp.asarray(x))
    codes, absmax = np_blockwise_quantize(x, code, block)
    assert stored.codes.dtype == jnp.uint8 and stored.codes.shape == (size,)
    np.testing.assert_array_equal(np.asarray(stored.absmax), absmax)
    assert_nearest_codes(stored.codes, codes, np_normalized(x, absmax, block), code)
    restored = np.asarray(q.dequantize_blockwise(stored, q.dynamic_map(signed), x.shape, block))
    expected = (code[np.asarray(stored.codes)] * np.repeat(absmax, block)[:size]).reshape(x.shape)
    np.testing.assert_allclose(restored, expected, rtol=1e-6, atol=0)
    bound = np.repeat(absmax, block)[:size] * np.diff(code.astype(np.float64)).max() / 2
    assert np.all(np.abs(restored.reshape(-1) - x.reshape(-1)) <= bound * (1 + 1e-5))
    assert np.all(restored[x == 0] == 0)  # 0 is a code of both maps: zeros come back exactly


def _tree(seed: int) -> dict:
    """A params-like tree: a quantized matrix with a partial block, a small vector, one exactly at the threshold."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"w": jax.random.normal(keys[0], (5, 1000)), "b": jax.random.normal(keys[1], (4095,)),
            "c": jax.random.normal(keys[2], (4096,))}  # fmt: skip


def _updates(tx, params, steps: int, seed: int = 7):
    state, out = tx.init(params), []
    for i in range(steps):
        key = jax.random.PRNGKey(seed + i)
        grads = jax.tree_util.tree_map(lambda p, key=key: jax.random.normal(key, p.shape) * 1e-2, params)
        update, state = jax.jit(tx.update)(grads, state, params)
        out.append(update)
    return out, state


@pytest.mark.parametrize("weight_decay", [None, 0.1], ids=["adam", "adamw"])
def test_float32_moments_are_optax_adam(weight_decay):
    """Every tensor under min_8bit_size keeps float32 moments: the updates are optax.adam's (optax.adamw's with
    weight decay), unmodified, over three steps."""
    params = _tree(0)
    mine = q.adam_8bit(1e-3, weight_decay=weight_decay, min_8bit_size=10**9)
    reference = optax.adam(1e-3) if weight_decay is None else optax.adamw(1e-3, weight_decay=weight_decay)
    assert_trees_close(_updates(mine, params, 3)[0], _updates(reference, params, 3)[0], rtol=1e-6, atol=0)


def test_first_step_stores_the_numpy_codes_and_updates_like_float32_adam():
    """After one step from zero moments, the stored moments are the NumPy quantization of (1 - b1) g (signed map)
    and (1 - b2) g² (unsigned), and the update is float32 Adam's: the update is computed from the fresh float32
    moments, before they are quantized (as bitsandbytes' kernel does)."""
    params = _tree(0)
    updates, state = _updates(q.adam_8bit(1e-3), params, 1)
    adam_updates, _ = _updates(optax.adam(1e-3), params, 1)
    assert_trees_close(updates[0], adam_updates[0], rtol=1e-6, atol=0)
    grad = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (5, 1000)) * 1e-2)
    moments = state[0]
    for stored, target, signed in ((moments.mu["w"], np.float32(1 - 0.9) * grad, True),
                                   (moments.nu["w"], np.float32(1 - 0.999) * (grad * grad), False)):  # fmt: skip
        codes, absmax = np_blockwise_quantize(target, paper_map(signed), 2048)
        np.testing.assert_allclose(np.asarray(stored.absmax), absmax, rtol=1e-6)
        assert_nearest_codes(stored.codes, codes, np_normalized(target, absmax, 2048), paper_map(signed))
    assert isinstance(moments.mu["c"], q.QuantizedMoment) and moments.mu["b"].dtype == jnp.float32  # 4096 vs 4095


def _train(state_dtype: str, steps: int = 30) -> tuple[np.ndarray, object]:
    """Per-step losses of configs/bf16_remat.py:tiny trained `steps` steps on four random-token batches in turn."""
    config = load_config("bf16_remat", "tiny")
    config.optimizer.state_dtype = state_dtype
    validate(config)
    return train_losses(config, steps)


# Measured on this CPU (the test's own setup): float32 Adam's loss falls 5.38 -> 4.43 over the 30 steps, and the
# int8 state's losses differ from it by at most 0.0031 at any step. The band, 0.02 nats, is 6x that and 2% of
# the fall.
LOSS_BAND = 0.02


def test_int8_state_trains_within_a_band_of_float32_adam():
    float32, _ = _train("float32")
    int8, state = _train("int8")
    assert float32[0] - float32[-1] > 0.5  # it trains: the band is small against the fall
    assert np.abs(int8 - float32).max() < LOSS_BAND, np.abs(int8 - float32)
    assert np.abs(int8 - float32).max() > 0  # the moments were quantized: not float32's program
    moments = state.opt_state[0]
    assert moments.mu["transformer"]["blocks"]["mlp"]["up"]["kernel"].codes.dtype == jnp.uint8


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def test_state_bytes_are_codes_and_absmax_by_hand():
    """A small tree: w 5 x 1000 (5000 elements: blocks of 2048, 2048, 904), b 4095 elements (under 4096: float32),
    c 4096 (quantized, 2 blocks); per moment a byte per element and 4 per block, or 4 per element."""
    state = q.adam_8bit(1e-3).init(_tree(0))[0]
    w, b, c = 5000 + 4 * 3, 4 * 4095, 4096 + 4 * 2
    assert _nbytes(state.mu) == _nbytes(state.nu) == w + b + c
    assert memory.int8_moment_bytes(5000) == w and memory.int8_moment_bytes(4096) == c
    assert {x.dtype for x in jax.tree_util.tree_leaves(state.mu["w"])} == {jnp.dtype(jnp.uint8), jnp.dtype(jnp.float32)}


def test_tiny_models_state_bytes_by_hand_are_the_memory_models():
    """configs/bf16_remat.py:tiny (the gpt, hidden 64, 2 scanned layers, vocab 128, seq 32, MLP 256), by hand.
    Quantized (>= 4096 elements): embedding 128x64 and output kernel 64x128 (8192, 4 blocks each), and stacked over
    the 2 layers qkv 2x64x192 (24576: 12 blocks), out 2x64x64 (8192: 4), up 2x64x256 and down 2x256x64 (32768: 16
    each): 114688 elements, 56 blocks. Float32: pos_emb 32x64, output bias 128, final norm 2 x 64, and per layer
    the qkv bias 192, out bias 64, up bias 256, down bias 64, two norms 4 x 64 (x 2 layers): 3968 elements."""
    config = load_config("bf16_remat", "tiny")
    config.optimizer.state_dtype = "int8"
    validate(config)
    by_hand = 2 * (114688 + 4 * 56) + 2 * 4 * 3968
    adam = jax.eval_shape(train.make_init_fn(config)).opt_state[0]
    assert _nbytes(adam.mu) + _nbytes(adam.nu) == by_hand == memory.optimizer_state_bytes(RunSpec.from_config(config))
    assert memory.analytic_memory(config)["analytic_optimizer_bytes"] == by_hand


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(name="sgd"), "optimizer.state_dtype: int8 (block-wise quantized Adam moments) needs optimizer.name "
         "adam or adamw, got sgd; allowed with sgd: float32, bfloat16"),
        (dict(name="adafactor"), "optimizer.state_dtype: int8 (block-wise quantized Adam moments) needs "
         "optimizer.name adam or adamw, got adafactor; allowed with adafactor: float32"),
    ],
    ids=["sgd", "adafactor"],
)  # fmt: skip
def test_int8_with_another_optimizer_is_one_line(fields, message):
    config = load_config("bf16_remat", "tiny")
    config.optimizer.update(state_dtype="int8", **fields)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == message and "\n" not in str(error.value)


def test_frozen_dtype_does_not_take_int8():
    config = load_config("bf16_remat", "tiny")
    config.finetune.frozen_dtype = "int8"
    with pytest.raises(ConfigError, match=r"^finetune.frozen_dtype: unknown 'int8'; allowed: float32, bfloat16, nf4$"):
        validate(config)


# Measured on this CPU: over 3 steps the fsdp=2 losses differ from one device's by at most 0.0004 (float32 sums in
# another order move a few elements across a code boundary). The band is 10x that.
MESH_BAND = 5e-3


def _mesh_run(fsdp: int, steps: int = 3):
    config = load_config("bf16_remat", "tiny")
    config.optimizer.state_dtype = "int8"
    config.model.dropout_rate = 0.0
    config.mesh.fsdp = fsdp
    validate(config)
    placement = sharding.placement(config)
    state, step, losses = placement.init_state(), placement.step(), []
    for i in range(steps):
        batch = train.make_batch(jax.random.PRNGKey(i), config.data.batch_size, config.data.seq_len,
                                 config.model.vocab_size)  # fmt: skip
        state, metrics = step(state, placement.init_metrics(), placement.place_batch(batch))
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
    return config, state, np.asarray(losses)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices: run by test_fsdp_on_2_simulated_cpu_devices")
def test_fsdp_int8_state_is_split_and_trains_as_one_device():
    """Under mesh.fsdp=2 the parameters are split, and the codes like them (the absmax by the axes before the
    blocks' run), the small tensors' float32 moments laid out like their parameters; each device holds what the
    memory model counts; the losses follow one device's within MESH_BAND."""
    config, state, losses = _mesh_run(2)
    _, _, one = _mesh_run(1)
    np.testing.assert_allclose(losses, one, rtol=0, atol=MESH_BAND)
    moments, params = state.opt_state[0], state.params
    up = moments.mu["transformer"]["blocks"]["mlp"]["up"]
    assert up["kernel"].codes.sharding == params["transformer"]["blocks"]["mlp"]["up"]["kernel"].sharding
    assert not up["kernel"].codes.sharding.is_fully_replicated
    assert up["bias"].sharding == params["transformer"]["blocks"]["mlp"]["up"]["bias"].sharding
    held: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves((moments.mu, moments.nu)):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    assert held == {device.id: memory.optimizer_state_bytes(RunSpec.from_config(config)) for device in jax.devices()}


def test_layout_splits_the_codes_like_their_parameters_and_small_moments_too():
    """The layout's logical names (sharding.state_specs, what make_layout turns into NamedShardings on any mesh): a
    quantized moment's codes its parameter's names, its absmax the names of the axes before the blocks' run and an
    unnamed blocks' axis (the up kernel [2, 64, 256]: run 64 x 256, 8 blocks a layer); a flat moment (5 x 1000: no
    run of whole blocks) replicated; a small tensor's float32 moment its parameter's."""
    config = load_config("bf16_remat", "tiny")
    config.optimizer.state_dtype = "int8"
    boxed = jax.eval_shape(train.make_init_fn(config, boxed=True))
    names = sharding.logical_specs(train.model_params(boxed.params, boxed.frozen))
    specs = sharding.state_specs(jax.eval_shape(train.make_init_fn(config)), names).opt_state[0]
    up, up_names = specs.mu["transformer"]["blocks"]["mlp"]["up"], names["transformer"]["blocks"]["mlp"]["up"]
    assert up_names["kernel"] == PartitionSpec("layers", "embed", "mlp")
    assert up["kernel"] == q.QuantizedMoment(codes=up_names["kernel"], absmax=PartitionSpec("layers", None))
    assert up["bias"] == up_names["bias"] == PartitionSpec("layers", "mlp")
    flat = q.quantize_blockwise(jnp.ones((5, 1000)), q.dynamic_map(True))
    assert flat.codes.shape == (5000,) and flat.absmax.shape == (3,)
    assert q.moment_specs(flat, (5, 1000), PartitionSpec("embed", "mlp")) == q.QuantizedMoment(
        PartitionSpec(), PartitionSpec()
    )


def test_blocks_are_the_flattened_tensors_blocks_bit_for_bit():
    """A blocked moment's codes and absmax, flattened, are those of the same elements quantized as one flat vector
    (moment_blocks: the blocks are the flattened tensor's every 2048 elements), and two 8-bit Adam steps on a
    [2, 64, 256] parameter equal those on its flattened copy bit for bit (updates, codes, absmax)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 256))
    shaped, flat = (q.quantize_blockwise(v, q.dynamic_map(True)) for v in (x, x.reshape(-1)))
    assert shaped.codes.shape == (2, 64, 256) and shaped.absmax.shape == (2, 8)
    np.testing.assert_array_equal(np.asarray(shaped.codes).reshape(-1), flat.codes)
    np.testing.assert_array_equal(np.asarray(shaped.absmax).reshape(-1), flat.absmax)
    tx = q.adam_8bit(1e-3, chunk_size=2**12)
    a, b = _updates(tx, {"w": x}, 2)[1], _updates(tx, {"w": x.reshape(-1)}, 2)[1]
    for m, n in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(m).reshape(-1), np.asarray(n).reshape(-1))


@pytest.mark.slow  # a fresh process compiling two steps: tens of seconds; the layout test above is the fast check
def test_fsdp_on_2_simulated_cpu_devices():
    """Runs test_fsdp_int8_state_is_replicated_and_trains_as_one_device in a process with 2 simulated CPU devices
    (XLA reads the flag when its CPU backend starts, so it cannot be set in this process)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=2"), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))  # fmt: skip
    selected = (str(pathlib.Path(__file__).resolve()), "-k", "test_fsdp_int8_state_is_split")
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *selected]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout, done.stdout[-2000:]


# Three parameters of 2**20 float32 elements; their float32 moments (mu and nu, 8 bytes an element) are 8 MiB each.
UPDATE_SHAPES = ((1024, 1024), (256, 4096), (2**20,))
ONE_PARAMETERS_MOMENTS = 8 * 2**20


def test_update_holds_one_chunk_of_float32_moments_not_the_trees():
    """XLA's plan (this CPU's compile of the update alone) of the 8-bit step on three parameters of 2**20 elements,
    2**15 elements (16 blocks) at a time, holds in temporaries less than one parameter's float32 mu and nu (8 MiB;
    the tree's are 24 MiB): what it may hold is one parameter's gradient (4 MiB: the loop updates it in place, and
    an argument that is not donated is copied first) and one chunk's temporaries (2**15 elements: 2 MiB even at 64
    bytes an element). The same step written over the whole tree (every moment dequantized, optax.scale_by_adam,
    every moment quantized: the update before it was chunked) holds more than the bound."""
    grads = {f"p{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i, shape in enumerate(UPDATE_SHAPES)}
    chunked = q.scale_by_adam_8bit(chunk_size=2**15)
    state = jax.eval_shape(chunked.init, grads)
    adam, signed, unsigned = optax.scale_by_adam(), q.dynamic_map(True), q.dynamic_map(False)

    def whole_tree(updates, state):
        def load(moments, code):
            return jax.tree_util.tree_map(lambda m, g: q.dequantize_blockwise(m, code, g.shape), moments, updates,
                                          is_leaf=lambda x: isinstance(x, q.QuantizedMoment))  # fmt: skip

        def store(moments, code):
            return jax.tree_util.tree_map(lambda x: q.quantize_blockwise(x, code), moments)

        updates, new = adam.update(updates, state._replace(mu=load(state.mu, signed), nu=load(state.nu, unsigned)))
        return updates, new._replace(mu=store(new.mu, signed), nu=store(new.nu, unsigned))

    def temp_bytes(update) -> int:
        return jax.jit(update).lower(grads, state).compile().memory_analysis().temp_size_in_bytes

    chunked_bytes, whole_bytes = temp_bytes(chunked.update), temp_bytes(whole_tree)
    assert chunked_bytes < ONE_PARAMETERS_MOMENTS, chunked_bytes
    assert whole_bytes > ONE_PARAMETERS_MOMENTS * len(UPDATE_SHAPES), whole_bytes  # the tree's moments and more

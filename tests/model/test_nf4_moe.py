"""QLoRA's 4-bit base on a mixture of experts (jaxscale.model.nf4, jaxscale.model.moe): the stacked experts frozen in
NF4, each expert quantized alone; the model against the bf16 model whose weights are the NF4 values dequantized
(logits and adapter gradients, every dispatch); no stacked bf16 expert weight kept for the backward pass; the frozen
state's bytes by hand and the analytic model's count of them; the compiled step's argument bytes against the bf16
base less a hand count of the saving; expert parallelism refused in one line."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, bf16_shapes_in_gradient_step, nf4_dequantized_states, slow_except
from flax import traverse_util

from jaxscale import train
from jaxscale.config import base_config, validate
from jaxscale.measure import memory
from jaxscale.model import nf4
from jaxscale.train import checkpoint

EXPERT_WEIGHTS = ("gate", "up", "down")


def _config(frozen_dtype: str = "nf4", scan: bool = False, **model):
    """tiny-moe (2 layers, hidden 64, 4 heads of 16, 2 kv heads, 4 experts of width 32, vocab 128, tied) in bf16,
    LoRA rank 4 on attention: every projection kernel and expert weight frozen."""
    config = base_config("tiny-moe", "nf4-moe")
    config.model.update(scan_layers=scan, lora_rank=4, lora_targets=("attention",), **model)
    config.finetune.frozen_dtype = frozen_dtype
    validate(config)
    return config


@functools.cache
def _initial_state(scan: bool = False):
    """The jitted init of _config(scan=scan), built once a test process: three tests read the unrolled one (none
    donates or changes it), each of which compiled the same init program before."""
    return jax.jit(train.make_init_fn(_config(scan=scan)))()


def _is_nf4(x) -> bool:
    return isinstance(x, nf4.Nf4Weight)


def _frozen(state) -> dict:
    return traverse_util.flatten_dict(state.frozen, sep="/", is_leaf=lambda _, x: _is_nf4(x))


def test_stacked_experts_are_nf4_each_expert_quantized_alone():
    """Under nf4 the experts' gate, up and down are NF4 (the router stays bf16), and expert e's arrays are those of its
    float32 weight [H, F] (or [F, H]) quantized alone: the blocks of 64 never straddle two experts (the codes exactly;
    the offset and scales within float32 rounding of the mean, 1e-5 relative, jitted against eager)."""
    frozen = _frozen(_initial_state())
    full = _config("bfloat16")
    full.finetune.train = "all"  # the same init, every weight float32 and trained
    weights = traverse_util.flatten_dict(jax.jit(train.make_init_fn(full))().params, sep="/")
    for layer in range(2):
        prefix = f"transformer/block_{layer}/mlp"
        assert frozen[f"{prefix}/router/kernel"].dtype == jnp.bfloat16
        for name in EXPERT_WEIGHTS:
            stored, weight = frozen[f"{prefix}/experts/{name}"], weights[f"{prefix}/experts/{name}"]
            assert _is_nf4(stored) and stored.shape == weight.shape == ((4, 64, 32) if name != "down" else (4, 32, 64))
            assert stored.codes.shape == (4, 2048 // 2)  # per expert 2,048 weights, 32 blocks of 64, two a byte
            for expert in range(4):
                alone = nf4.quantize(weight[expert])
                for field in ("codes", "absmax_codes"):
                    np.testing.assert_array_equal(np.asarray(getattr(stored, field)[expert]),
                                                  np.asarray(getattr(alone, field)))  # fmt: skip
                for field in ("absmax_scales", "absmax_offset"):
                    np.testing.assert_allclose(np.asarray(getattr(stored, field)[expert]),
                                               np.asarray(getattr(alone, field)), rtol=1e-5)  # fmt: skip


def test_init_from_quantizes_the_loaded_experts_to_nf4(tmp_path):
    """finetune.init_from (jaxscale.train.checkpoint): a full-training tiny-moe run's experts become, expert by expert,
    the NF4 codes of the loaded values; the router stays bfloat16 (the loaded values cast)."""
    base = base_config("tiny-moe", "base")
    trained = jax.tree_util.tree_map(lambda x: x + 0.5, jax.jit(train.make_init_fn(base))())
    saver = checkpoint.Checkpoints(tmp_path / "base" / "checkpoints", base)
    saver.save(2, trained, {})
    saver.close()
    config = _config()
    config.finetune.init_from = str(tmp_path / "base")
    frozen = _frozen(checkpoint.with_base_params(_initial_state(), config))  # _config()'s init (init_from: the load)
    loaded = traverse_util.flatten_dict(trained.params, sep="/")
    prefix = "transformer/block_1/mlp"
    assert frozen[f"{prefix}/router/kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(frozen[f"{prefix}/router/kernel"]),
                                  np.asarray(loaded[f"{prefix}/router/kernel"].astype(jnp.bfloat16)))  # fmt: skip
    for name in EXPERT_WEIGHTS:
        stored, weight = frozen[f"{prefix}/experts/{name}"], loaded[f"{prefix}/experts/{name}"]
        assert _is_nf4(stored)
        np.testing.assert_array_equal(np.asarray(stored.codes[3]), np.asarray(nf4.quantize(weight[3]).codes))


def _dequantized_twin(config, state):
    """The bf16-frozen config and a state of it whose frozen weights are the NF4 state's dequantized to bfloat16, and
    whose adapters are the NF4 state's with every lora_b random (adapters after some training)."""
    twin = _config("bfloat16", config.model.scan_layers, moe_dispatch=config.model.moe_dispatch)
    return (twin, *nf4_dequantized_states(state))


@pytest.mark.parametrize(
    "dispatch,scan",
    slow_except(
        [("ragged", True), ("capacity", False), ("scatter", True), ("dense", False)],
        lambda case: case[0] == "ragged",
        ids=["ragged-scan", "capacity", "scatter-scan", "dense"],
    ),
)
def test_forward_and_adapter_gradients_equal_the_dequantized_bf16_model(dispatch, scan):
    """The model with NF4 experts (and attention kernels) computes the logits and adapter gradients of the bf16 model
    whose frozen weights are the NF4 values dequantized (the same bf16 matmuls; 1e-6 relative, as for the Dense
    kernels in test_nf4), with trained (random) adapters; the gradients differ from zero."""
    config = _config(scan=scan, moe_dispatch=dispatch)
    state = jax.jit(train.make_init_fn(config))()
    twin, twin_state, state = _dequantized_twin(config, state)
    assert not any(_is_nf4(x) for x in jax.tree_util.tree_leaves(twin_state.frozen, is_leaf=_is_nf4))
    batch = train.make_batch(jax.random.PRNGKey(1), 4, config.data.seq_len, config.model.vocab_size)

    def logits(cfg, st):
        model = train.make_model(cfg, train=False)
        return jax.jit(model.apply)({"params": train.model_params(st.params, st.frozen)}, batch.inputs)

    np.testing.assert_allclose(np.asarray(logits(config, state), np.float32),
                               np.asarray(logits(twin, twin_state), np.float32), rtol=1e-6, atol=1e-6)  # fmt: skip
    gradients = jax.jit(train.batch_gradients, static_argnums=(3, 4))
    grads = gradients(state, batch, jax.random.PRNGKey(0), 2, "scan")[0]
    expected = gradients(twin_state, batch, jax.random.PRNGKey(0), 2, "scan")[0]
    assert_trees_close(grads, expected, rtol=1e-6, atol=1e-7)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(grads))


def test_the_scanned_step_holds_no_stacked_bf16_expert_weight():
    """Under nn.scan without remat the traced gradient step (the scan body and its transpose included) holds the
    experts' bf16 weights one layer at a time: no bfloat16 array of a stacked expert weight's shape [2, 4, 64, 32]
    or [2, 4, 32, 64] (a dequantized weight kept as the backward pass's residual would be one), while a layer's
    [4, 64, 32] occurs. Minibatches of 3 rows, so that no activation [rows, 32, 64] has an expert weight's shape."""
    config = _config(scan=True)
    config.data.batch_size = 6
    shapes = bf16_shapes_in_gradient_step(config)
    assert not {(2, 4, 64, 32), (2, 4, 32, 64)} & shapes
    assert {(4, 64, 32), (4, 32, 64)} <= shapes


# Bytes by hand, per layer of tiny-moe. NF4, per kernel of n weights in b = n / 64 blocks: 32 b codes + b absmax
# codes + 4 (one group's scale) + 4 (the offset). q and out 4,096 weights (64 blocks): 2,048 + 64 + 8 = 2,120; k and v
# 2,048 (32 blocks): 1,024 + 32 + 8 = 1,064; each expert's gate, up, down 64 x 32 = 2,048: 1,064, x 4 experts x 3.
ATTENTION_NF4 = 2 * 2_120 + 2 * 1_064  # 6,368
EXPERTS_NF4 = 3 * 4 * 1_064  # 12,768
# bf16: the tied embedding 128 x 64, the final norm 64, per layer two norms 2 x 64 and the router 64 x 4.
REST_BF16 = 2 * (128 * 64 + 64 + 2 * (2 * 64 + 64 * 4))  # 18,048
# The bf16 base's attention kernels 2 x (4,096 + 2,048) x 2 bytes and experts 3 x 4 x 2,048 x 2 bytes a layer.
ATTENTION_BF16, EXPERTS_BF16 = 24_576, 49_152


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_frozen_state_bytes_by_hand(scan):
    """The frozen state of tiny-moe under nf4: 2 x (6,368 + 12,768) + 18,048 = 56,320 bytes (the experts 25,536 of
    them, against 98,304 in bf16); the analytic model's parameter bytes are the state's."""
    config, state = _config(scan=scan), _initial_state(scan)
    nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.frozen))
    assert nbytes == 2 * (ATTENTION_NF4 + EXPERTS_NF4) + REST_BF16 == 56_320
    trained = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.params))
    assert memory.analytic_memory(config)["analytic_params_bytes"] == 56_320 + trained


def test_compiled_arguments_drop_by_the_hand_counted_saving():
    """The compiled train step's (CPU) argument bytes: the nf4 base's are the bf16 base's less 2 x ((24,576 - 6,368)
    + (49,152 - 12,768)) = 109,184 bytes (72,768 of them the experts'), within 256 bytes."""
    saving = 2 * ((ATTENTION_BF16 - ATTENTION_NF4) + (EXPERTS_BF16 - EXPERTS_NF4))
    assert saving == 109_184

    def argument_bytes(config):
        step = train.make_train_step(config)
        return step.lower(*train.abstract_inputs(config)).compile().memory_analysis().argument_size_in_bytes

    drop = argument_bytes(_config("bfloat16")) - argument_bytes(_config())
    assert abs(drop - saving) <= 256, drop


@pytest.mark.parametrize("scan", [False, True])
def test_nf4_experts_carry_the_expert_name_the_layout_splits(scan):
    """The stacked experts' NF4 arrays name their leading dims as their bf16 twin's ("layers" under nn.scan, then
    "expert"), so mesh.expert splits each device's experts' codes (tests/train/test_sharding_devices.py -k nf4: equal
    to one device on an expert mesh); a projection kernel's codes name only nn.scan's layers, replicated as before."""
    from jax.sharding import PartitionSpec

    from jaxscale.train import sharding, step

    config = _config(scan=scan)
    boxed = jax.eval_shape(step.make_init_fn(config, boxed=True))
    specs = traverse_util.flatten_dict(sharding.logical_specs(boxed.frozen), sep="/",
                                       is_leaf=lambda _, x: _is_nf4(x))  # fmt: skip
    layers = ("layers",) if scan else ()
    block = "transformer/blocks" if scan else "transformer/block_0"
    gate, q = specs[f"{block}/mlp/experts/gate"], specs[f"{block}/attn/q/kernel"]
    assert gate.codes == gate.absmax_offset == PartitionSpec(*layers, "expert")
    assert q.codes == PartitionSpec(*layers)

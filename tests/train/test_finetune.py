"""Fine-tuning: LoRA adapters, frozen parameters, the optimizer's first moment in bfloat16.

Each is checked against something derived apart from it: an untrained adapter against the model without one,
trained adapters against their merged kernels, the step's adapter gradients against autodiff through the
merge, frozen-block gradients against full training's, parameter counts by hand, and the analytic memory
model against the bytes of the real state.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, slow_except
from flax import traverse_util

from jaxscale import run, train
from jaxscale.config import ConfigError, base_config, finetune, validate
from jaxscale.measure import memory, params
from jaxscale.model import lora


def _config(family: str = "llama", scan: bool = False, dtype: str = "float32", **fields):
    config = base_config("tiny" if family == "gpt" else "tiny-llama", family)
    config.model.update(dtype=dtype, scan_layers=scan, dropout_rate=0.0)
    for key, value in fields.items():
        group, name = key.split("__")
        config[group][name] = value
    validate(config)
    return config


def _batch(config):
    return train.make_batch(jax.random.PRNGKey(1), 4, config.data.seq_len, config.model.vocab_size)


def _init(config):
    return jax.jit(train.make_init_fn(config))()


def _gradients(state, batch, num_minibatches):
    return jax.jit(train.batch_gradients, static_argnums=(3, 4))(state, batch, jax.random.PRNGKey(0), num_minibatches,
                                                                 "scan")  # fmt: skip


def _flat(tree) -> dict:
    return traverse_util.flatten_dict(tree, sep="/")


def _logits(config, model_params, batch):
    return jax.jit(train.make_model(config, train=False).apply)({"params": model_params}, batch.inputs)


def _randomize_adapters(model_params, seed: int = 3):
    """Every lora_b set to random values (an adapter after some training), so it changes the function."""
    flat = _flat(model_params)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(flat)))
    for path, value in flat.items():
        if path.endswith("lora_b"):
            flat[path] = 0.05 * jax.random.normal(next(keys), value.shape)
    return traverse_util.unflatten_dict(flat, sep="/")


@pytest.mark.parametrize("family,scan", slow_except([("gpt", False), ("llama", True)], lambda c: c[0] == "llama"))
def test_untrained_adapters_leave_the_base_model_unchanged(family, scan):
    """With B = 0 (LoRA's init) the model with adapters on every projection is the base model, bit for bit."""
    adapted = _config(family, scan, dtype="bfloat16", model__lora_rank=4, model__lora_targets=("all",))
    base = _config(family, scan, dtype="bfloat16")
    state = _init(adapted)
    with_adapters = train.model_params(state.params, state.frozen)
    without = {k: v for k, v in _flat(with_adapters).items() if not k.endswith(("lora_a", "lora_b"))}
    assert len(without) < len(_flat(with_adapters))
    batch = _batch(base)
    expected = _logits(base, traverse_util.unflatten_dict(without, sep="/"), batch)
    np.testing.assert_array_equal(np.asarray(_logits(adapted, with_adapters, batch)), np.asarray(expected))


@pytest.mark.parametrize("family,scan", slow_except([("gpt", True), ("llama", False)], lambda c: c[0] == "gpt"))
def test_merged_adapters_compute_the_same_function(family, scan):
    """Trained adapters folded into their kernels (W + alpha/r A B) give the base model the same logits."""
    adapted = _config(family, scan, model__lora_rank=4, model__lora_targets=("all",), model__lora_alpha=8.0,
                      finetune__frozen_dtype="float32")  # the merged kernels unrounded
    state = _init(adapted)
    trained = _randomize_adapters(train.model_params(state.params, state.frozen))
    merged = lora.merge(trained, train.make_model(adapted).config)
    assert not any(k.endswith(("lora_a", "lora_b")) for k in _flat(merged))
    batch = _batch(adapted)
    expected = _logits(_config(family, scan), merged, batch)
    assert not np.allclose(expected, _logits(_config(family, scan), _without_adapters(trained), batch), atol=1e-3)
    np.testing.assert_allclose(_logits(adapted, trained, batch), expected, rtol=2e-5, atol=2e-5)


def _without_adapters(model_params):
    return traverse_util.unflatten_dict(
        {k: v for k, v in _flat(model_params).items() if not k.endswith(("lora_a", "lora_b"))}, sep="/"
    )


def test_adapter_gradients_equal_autodiff_through_the_merge():
    """The step's gradients of lora_a and lora_b (frozen base) equal jax.grad of the base model's loss at the
    merged kernels W + alpha/r A B, taken with respect to A and B: the same derivative by another route."""
    config = _config("llama", model__lora_rank=2, model__lora_targets=("q", "v", "down"), finetune__train="adapters",
                     finetune__frozen_dtype="float32")  # fmt: skip
    state = _init(config)
    state = state.replace(params=_randomize_adapters(state.params))
    batch = _batch(config)
    grads, _ = _gradients(state, batch, 1)
    base, cfg = _config("llama"), train.make_model(config).config
    apply_fn = train.make_model(base).apply

    def merged_loss(adapters):
        merged = lora.merge(train.model_params(adapters, state.frozen), cfg)
        return train.next_token_loss(merged, apply_fn, batch, jax.random.PRNGKey(0))[0]

    assert set(_flat(grads)) == {k for k in _flat(state.params)} and all("lora" in k for k in _flat(grads))
    assert_trees_close(grads, jax.jit(jax.grad(merged_loss))(state.params), rtol=2e-4, atol=1e-6)


def test_frozen_blocks_get_full_trainings_gradients_and_never_move():
    """finetune.train=last_blocks: the top block's and the head's gradients (tiny-llama ties its embeddings, so
    the head is the token embedding) are full training's for those parameters; after a step the frozen ones
    (kept in bfloat16) are unchanged and the trained ones moved."""
    config = _config("llama", finetune__train="last_blocks", finetune__last_blocks=1, finetune__head=True,
                     finetune__frozen_dtype="float32")  # fmt: skip
    full = _config("llama")
    batch = _batch(config)
    state, full_state = _init(config), _init(full)
    grads, _ = _gradients(state, batch, 2)
    full_grads, _ = _gradients(full_state, batch, 2)
    trained = _flat(grads)
    head = ("transformer/block_1/", "embed/embedding", "post_norm/")
    assert set(trained) == {k for k in _flat(full_grads) if k.startswith(head)}
    assert_trees_close(trained, {k: _flat(full_grads)[k] for k in trained}, rtol=1e-5, atol=1e-7)

    bf16 = _config("llama", finetune__train="last_blocks", finetune__last_blocks=1, optimizer__warmup_steps=0)
    start = _init(bf16)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(start.frozen)} == {jnp.dtype(jnp.bfloat16)}
    after, _ = train.make_train_step(bf16)(jax.tree_util.tree_map(jnp.copy, start), train.init_metrics(), batch)
    assert_trees_close(after.frozen, start.frozen, rtol=0, atol=0)
    before = jax.tree_util.tree_leaves(start.params)
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(after.params), before, strict=True))


def test_trainable_counts_by_hand():
    """tiny-llama (H 64, 4 heads x 16, 2 K/V heads, MLP 192, 2 layers), rank 4: q 4(64+64), k and v 4(64+32),
    out 4(64+64), gate and up 4(64+192), down 4(192+64), per layer; gpt (tiny: H 64, fused QKV 192, MLP 256)
    attention only: qkv 4(64+192), out 4(64+64)."""
    llama = _config("llama", model__lora_rank=4, model__lora_targets=("all",), finetune__train="adapters")
    per_layer = 4 * (128 + 96 + 96 + 128 + 256 + 256 + 256)
    counts = train.param_columns(jax.eval_shape(train.make_init_fn(llama)))
    assert counts["trainable_params"] == 2 * per_layer == 9728
    assert counts["params"] == params.param_count(llama.model) == 106_816 + 9728  # tiny-llama's own count + adapters
    gpt = _config("gpt", model__lora_rank=4, finetune__train="adapters", finetune__head=True)
    counts = train.param_columns(jax.eval_shape(train.make_init_fn(gpt)))
    head = 64 * 128 + 128 + 2 * 64  # output kernel and bias, final LayerNorm
    assert counts["trainable_params"] == 2 * 4 * (64 + 192 + 64 + 64) + head


def test_a_lora_rank_alone_trains_the_adapters_with_the_base_frozen():
    """model.lora_rank=4 with finetune.train left at its default ("auto"): the adapters train and the base is frozen
    in bfloat16, as PEFT and torchtune do; tiny-llama's attention adapters by hand: q 4(64+64), k and v 4(64+32),
    out 4(64+64) per layer, 2 layers = 3,584. finetune.train=all trains the base too; no adapters: everything."""
    state = jax.eval_shape(train.make_init_fn(_config("llama", model__lora_rank=4)))
    assert all(path.endswith(("lora_a", "lora_b")) for path in _flat(state.params))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(state.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert train.param_columns(state) == {"params": 106_816 + 3584, "trainable_params": 3584}
    everything = jax.eval_shape(train.make_init_fn(_config("llama", model__lora_rank=4, finetune__train="all")))
    assert train.param_columns(everything) == {"params": 106_816 + 3584, "trainable_params": 106_816 + 3584}
    base = jax.eval_shape(train.make_init_fn(_config("llama")))
    assert train.param_columns(base) == {"params": 106_816, "trainable_params": 106_816} and not base.frozen


def test_the_run_summary_says_what_trains(tmp_path, capsys, monkeypatch):
    """--plan of the tiny gpt (118,656 parameters) with rank-4 adapters on qkv and out, 4(64+192) + 4(64+64) per
    layer, 2 layers = 3,072: the summary names the adapters, the count and the frozen base's dtype."""
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    code = run.main(["jaxscale.run", "--config", "configs/bf16.py:tiny", "--config.model.lora_rank=4", "--plan",
                     "--output_root", str(tmp_path)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "  trains: LoRA adapters (3,072 of 121,728 params), base frozen in bfloat16\n" in out, out


@pytest.mark.parametrize(
    "fields,line",
    [
        ({}, "  trains: all 118,656 params"),
        ({"config.finetune.train": "all", "config.model.lora_rank": 4},
         "  trains: all 121,728 params (the base and the LoRA adapters)"),
        ({"config.finetune.train": "last_blocks", "config.finetune.last_blocks": 1, "config.finetune.head": True,
          "config.finetune.frozen_dtype": "float32"},
         "  trains: the top block and the head (1,000 of 118,656 params), rest frozen in float32"),
        ({"config.finetune.train": "last_blocks", "config.finetune.last_blocks": 0, "config.finetune.head": True},
         "  trains: the head (1,000 of 118,656 params), rest frozen in bfloat16"),
        ({"config.finetune.train": "adapters", "config.model.lora_rank": 4, "config.finetune.head": True},
         "  trains: LoRA adapters and the head (1,000 of 121,728 params), base frozen in bfloat16"),
    ],
    ids=["no_adapters", "all_with_adapters", "last_block_and_head", "head_alone", "adapters_and_head"],
)  # fmt: skip
def test_the_summary_line_of_each_mode(fields, line):
    row = {"config.finetune.train": "auto", "config.model.lora_rank": 0, "config.finetune.head": False,
           "config.finetune.frozen_dtype": "bfloat16", "params": 118_656 + 3072 * bool(fields.get(
               "config.model.lora_rank")), "trainable_params": 1000, **fields}  # fmt: skip
    assert finetune.summary_line(row) == line


def test_init_from_with_plan_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """--plan compiles the step and loads no weights, so finetune.init_from would be silently ignored: exit 2, one
    line naming both, nothing written."""
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    code = run.main(["jaxscale.run", "--config", "configs/bf16.py:tiny", "--plan", "--output_root", str(tmp_path),
                     f"--config.finetune.init_from={tmp_path / 'base'}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("jaxscale: error: finetune.init_from: ") and "--plan" in err, err
    assert not any(tmp_path.iterdir())


def test_the_head_alone_trains_with_no_backward_through_the_blocks():
    """finetune.train=last_blocks with 0 blocks and the (untied) head: only the output kernel and final norm train;
    the analytic model keeps no block activations, and the hardware FLOPs are the forward plus the head's two
    gradient matmuls (2·H·V per token each) and nothing else."""
    from jaxscale.measure import flops

    config = _config("gpt", finetune__train="last_blocks", finetune__last_blocks=0, finetune__head=True)
    state = jax.eval_shape(train.make_init_fn(config))
    assert set(_flat(state.params)) == {"output/kernel", "output/bias", "post_norm/scale", "post_norm/bias"}
    full = _config("gpt")
    forward = (flops.hardware_flops_per_step(full) - flops.recompute_flops_per_step(full)) / 3
    tokens, head = 8 * 32, 2 * 64 * 128
    assert flops.hardware_flops_per_step(config) == pytest.approx(forward + 2 * tokens * head)
    assert memory.analytic_memory(config)["analytic_activation_per_layer_bytes"] > 0
    kept = memory.analytic_memory(config)["analytic_activation_bytes"]
    assert kept < memory.analytic_memory(full)["analytic_activation_bytes"] / 2


@pytest.mark.parametrize(
    "fields",
    [
        dict(model__lora_rank=4, model__lora_targets=("all",), finetune__train="adapters",
             optimizer__state_dtype="bfloat16"),
        dict(finetune__train="last_blocks", finetune__last_blocks=1, finetune__head=True),
        dict(optimizer__state_dtype="bfloat16", optimizer__name="sgd"),
    ],
    ids=["lora_bf16_state", "last_block", "sgd_bf16"],
)  # fmt: skip
def test_analytic_state_bytes_are_the_states(fields):
    """The analytic model's params (trained float32 + frozen bfloat16) and optimizer bytes are the real
    state's bytes (the optimizer's step counters aside: a few bytes)."""
    config = _config("llama", **fields)
    state = jax.eval_shape(train.make_init_fn(config))
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    row = memory.analytic_memory(config)
    assert row["analytic_params_bytes"] == nbytes(state.params) + nbytes(state.frozen)
    assert 0 <= nbytes(state.opt_state) - row["analytic_optimizer_bytes"] <= 16
    assert row["analytic_grads_bytes"] == nbytes(state.params) * 2  # two minibatches: gradient + accumulator


def test_bfloat16_state_is_adams_first_moment():
    config = _config("llama", optimizer__state_dtype="bfloat16")
    adam = jax.eval_shape(train.make_init_fn(config)).opt_state[0]
    assert {x.dtype for x in jax.tree_util.tree_leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(adam.nu)} == {jnp.dtype(jnp.float32)}


def test_adapters_alone_lower_the_loss():
    """A few steps of adapters only (bf16 compute, frozen bf16 base) on the reference's fixed batch."""
    config = _config("gpt", dtype="bfloat16", model__lora_rank=8, finetune__train="adapters",
                     optimizer__learning_rate=1e-2, optimizer__warmup_steps=0)  # fmt: skip
    state, metrics, step = _init(config), train.init_metrics(), train.make_train_step(config)
    batch, losses = _batch(config), []
    for _ in range(8):
        state, metrics = step(state, train.init_metrics(), batch)
        losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
    assert losses[-1] < losses[0] - 0.05, losses


BAD_FIELDS = [
    (dict(model__lora_rank=40), "model.lora_rank: 40 exceeds the k projection's 64 x 32 (a rank is at most its "
     "smaller width); allowed: 1 to 32"),
    (dict(model__lora_rank=4, model__lora_targets=("qkv",)),
     "model.lora_targets: unknown 'qkv' for model.family=llama"),
    (dict(finetune__train="adapters"), "finetune.train: 'adapters' trains the LoRA adapters, and there are none"),
    (dict(finetune__train="last_blocks", finetune__last_blocks=3),
     "finetune.last_blocks: 3: train=last_blocks needs 1 to model.num_layers=2 blocks (0 with finetune.head=True"),
    (dict(finetune__train="last_blocks", finetune__last_blocks=1, model__scan_layers=True),
     "model.scan_layers: True stacks"),
    (dict(optimizer__state_dtype="float16"), "optimizer.state_dtype: unknown 'float16'"),
    (dict(optimizer__state_dtype="bfloat16", optimizer__name="adafactor"),
     "optimizer.state_dtype: bfloat16 changes nothing"),
    (dict(finetune__frozen_dtype="int8"), "finetune.frozen_dtype: unknown 'int8'"),
]  # fmt: skip


@pytest.mark.parametrize("fields,message", BAD_FIELDS)
def test_bad_fine_tuning_fields_are_one_line(fields, message):
    with pytest.raises(ConfigError) as error:
        _config("llama", **fields)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)

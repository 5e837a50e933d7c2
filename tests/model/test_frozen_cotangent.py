"""Frozen bf16 weights' cotangents (jaxscale.model.precision.cotangent_like): in the primal's dtype, so the frozen
path traces without JAX's `_temporary_dtype_exception` (marked for removal)."""

import dataclasses

import flax.linen as nn
import jax
import jax._src.custom_derivatives as custom_derivatives
import jax.numpy as jnp
import pytest
from conftest import load_config

from jaxscale import model as models
from jaxscale import train
from jaxscale.config import ModelConfig, base_config, validate
from jaxscale.model import precision

DIMS = (((2,), (0,)), ((), ()))  # x [B, T, in] . w [in, out], as nn.DenseGeneral gives them


def _float32_reducing(config) -> ModelConfig:
    """The model as the step builds it on a mesh that splits the batch: weight gradients through the custom VJP."""
    return dataclasses.replace(ModelConfig.from_config(config.model), reduce_dtype="float32")


@pytest.fixture
def no_dtype_exception(monkeypatch):
    """JAX without its temporary exception: a custom VJP's cotangent must have its primal's dtype."""
    monkeypatch.setattr(custom_derivatives, "_temporary_dtype_exception", lambda a, a_: False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_weight_cotangent_has_the_weights_dtype(dtype):
    cfg = _float32_reducing(load_config("bf16_remat", "tiny"))
    dot = precision.weight_dot_general(cfg, ("embed", "mlp"))
    x, w = jnp.ones((2, 4, 8), jnp.bfloat16), jnp.full((8, 16), 0.5, dtype)
    out, vjp = jax.vjp(lambda x, w: dot(x, w, DIMS), x, w)
    x_ct, w_ct = vjp(jnp.ones_like(out))
    assert (x_ct.dtype, w_ct.dtype) == (jnp.bfloat16, dtype)
    assert float(w_ct[0, 0]) == 2 * 4  # summed over batch and positions: ones . ones, by hand


def test_a_frozen_bf16_base_traces_without_jaxs_dtype_exception(no_dtype_exception, monkeypatch):
    """LoRA adapters on a frozen bfloat16 base (finetune.frozen_dtype's default), weight gradients reduced in
    float32: the gradient of the trained params traces with the exception disabled; with the float32 cotangent
    that was returned before (cotangent_like as the identity) it does not, so the exception is really off."""
    config = base_config("tiny-llama", "frozen")
    config.model.update(lora_rank=2, lora_targets=("all",), dropout_rate=0.0)
    config.finetune.update(train="adapters", frozen_dtype="bfloat16")
    validate(config)
    model = models.build(_float32_reducing(config), train=False)
    batch = train.make_batch(jax.random.PRNGKey(1), 2, config.data.seq_len, config.model.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch.inputs)["params"])
    trained, frozen = train.split_params(params, config)
    assert {x.dtype for x in jax.tree_util.tree_leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}

    def loss(p):
        return train.next_token_loss(train.model_params(p, frozen), model.apply, batch, jax.random.PRNGKey(2))[0]

    grads = jax.eval_shape(jax.grad(loss), trained)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(trained)
    monkeypatch.setattr(precision, "cotangent_like", lambda grad, w: grad)
    with pytest.raises(ValueError, match="Custom VJP bwd rule must produce an output with the same type"):
        jax.eval_shape(jax.grad(loss), trained)

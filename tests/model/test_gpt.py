"""The model: exact parameter count, float32 logits and softmax, and every variant computing the same function."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, load_config, loss_and_grads, named_policy_cases, slow_except, stack_layers

from jaxscale import train
from jaxscale.config import REMAT_POLICIES, base_config, remat_policies
from jaxscale.config.remat_policies import remat_policy
from jaxscale.measure import flops
from jaxscale.model import count_params, unstack_scanned_params
from jaxscale.model.chunked_attention import chunked_attention

REFERENCE_PARAMS = 155_877_376


@pytest.mark.parametrize("scan_layers", [False, True])
def test_reference_param_count_is_exact(scan_layers):
    config = load_config("bf16", "seed")
    config.model.scan_layers = scan_layers
    state = jax.eval_shape(train.make_init_fn(config))  # shapes only: no memory used
    assert count_params(state.params) == REFERENCE_PARAMS
    assert flops.param_count(config.model) == REFERENCE_PARAMS


def _variant(dtype: str, **model_overrides):
    config = base_config("tiny", "variant")
    config.model.dtype = dtype
    config.model.update(model_overrides)
    return config


def _tiny_batch(config):
    return train.make_batch(jax.random.PRNGKey(1), 4, config.data.seq_len, config.model.vocab_size)


VARIANTS = [
    dict(remat=("MLP",)),
    dict(remat=("Attn",)),
    dict(remat=("MLP", "Attn")),
    dict(remat=("Block",)),
    dict(remat=("MLP", "Attn", "Block")),
    dict(remat=("Block",), remat_policy="dots_saveable"),
    dict(remat=("Attn",), remat_policy="save_qkv_proj"),
    dict(scan_layers=True),
    dict(scan_layers=True, remat=("MLP", "Attn")),
    dict(scan_layers=True, remat=("Block",)),
    dict(attention="xla"),
    dict(scan_layers=True, remat=("Block",), attention="xla"),
]


@functools.cache
def _plain_reference(dtype: str):
    """Params, batch, loss and grads of the plain (unrolled, no remat) model; computed once per dtype."""
    plain = _variant(dtype)
    params = train.make_init_fn(plain)().params
    batch = _tiny_batch(plain)
    return params, batch, *loss_and_grads(plain, params, batch)


# float32 proves the functions equal to rounding; bfloat16 re-checks the main variants at its own tolerance.
CASES = [("float32", 1e-5, 1e-6, o) for o in VARIANTS] + [
    ("bfloat16", 2e-2, 2e-3, o) for o in VARIANTS if o in (VARIANTS[2], VARIANTS[3], VARIANTS[8], VARIANTS[9])
]


# The default suite checks each kind of variant once over the two families (remat targets, JAX's policies and
# save_qkv_proj, scan, the xla kernel; tests/model/test_llama.py has the others); every case under -m slow.
_FAST_VARIANTS = (VARIANTS[0], VARIANTS[4], VARIANTS[5], VARIANTS[8], VARIANTS[11])


@pytest.mark.parametrize(
    "dtype,rtol,atol,overrides",
    slow_except(
        CASES,
        fast=lambda case: case[3] in _FAST_VARIANTS if case[0] == "float32" else case[3] == VARIANTS[9],
        ids=[f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[3].items()) for c in CASES],
    ),
)
def test_variant_matches_plain_model(dtype, rtol, atol, overrides):
    """Remat, scan and the attention kernel change memory and speed, never the loss or its gradients."""
    variant = _variant(dtype, **overrides)
    params, batch, loss, grads = _plain_reference(dtype)
    num_layers = variant.model.num_layers
    # scanned: the same weights, stacked on a leading layer axis
    variant_params = stack_layers(params, num_layers) if variant.model.scan_layers else params
    variant_loss, variant_grads = loss_and_grads(variant, variant_params, batch)
    if variant.model.scan_layers:
        variant_grads = unstack_scanned_params(variant_grads, num_layers)
    np.testing.assert_allclose(variant_loss, loss, rtol=rtol)
    assert_trees_close(variant_grads, grads, rtol=rtol, atol=atol)


# The named policies beyond JAX's own (conftest.NAMED_POLICIES), each once under a scanned Block in
# float32 (the policies that name the attention output with the chunked kernel, whose residuals they keep);
# the remaining policy x kernel pairs under -m slow.
POLICY_CASES = named_policy_cases(
    {("selective_op", "reference"), ("minimal_flash", "chunked"), ("save_out_proj", "reference"),
     ("qkv_proj_offloaded", "reference")}
)  # fmt: skip


@pytest.mark.parametrize("policy, attention", POLICY_CASES)
def test_named_remat_policy_matches_plain_model(policy, attention):
    """Each named policy keeps other tensors for the backward pass, never changes the loss or its gradients."""
    variant = _variant("float32", scan_layers=True, remat=("Block",), remat_policy=policy, attention=attention)
    params, batch, loss, grads = _plain_reference("float32")
    variant_loss, variant_grads = loss_and_grads(variant, stack_layers(params, variant.model.num_layers), batch)
    np.testing.assert_allclose(variant_loss, loss, rtol=1e-5)
    assert_trees_close(unstack_scanned_params(variant_grads, variant.model.num_layers), grads, rtol=1e-5, atol=1e-6)


def test_every_allowed_policy_name_has_a_policy_and_a_description():
    assert REMAT_POLICIES[0] == "nothing_saveable" and len(REMAT_POLICIES) == 9  # config validation's names
    for name in REMAT_POLICIES:
        assert remat_policies.POLICIES[name].doc.strip()
        assert all(callable(remat_policy(name, family)) for family in ("gpt", "llama"))


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_policies_keeping_the_attention_output_skip_the_chunked_kernels_forward_rerun(policy):
    """The policies that name `context` name the chunked kernel's `attention_out` and `attention_lse` too, so the
    backward pass runs the kernel's backward loop only (2 loops in the grad's jaxpr); the others rerun its
    forward loop first (3), as docs/attention.md says."""
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 32, 4, 16)) for i in range(3))
    kernel = functools.partial(chunked_attention, causal=True, block_k=16)
    for family in ("gpt", "llama"):
        fn = jax.checkpoint(lambda q, k, v: jnp.sum(jnp.sin(kernel(q, k, v))), policy=remat_policy(policy, family))
        loops = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)).count("scan[")
        keeps_context = policy in ("save_dot_with_context_except_mlp", "minimal_flash", "selective_op")
        assert loops == (2 if keeps_context else 3), (family, loops)


def test_scanned_init_maps_onto_unrolled_layout():
    scanned = train.make_init_fn(_variant("float32", scan_layers=True))().params
    mapped = unstack_scanned_params(scanned, 2)
    unrolled = train.make_init_fn(_variant("float32"))().params
    assert jax.tree_util.tree_structure(mapped) == jax.tree_util.tree_structure(unrolled)
    shapes = jax.tree_util.tree_map(lambda a, b: a.shape == b.shape, mapped, unrolled)
    assert all(jax.tree_util.tree_leaves(shapes))


def test_bf16_and_fp32_losses_agree():
    fp32, bf16 = _variant("float32"), _variant("bfloat16")
    params = train.make_init_fn(fp32)().params
    batch = _tiny_batch(fp32)
    loss32, _ = loss_and_grads(fp32, params, batch)
    loss16, _ = loss_and_grads(bf16, params, batch)
    assert abs(float(loss16) - float(loss32)) < 2e-2 * abs(float(loss32))


def test_logits_are_float32_and_params_float32_under_bf16():
    config = _variant("bfloat16")
    params = train.make_init_fn(config)().params
    assert {p.dtype for p in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}
    logits = train.make_model(config, train=False).apply({"params": params}, _tiny_batch(config).inputs)
    assert logits.dtype == jnp.float32
    assert logits.shape == (4, config.data.seq_len, config.model.vocab_size)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_softmax_runs_in_float32_in_the_compiled_program(scan_layers):
    """The StableHLO exponentials over [batch, heads, T, T] are all f32: the softmax is not run in bf16."""
    config = _variant("bfloat16", scan_layers=scan_layers, remat=("Attn",))
    params = train.make_init_fn(config)().params
    model = train.make_model(config, train=False)
    text = jax.jit(model.apply).lower({"params": params}, _tiny_batch(config).inputs).as_text()
    seq, heads = config.data.seq_len, config.model.hidden_size // config.model.head_dim
    exp_dtypes = re.findall(rf"stablehlo.exponential %\S+ : tensor<4x{heads}x{seq}x{seq}x(\w+)>", text)
    assert exp_dtypes and set(exp_dtypes) == {"f32"}, exp_dtypes
    # and the model really computes in bf16 elsewhere (the check above is not vacuous)
    assert re.search(r"stablehlo.dot_general .* -> tensor<[0-9x]+xbf16>", text)


@pytest.mark.gpu
def test_cudnn_attention_matches_reference_on_gpu():
    """The cuDNN (flash) kernel computes the same function as the reference einsum attention."""
    params, batch, loss, grads = _plain_reference("bfloat16")
    cudnn_loss, cudnn_grads = loss_and_grads(_variant("bfloat16", attention="cudnn"), params, batch)
    np.testing.assert_allclose(cudnn_loss, loss, rtol=2e-2)
    for g, cg in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(cudnn_grads), strict=True):
        np.testing.assert_allclose(np.asarray(cg), np.asarray(g), rtol=5e-2, atol=5e-3)

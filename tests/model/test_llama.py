"""The Llama family: GQA against multi-head attention, RoPE's relative positions, tied embeddings, and every
variant (remat, policies, scan, attention kernels) computing the same loss and gradients as the plain model."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, loss_and_grads, named_policy_cases, slow_except, stack_layers

from jaxscale import train
from jaxscale.config import base_config
from jaxscale.model import count_params, unstack_scanned_params
from jaxscale.model.attention import reference_attention
from jaxscale.model.llama import rotary_embedding


def _llama(dtype: str = "float32", **model_overrides):
    config = base_config("tiny-llama", "llama")
    config.model.dtype = dtype
    config.model.update(model_overrides)
    return config


def _batch(config, batch_size: int = 4):
    return train.make_batch(jax.random.PRNGKey(1), batch_size, config.data.seq_len, config.model.vocab_size)


def _init(config):
    return train.make_init_fn(config)().params


def _naive_attention(q, k, v, causal: bool):
    """Multi-head attention one head at a time in numpy (float64): query head h reads K/V head h // group."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            scores = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(head_dim)  # [T, T]
            if causal:
                scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, h] = (weights / weights.sum(-1, keepdims=True)) @ v[b, :, h // group]
    return out


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_attention_is_multi_head_attention_with_shared_kv_heads(kv_heads, causal):
    """kv_heads == heads is plain MHA; fewer K/V heads give each group of query heads one shared K/V head."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (2, 8, 4, 16))
    k, v = (jax.random.normal(key, (2, 8, kv_heads, 16)) for key in keys[1:])
    out = reference_attention(q, k, v, causal, jnp.float32)
    np.testing.assert_allclose(np.asarray(out), _naive_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)
    xla = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")  # jax.nn's own GQA
    np.testing.assert_allclose(np.asarray(out), np.asarray(xla), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["reference", "xla"])
def test_gqa_model_equals_mha_model_with_repeated_kv_weights(attention):
    """A GQA Llama and a multi-head Llama (num_kv_heads == num_heads) whose K/V heads repeat the GQA ones
    compute the same logits: grouped-query attention is MHA with K/V shared within each group."""
    gqa = _llama(attention=attention)
    mha = _llama(attention=attention, num_kv_heads=4)
    group = gqa.model.hidden_size // gqa.model.head_dim // gqa.model.num_kv_heads
    params = _init(gqa)
    mha_params = jax.tree_util.tree_map(lambda x: x, params)
    for i in range(gqa.model.num_layers):
        attn = dict(mha_params["transformer"][f"block_{i}"]["attn"])
        for name in ("k", "v"):  # kernel [H, nkv, hd] -> [H, nh, hd]: query head h reads K/V head h // group
            attn[name] = {"kernel": jnp.repeat(attn[name]["kernel"], group, axis=1)}
        mha_params["transformer"][f"block_{i}"] = {**mha_params["transformer"][f"block_{i}"], "attn": attn}
    tokens = _batch(gqa).inputs
    logits = train.make_model(gqa, train=False).apply({"params": params}, tokens)
    mha_logits = train.make_model(mha, train=False).apply({"params": mha_params}, tokens)
    np.testing.assert_allclose(np.asarray(mha_logits), np.asarray(logits), rtol=1e-5, atol=1e-5)
    assert mha_params["transformer"]["block_0"]["attn"]["k"]["kernel"].shape[1] == 4  # really multi-head


def _rotate_half_by_hand(x: np.ndarray, positions: np.ndarray, theta: float, interleaved: bool = False) -> np.ndarray:
    """RoPE written out element by element (float64): pair (i, i + d/2) turned by pos * theta^(-2i/d); or,
    `interleaved`, pair (2i, 2i + 1) (the GPT-NeoX/Meta convention the model does not use, as a foil)."""
    out = np.zeros_like(x, dtype=np.float64)
    d = x.shape[-1]
    for t, pos in enumerate(positions):
        for i in range(d // 2):
            angle = pos * theta ** (-2.0 * i / d)
            c, s = np.cos(angle), np.sin(angle)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            out[:, t, :, a] = x[:, t, :, a] * c - x[:, t, :, b] * s
            out[:, t, :, b] = x[:, t, :, b] * c + x[:, t, :, a] * s
    return out


def test_rope_equals_the_rotate_half_rotation_computed_by_hand():
    """Llama 3's theta = 500000 at a few positions: the model's rotation is the hand-computed rotate-half one,
    and far from what an ignored theta (10000) or interleaved pairs would give, so either defect fails here."""
    theta, positions = 500000.0, np.array([0, 1, 2, 5, 37, 100])
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (1, len(positions), 2, 8)), np.float64)
    got = np.asarray(rotary_embedding(jnp.asarray(x, jnp.float32), jnp.asarray(positions), theta), np.float64)
    np.testing.assert_allclose(got, _rotate_half_by_hand(x, positions, theta), rtol=0, atol=1e-4)
    np.testing.assert_allclose(got[:, 0], x[:, 0], atol=1e-6)  # position 0 is not rotated
    for wrong in (_rotate_half_by_hand(x, positions, 10000.0), _rotate_half_by_hand(x, positions, theta, True)):
        assert np.abs(got - wrong).max() > 0.1


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_scores_depend_only_on_relative_position(theta):
    """The same query and key vectors placed at every position: score(i, j) is a function of i - j alone."""
    seq, head_dim = 16, 32
    keys = jax.random.split(jax.random.PRNGKey(2))
    q = jnp.broadcast_to(jax.random.normal(keys[0], (head_dim,)), (1, seq, 1, head_dim))
    k = jnp.broadcast_to(jax.random.normal(keys[1], (head_dim,)), (1, seq, 1, head_dim))
    positions = jnp.arange(seq)
    scores = np.asarray(
        jnp.einsum(
            "qd,kd->qk", rotary_embedding(q, positions, theta)[0, :, 0], rotary_embedding(k, positions, theta)[0, :, 0]
        )
    )  # [T, T]
    for offset in range(-seq + 1, seq):
        diagonal = np.diagonal(scores, offset=offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-4, atol=1e-4)
    assert np.ptp([scores[0, j] for j in range(seq)]) > 1e-2  # and it does depend on the distance
    # the rotation keeps each vector's norm (it only turns pairs of coordinates)
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(rotary_embedding(q, positions, theta)), axis=-1),
        np.linalg.norm(np.asarray(q), axis=-1),
        rtol=1e-5,
    )


VARIANTS = [
    dict(remat=("MLP",)),
    dict(remat=("Attn",)),
    dict(remat=("MLP", "Attn")),
    dict(remat=("Block",)),
    dict(remat=("Block",), remat_policy="dots_saveable"),
    dict(remat=("Block",), remat_policy="dots_with_no_batch_dims_saveable"),
    dict(remat=("Attn",), remat_policy="save_qkv_proj"),
    dict(scan_layers=True),
    dict(scan_layers=True, remat=("MLP", "Attn")),
    dict(scan_layers=True, remat=("Block",), remat_policy="save_qkv_proj"),
    dict(attention="xla"),
    dict(scan_layers=True, remat=("Block",), attention="xla"),
]


@functools.cache
def _plain_reference():
    """Params, batch, loss and grads of the plain (unrolled, no remat, reference attention) float32 Llama."""
    plain = _llama()
    params = _init(plain)
    batch = _batch(plain)
    return params, batch, *loss_and_grads(plain, params, batch)


# Each kind of variant once over the two families in the default suite (tests/model/test_gpt.py has the
# others); every variant under -m slow.
_FAST_VARIANTS = (VARIANTS[1], VARIANTS[3], VARIANTS[5], VARIANTS[6], VARIANTS[7], VARIANTS[9], VARIANTS[10])


@pytest.mark.parametrize(
    "overrides",
    slow_except(
        VARIANTS, fast=lambda o: o in _FAST_VARIANTS, ids=["-".join(f"{k}={v}" for k, v in o.items()) for o in VARIANTS]
    ),
)
def test_variant_matches_plain_llama(overrides):
    """Remat, its policies, scan and the attention kernel change memory and speed, never the loss or gradients."""
    variant = _llama(**overrides)
    params, batch, loss, grads = _plain_reference()
    num_layers = variant.model.num_layers
    variant_params = stack_layers(params, num_layers) if variant.model.scan_layers else params
    variant_loss, variant_grads = loss_and_grads(variant, variant_params, batch)
    if variant.model.scan_layers:
        variant_grads = unstack_scanned_params(variant_grads, num_layers)
    np.testing.assert_allclose(variant_loss, loss, rtol=1e-5)
    assert_trees_close(variant_grads, grads)


# The named policies beyond JAX's own, each once under a scanned Block (llama's selective_op keeps q, v, gate and
# down, not gpt's tensors); the remaining policy x kernel pairs under -m slow.
POLICY_CASES = named_policy_cases(
    {("selective_op", "reference"), ("save_dot_with_context_except_mlp", "chunked"), ("minimal_flash", "reference")}
)


@pytest.mark.parametrize("policy, attention", POLICY_CASES)
def test_named_remat_policy_matches_plain_llama(policy, attention):
    """Each named policy keeps other tensors for the backward pass, never changes the loss or its gradients."""
    variant = _llama(scan_layers=True, remat=("Block",), remat_policy=policy, attention=attention)
    params, batch, loss, grads = _plain_reference()
    variant_loss, variant_grads = loss_and_grads(variant, stack_layers(params, variant.model.num_layers), batch)
    np.testing.assert_allclose(variant_loss, loss, rtol=1e-5)
    assert_trees_close(unstack_scanned_params(variant_grads, variant.model.num_layers), grads)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_tied_embeddings_count_once_and_take_both_gradients(preset):
    """Tied: the output head is the token embedding transposed (no bias), so the count drops by V*H (+V for gpt's
    bias) and the shared matrix's gradient is the sum of what the untied embedding and head would get."""
    tied = base_config(preset, "tied")
    tied.model.update(dtype="float32", tie_embeddings=True)
    untied = base_config(preset, "untied")
    untied.model.update(dtype="float32", tie_embeddings=False)
    tied_params, untied_params = _init(tied), _init(untied)
    v, h = tied.model.vocab_size, tied.model.hidden_size
    bias = v if tied.model.family == "gpt" else 0
    assert count_params(untied_params) - count_params(tied_params) == v * h + bias
    assert "output" not in tied_params
    # The untied model with its head set to the embedding's transpose (and a zero bias) is the tied model.
    embedding = tied_params["embed"]["embedding"]  # [V, H]
    untied_params = {**tied_params, "output": {"kernel": embedding.T}}
    if bias:
        untied_params["output"]["bias"] = jnp.zeros((v,))
    batch = _batch(tied)
    tied_loss, tied_grads = loss_and_grads(tied, tied_params, batch)
    untied_loss, untied_grads = loss_and_grads(untied, untied_params, batch)
    np.testing.assert_allclose(tied_loss, untied_loss, rtol=1e-6)
    head_grad = np.asarray(untied_grads["output"]["kernel"]).T
    gather_grad = np.asarray(untied_grads["embed"]["embedding"])
    assert np.abs(head_grad).max() > 1e-3 and np.abs(gather_grad).max() > 1e-3  # both paths reach the matrix
    np.testing.assert_allclose(
        np.asarray(tied_grads["embed"]["embedding"]), gather_grad + head_grad, rtol=1e-4, atol=1e-6
    )


def test_bf16_llama_keeps_float32_params_logits_and_softmax():
    config = _llama("bfloat16", scan_layers=True, remat=("Attn",))
    params = _init(config)
    assert {p.dtype for p in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}
    model = train.make_model(config, train=False)
    tokens = _batch(config).inputs
    logits = model.apply({"params": params}, tokens)
    assert logits.dtype == jnp.float32 and logits.shape == (4, config.data.seq_len, config.model.vocab_size)
    text = jax.jit(model.apply).lower({"params": params}, tokens).as_text()
    seq = config.data.seq_len
    # grouped logits [batch, kv_heads, group, T, T]: 2 K/V heads, 2 query heads each
    exp_dtypes = re.findall(rf"stablehlo.exponential %\S+ : tensor<4x2x2x{seq}x{seq}x(\w+)>", text)
    assert exp_dtypes and set(exp_dtypes) == {"f32"}, exp_dtypes
    assert re.search(r"stablehlo.dot_general .* -> tensor<[0-9x]+xbf16>", text)  # the matmuls run in bf16


@pytest.mark.gpu
def test_cudnn_attention_matches_reference_on_gpu_with_gqa():
    params, batch, loss, grads = _plain_reference()
    plain, cudnn = _llama("bfloat16"), _llama("bfloat16", attention="cudnn")
    plain_loss, plain_grads = loss_and_grads(plain, params, batch)
    cudnn_loss, cudnn_grads = loss_and_grads(cudnn, params, batch)
    np.testing.assert_allclose(cudnn_loss, plain_loss, rtol=2e-2)
    assert_trees_close(cudnn_grads, plain_grads, rtol=5e-2, atol=5e-3)

"""model.remat_policy = "per_activation:...": each activation kept, offloaded or recomputed (MaxText's custom
policy)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import load_config

from jaxscale import train
from jaxscale.config import ConfigError, remat_policies, validate


def test_the_spelled_policy_keeps_offloads_and_recomputes_what_it_names():
    """Tags by hand: llama's q, k, v are three tags, gpt's one; an activation not named is recomputed."""
    name = "per_activation:qkv_proj=device,out_proj=offload,mlp_up=remat"
    policy = remat_policies.per_activation(name)
    assert policy.names == {"gpt": ("qkv_proj", "query_proj", "key_proj", "value_proj"),
                            "llama": ("qkv_proj", "query_proj", "key_proj", "value_proj")}  # fmt: skip
    assert policy.offloads == ("out_proj",)
    assert remat_policies.kept(name, "llama") == {"q", "k", "v"}
    assert remat_policies.not_recomputed(name, "gpt") == {"q", "k", "v", "out"}  # kept + offloaded


@pytest.mark.parametrize("bad", ["per_activation:", "per_activation:qkv=device", "per_activation:context=disk",
                                 "per_activation:context=device,context=remat", "per_activation:context"])
def test_a_bad_per_activation_policy_is_one_line(bad):
    config = load_config("bf16_remat", "tiny")
    config.model.remat_policy = bad
    with pytest.raises(ConfigError, match=r"^model.remat_policy: .*per_activation: takes activation=place pairs"):
        validate(config)


def _gradients(config):
    state = jax.jit(train.make_init_fn(config))()
    batch = train.make_batch(jax.random.PRNGKey(1), config.data.batch_size, config.data.seq_len,
                             config.model.vocab_size)  # fmt: skip
    step = lambda s, b: train.batch_gradients(s, b, rng=jax.random.PRNGKey(5), num_minibatches=1, accumulate="scan")  # noqa: E731
    return jax.jit(step)(state, batch)


def test_a_per_activation_policy_computes_the_plain_models_gradients():
    """Remat only changes what is kept: the gradients equal the model without remat (float32, llama, scanned)."""
    plain = load_config("bf16_remat", "tiny-llama")
    plain.model.update(dtype="float32", dropout_rate=0.0, remat=())
    validate(plain)
    policed = load_config("bf16_remat", "tiny-llama")
    policed.model.update(dtype="float32", dropout_rate=0.0, remat=("Block",),
                         remat_policy="per_activation:qkv_proj=device,context=device,mlp_up=remat")  # fmt: skip
    validate(policed)
    for a, b in zip(jax.tree_util.tree_leaves(_gradients(policed)), jax.tree_util.tree_leaves(_gradients(plain)),
                    strict=True):  # fmt: skip
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(float(np.abs(b).max()), 1e-30))


def test_keeping_every_activation_plans_more_memory_than_recomputing_them():
    """The model applies the spelled policy: every activation on the device plans a larger peak than none (the
    local compiler's plan of the tiny Llama with Block remat, scanned)."""
    from jaxscale.plan import fit_search

    peaks = {}
    for place in ("device", "remat"):
        config = load_config("bf16_remat", "tiny-llama")
        config.model.remat = ("Block",)
        config.model.remat_policy = "per_activation:" + ",".join(f"{a}={place}" for a in remat_policies.ACTIVATIONS)
        validate(config)
        peaks[place] = fit_search.local_planner(config)["compiled_peak_bytes"]
    assert peaks["device"] > peaks["remat"], peaks


def test_the_fit_planner_searches_a_per_activation_policy(tmp_path, capsys):
    """fit --remat takes a per-activation policy (pairs joined by +) as one more choice, on the whole block."""
    from conftest import CONFIGS

    from jaxscale import fit

    choice = "per_activation:qkv_proj=device+context=device"
    code = fit.main(["fit", "--config", f"{CONFIGS}/bf16_remat.py:tiny-llama", "--remat", choice, "--memory", "64MiB",
                     "--max_minibatch", "4", "--output_root", str(tmp_path)])  # fmt: skip
    assert code == 0 and f"Block, {choice}" in capsys.readouterr().out

"""LoRA's numbers pinned by hand (jaxscale.model.lora): the scale alpha / r in the forward and in `merge`, and
PEFT's init (A uniform within 1/sqrt(in_features), B zero).

The forward and `merge` share `lora.scale`, so comparing the two (tests/train/test_finetune.py) cannot catch a
wrong scale; here each is compared with literal matrices and a scale written out as a number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.config import ModelConfig
from jaxscale.model import lora, stack

# Rank 4, alpha 8: the adapter's product is multiplied by 8 / 4 = 2 (PEFT's LoraLayer.scaling = lora_alpha / r;
# rsLoRA's alpha / sqrt(r) would be 4, no scale 1).
CFG = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8.0, lora_targets=("mlp",), reduce_dtype="float32")
SCALE = 2.0

X = np.array([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]], np.float32)  # [2, in 3]
W = np.array([[1.0, 0.0, 2.0, -1.0, 0.5], [0.0, 1.0, 1.0, 2.0, -2.0], [3.0, -1.0, 0.0, 1.0, 1.0]], np.float32)
A = np.array([[1.0, 0.0, -1.0, 2.0], [0.5, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.5]], np.float32)  # [in 3, r 4]
B = np.array([[1.0, -1.0, 0.0, 0.5, 2.0], [0.0, 1.0, 1.0, 0.0, -1.0], [2.0, 0.0, -0.5, 1.0, 0.0],
              [1.0, 1.0, 1.0, -1.0, 0.5]], np.float32)  # [r 4, out 5]  # fmt: skip


def _up(cfg: ModelConfig, features: int = 5, axis: int | tuple[int, ...] = -1, axes=("embed", "mlp")):
    """The MLP's `up` projection as the model builds it (stack.dense), without a bias."""
    return stack.dense(features, axes, cfg, name="up", axis=axis, use_bias=False)


def test_the_forward_adds_alpha_over_r_times_x_a_b():
    """x W + (8 / 4) x A B with literal matrices, computed in numpy (every product exact in float32)."""
    layer = _up(CFG)
    assert isinstance(layer, lora.LoraDenseGeneral)
    out = layer.apply({"params": {"kernel": W, "lora_a": A, "lora_b": B}}, jnp.asarray(X))
    expected = X @ W + SCALE * (X @ A @ B)
    assert not np.allclose(expected, X @ W + 4.0 * (X @ A @ B))  # the matrices tell the scales apart
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)


def test_merge_folds_alpha_over_r_times_a_b_into_the_kernel():
    """merge: W + (8 / 4) A B in numpy, the adapters removed; the same for a scanned stack of two layers."""
    merged = lora.merge({"mlp": {"up": {"kernel": W, "lora_a": A, "lora_b": B, "bias": np.zeros(5, np.float32)}}}, CFG)
    assert set(merged["mlp"]["up"]) == {"kernel", "bias"}
    np.testing.assert_allclose(np.asarray(merged["mlp"]["up"]["kernel"]), W + SCALE * (A @ B), rtol=1e-6, atol=1e-6)
    stacked = {"kernel": np.stack([W, -W]), "lora_a": np.stack([A, 2 * A]), "lora_b": np.stack([B, B])}
    layers = lora.merge({"up": stacked}, CFG)["up"]["kernel"]
    np.testing.assert_allclose(np.asarray(layers), np.stack([W + SCALE * (A @ B), -W + 2 * SCALE * (A @ B)]),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize(
    "shape,axis,axes",
    [((64,), -1, ("embed", "mlp")), ((4, 16), (-2, -1), ("heads", "head_dim", "embed"))],
    ids=["in_64", "out_projection_4x16"],
)
def test_a_starts_as_peft_kaiming_uniform_and_b_at_zero(shape, axis, axes):
    """PEFT's init: kaiming_uniform_(A, a=sqrt(5)), gain sqrt(2 / (1 + 5)), bound sqrt(3) gain / sqrt(fan_in) =
    1 / sqrt(fan_in): 0.125 for 64 inputs, whether one dimension of 64 or the out projection's 4 heads x 16.
    A uniform draw within +-0.125 has variance 0.125^2 / 3; B is zero."""
    cfg = ModelConfig(dtype="float32", lora_rank=64, lora_targets=("mlp",))
    layer = _up(cfg, features=32, axis=axis, axes=axes)
    params = layer.init(jax.random.PRNGKey(0), jnp.ones((1, *shape)))["params"]
    a, b = np.asarray(params["lora_a"].value), np.asarray(params["lora_b"].value)
    assert a.shape == (*shape, 64) and b.shape == (64, 32)
    assert np.abs(a).max() <= 0.125 and np.abs(a).max() > 0.124  # 4096 draws reach the bound's edge
    assert a.var() == pytest.approx(0.125**2 / 3, rel=0.1)
    assert a.mean() == pytest.approx(0.0, abs=0.01)
    np.testing.assert_array_equal(b, 0.0)

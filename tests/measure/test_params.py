"""jaxscale.measure.params: the analytic parameter shapes equal the model's, leaf by leaf; Adafactor's state size;
shape warnings."""

from __future__ import annotations

import math

import jax
import optax
import pytest

from jaxscale import train
from jaxscale.config import base_config
from jaxscale.measure import params


def _model_shapes(config) -> dict[str, tuple[int, ...]]:
    """The initialised model's params as {"a/b/c": shape}, through jax.eval_shape (nothing allocated)."""
    state = jax.eval_shape(train.make_init_fn(config))
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


CASES = [(preset, scan, tie) for preset in ("tiny", "tiny-llama") for scan in (False, True) for tie in (False, True)]


@pytest.mark.parametrize("preset,scan_layers,tie", CASES)
def test_analytic_shapes_are_the_models_leaf_by_leaf(preset, scan_layers, tie):
    config = base_config(preset, "shapes")
    config.model.update(scan_layers=scan_layers, tie_embeddings=tie)
    if config.model.family == "llama":
        config.model.num_kv_heads = 2  # grouped: k and v narrower than q
    assert params.param_shapes(config.model) == _model_shapes(config)
    total = sum(math.prod(s) for s in params.param_shapes(config.model).values())
    assert params.param_count(config.model) == total  # the closed formula agrees with the shapes


@pytest.mark.parametrize("preset", ["cpu", "cpu-llama", "llama3.2-1b"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_adafactor_state_size_is_optax_s(preset, scan_layers):
    """The formula against optax.adafactor's own state for the model's shapes (jax.eval_shape: no memory used),
    at sizes where some matrices are factored (both large dims >= 128) and some are not."""
    config = base_config(preset, "adafactor")
    config.model.scan_layers = scan_layers
    shapes = params.param_shapes(config.model)
    tree = {name: jax.ShapeDtypeStruct(shape, "float32") for name, shape in shapes.items()}
    state = jax.eval_shape(optax.adafactor(1e-3).init, tree)
    float_elements = sum(x.size for x in jax.tree_util.tree_leaves(state) if x.dtype == "float32")
    assert params.adafactor_state_elements(shapes) == float_elements
    n = params.param_count(config.model)
    assert params.adafactor_state_elements(shapes) < 0.2 * n  # factored: far below Adam's 2N


def test_shape_warnings_name_the_dims_off_the_tile_and_suggest_a_padded_vocabulary():
    gpt2 = base_config("gpt2", "w").model
    (warning,) = params.shape_warnings(gpt2)
    assert warning.startswith("model.vocab_size = 50257 is not a multiple of 64") and "50304" in warning
    assert params.shape_warnings(base_config("llama3.1-8b", "w").model) == []
    tiny = base_config("tiny", "w").model
    tiny.update(head_dim=8, hidden_size=40, mlp_expansion=3)
    fields = [w.split(" = ")[0] for w in params.shape_warnings(tiny)]
    assert fields == [
        "model.hidden_size",
        "model.head_dim",
        "MLP width (model.mlp_hidden_size or mlp_expansion x hidden_size)",
    ]


def test_adafactor_state_count_of_a_factored_kernel_is_a_python_int_that_a_row_keeps_a_number():
    """A [256, 512] kernel is factored: 512 + 256 row and column statistics and a placeholder, 769 (hand count).
    The count must be a Python int: a NumPy integer is written to a result row's JSON as a string (its default=str),
    which broke the sweep's table for every Adafactor variant."""
    import json

    count = params.adafactor_state_elements({"w": (256, 512)})
    assert count == 769 and type(count) is int
    assert json.loads(json.dumps({"n": count}, default=str))["n"] == 769

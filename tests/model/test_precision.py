"""Mixed precision of the weights (jaxscale.model.precision): float32 weight gradients compute the same
function as the compute-dtype ones, and a GPU target's compiled program gathers bf16 weights and sums float32
gradients (FSDP2's param_dtype=bf16, reduce_dtype=fp32); reduce_dtype=compute sums bf16."""

import collections
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config

from jaxscale import model as models
from jaxscale import train
from jaxscale.config import ConfigError, ModelConfig, step_model, validate
from jaxscale.measure import kernels
from jaxscale.plan import gpu_plan
from jaxscale.sweep.sweep_file import apply_overrides

needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")


def _config(family: str, **overrides):
    config = load_config("bf16_remat", "tiny")
    apply_overrides(config, {"model.family": family, "model.dropout_rate": 0.0, **overrides}, "precision")
    validate(config)
    return config


def _grads(config, reduce_dtype: str):
    """Gradients of the next-token loss through the model built directly with `reduce_dtype` (the train step
    applies the field only on a mesh that splits the batch: config.step_model)."""
    cfg = dataclasses.replace(ModelConfig.from_config(config.model), reduce_dtype=reduce_dtype)
    data = config.data
    batch = train.make_batch(jax.random.PRNGKey(data.seed), data.batch_size, data.seq_len, config.model.vocab_size)
    model = models.build(cfg, train=False)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch.inputs)["params"])
    return jax.jit(jax.grad(lambda p: train.next_token_loss(p, model.apply, batch, jax.random.PRNGKey(1))[0]))(params)


@pytest.mark.parametrize("family", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])  # the same stack.dense
def test_float32_weight_gradients_equal_the_compute_dtype_ones(family):
    """Same params, same batch: the gradients with float32 weight gradients equal the bf16 ones (Flax's default
    computation, model.reduce_dtype=compute) within bf16 rounding, and are not the same numbers (the
    weight-gradient matmuls' outputs are no longer rounded to bf16)."""
    config = _config(family)
    reduced_f32, reduced_bf16 = _grads(config, "float32"), _grads(config, "compute")
    leaves = jax.tree_util.tree_leaves
    assert all(g.dtype == jnp.float32 for g in leaves(reduced_f32))
    for got, want in zip(leaves(reduced_f32), leaves(reduced_bf16), strict=True):
        scale = float(jnp.abs(want).max()) or 1.0
        np.testing.assert_allclose(got / scale, want / scale, atol=2e-2)
    assert any(float(jnp.abs(a - b).max()) > 0 for a, b in zip(leaves(reduced_f32), leaves(reduced_bf16), strict=True))


def test_the_field_applies_where_the_batch_is_split_over_devices():
    """One device, or tensor parallelism alone, sums nothing over devices: the step builds Flax's default
    program there (the notebook's), whatever the field says. Data, FSDP and context parallelism sum."""
    config = _config("gpt")
    assert step_model(config).reduce_dtype == "compute"
    for mesh, effective in (
        ({"mesh.tensor": 2}, "compute"),
        ({"mesh.data": 2}, "float32"),
        ({"mesh.fsdp": 2}, "float32"),
        ({"mesh.context": 2, "model.attention": "chunked"}, "float32"),  # a ring sums its devices' gradients too
    ):
        assert step_model(_config("gpt", **mesh)).reduce_dtype == effective, mesh
    assert step_model(_config("gpt", **{"mesh.fsdp": 2, "model.reduce_dtype": "compute"})).reduce_dtype == "compute"


def test_the_fields_reject_what_they_cannot_do():
    with pytest.raises(ConfigError, match=r"^model\.reduce_dtype: .*allowed: float32, compute"):
        _config("gpt", **{"model.reduce_dtype": "float16"})


def _collective_dtypes(hlo_text: str, kind: str) -> set[str]:
    """Element types of every array the HLO's `kind` collectives (async starts or plain) produce, read
    with a regex of its own (not jaxscale.measure's parse)."""
    found = set()
    for line in hlo_text.splitlines():
        match = re.search(rf"= (.*?) {kind}(?:-start)?\(", line)
        if match:
            found |= set(re.findall(r"\b([a-z]+\d*)\[", match.group(1)))
    return found


def _target_hlo(family: str, mesh: dict, tmp_path, **overrides) -> tuple[dict, str]:
    import gzip

    config = _config(family, **{"train.num_minibatches": 1, **mesh, **overrides})
    devices = mesh.get("mesh.data", 1) * mesh.get("mesh.fsdp", 1)
    row = gpu_plan.plan_for_target(config, "h100", gemm="cublas", devices=devices, in_process=True, hlo_dir=tmp_path)
    return row, gzip.open(next(tmp_path.glob("plan_cublas*.gz")), "rt").read()


@needs_extra
def test_fsdp_on_h100s_gathers_bf16_weights_and_reduce_scatters_float32_gradients(tmp_path):
    row, text = _target_hlo("llama", {"mesh.fsdp": 2}, tmp_path / "default")
    assert _collective_dtypes(text, "reduce-scatter") == {"f32"}
    assert "bf16" in _collective_dtypes(text, "all-gather")
    # Only the norms' float32 scales are gathered in float32: a small part of the gathered bytes.
    assert row["compiled_collective_reduce_scatter_f32_bytes"] == row["compiled_collective_reduce_scatter_bytes"] > 0
    assert row["compiled_collective_all_gather_f32_bytes"] < 0.1 * row["compiled_collective_all_gather_bytes"]

    # The alternative compiles the other way: bf16 gradient sums.
    _, compute = _target_hlo("llama", {"mesh.fsdp": 2}, tmp_path / "compute", **{"model.reduce_dtype": "compute"})
    assert "bf16" in _collective_dtypes(compute, "reduce-scatter")


@needs_extra
def test_data_parallel_on_h100s_all_reduces_the_weight_gradients_in_float32(tmp_path):
    """gpt on 2 H100s, data parallel: XLA puts the gradient sum on the weight-gradient matmul, in its output
    dtype; with float32 weight gradients all but the vectors' (biases, norms, positions) are float32."""
    row, text = _target_hlo("gpt", {"mesh.data": 2}, tmp_path / "f32")
    assert row["compiled_collective_all_reduce_f32_bytes"] > 0.95 * row["compiled_collective_all_reduce_bytes"]
    # ... while every weight matmul (no batch dimension; the reference attention's batched einsums keep their
    # float32 scores), the weight-gradient ones and the tied head's included, takes bf16 operands: tensor
    # cores at the bf16 rate, not float32 operands upcast from bf16 (a TF32 GEMM at half the rate)
    found = [k for k in kernels.kernels(text) if k.category == "matmul" and k.gemm[0] == 1]
    dtypes = collections.Counter(k.flop_dtype for k in found)
    assert set(dtypes) == {"bf16"} and sum(dtypes.values()) >= 3 * 4, dtypes  # 4 projections + head, x3
    bf16_row, _ = _target_hlo("gpt", {"mesh.data": 2}, tmp_path / "bf16", **{"model.reduce_dtype": "compute"})
    f32, total = (bf16_row[f"compiled_collective_all_reduce_{c}bytes"] for c in ("f32_", ""))
    assert f32 < 0.05 * total

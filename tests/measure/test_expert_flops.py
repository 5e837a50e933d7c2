"""The experts' matmul FLOPs the compiled program executes (jaxscale.measure.expert_flops) against hand counts for
each dispatch: dense E / k times the active experts', capacity E x C slots per sequence, ragged on the CPU (JAX's
lowering of ragged_dot there: a dot over every group of a masked copy of the rows) and for an H100 target (XLA's
ragged_dot_rewriter, the same expansion) E times; remat's recomputation apart; null with the reason for a dense
model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxscale.config import base_config, validate
from jaxscale.measure import expert_flops
from jaxscale.model import moe
from jaxscale.plan import gpu_plan
from jaxscale.run_row import compile_step

B, T, H, F, E, K = 2, 8, 16, 8, 4, 2  # the layer's sizes below: 16 tokens, 4 experts of width 8, 2 per token
ACTIVE = 3 * (B * T * K) * 3 * 2 * H * F  # forward + both gradients, of gate, up, down: 2·H·F per token copy


def _layer_hlo(dispatch: str) -> str:
    """The compiled CPU program of one MoE layer's value and gradients (inputs and experts' weights)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    h = jax.random.normal(keys[0], (B, T, H))
    w = {name: jax.random.normal(key, shape) for name, key, shape in
         (("gate", keys[1], (E, H, F)), ("up", keys[2], (E, H, F)), ("down", keys[3], (E, F, H)))}  # fmt: skip
    weights, experts = moe.route(jax.random.normal(keys[4], (B, T, E)), K, "topk_softmax")
    cotangent = jax.random.normal(keys[5], (B, T, H))
    run = {
        "dense": moe.dense_dispatch,
        "ragged": moe.ragged_dispatch,
        "capacity": lambda *a: moe.capacity_dispatch(*a, factor=1.5)[0],
    }[dispatch]

    def loss(h, w):
        return jnp.sum(run(h, weights, experts, w) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w).compile().as_text()


@pytest.mark.parametrize(
    "dispatch, executed",
    [
        ("dense", ACTIVE * E // K),  # every expert on every token: E / k = 2 times
        # C = ceil(1.5 x T x k / E) = ceil(6) = 6 slots per expert and sequence: B x E x C = 48 rows for 32 copies
        ("capacity", 3 * (B * E * 6) * 3 * 2 * H * F),
        ("ragged", ACTIVE * E),  # the masked dot over all E groups, for the forward and both gradients
    ],
)
def test_each_dispatch_executes_its_hand_counted_expert_flops(dispatch, executed):
    columns = expert_flops.compiled_columns(_layer_hlo(dispatch))
    assert columns["compiled_expert_matmul_flops_per_step"] == executed
    assert columns["compiled_expert_recompute_flops_per_step"] == 0


def _tiny_moe(dispatch: str, **model_fields):
    config = base_config("tiny-moe", "expert_flops")
    config.model.moe_dispatch = dispatch
    config.model.update(model_fields)
    validate(config)
    return config


def test_the_train_steps_row_compares_with_the_active_experts_remat_apart():
    """tiny-moe's train step on the CPU (2 minibatches, 2 scanned MoE layers, bf16, remat of the Block), ragged:
    256 tokens x 2 layers x 3 x 6·k·H·F_e (k 2, H 64, F_e 32) active, E = 4 times that executed, and remat's
    recomputation of the forward (`rematted_computation` in op_name) a fourth of the experts' matmuls (forward,
    recomputed forward, input and weight gradients) and left out of the ratio."""
    config = _tiny_moe("ragged", remat=("Block",), scan_layers=True)
    compiled, *_ = compile_step(config)
    columns = expert_flops.row_columns(config, compiled.as_text(), {"mesh_devices": 1})
    active = 256 * 2 * 3 * 6 * 2 * 64 * 32
    assert columns["analytic_expert_matmul_flops_per_step"] == active
    assert columns["compiled_expert_matmul_flops_per_step"] == 4 * active * 4 / 3
    assert columns["compiled_expert_recompute_flops_per_step"] == 4 * active / 3
    assert columns["compiled_to_analytic_expert_flops_ratio"] == 4.0
    assert columns["expert_flops_note"] is None


def test_a_dense_model_gets_nulls_with_the_reason():
    config = base_config("tiny-llama", "dense")
    columns = expert_flops.row_columns(config, None, {})
    assert all(columns[name] is None for name in expert_flops.COLUMNS)
    assert "not a mixture of experts" in columns["expert_flops_note"]


def test_a_gpu_plans_columns_are_read_from_the_row_per_device():
    """The plan's child put the compiled columns in the row; on 2 devices each runs half the active FLOPs."""
    config = _tiny_moe("capacity")
    active = expert_flops.analytic_flops_per_step(config)
    row = {
        "mesh_devices": 2,
        "compiled_expert_matmul_flops_per_step": active,
        "compiled_expert_recompute_flops_per_step": 0,
    }
    assert expert_flops.row_columns(config, None, row)["compiled_to_analytic_expert_flops_ratio"] == 2.0
    stale = expert_flops.row_columns(config, None, {"mesh_devices": 1})  # a plan cached before these columns
    assert stale["compiled_to_analytic_expert_flops_ratio"] is None and "plan cache" in stale["expert_flops_note"]


@pytest.mark.slow
@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
def test_an_h100_plan_of_ragged_dot_executes_every_expert():
    """Deviceless H100 plan of tiny-moe's ragged dispatch (cuBLAS GEMMs): XLA's ragged_dot_rewriter expands each
    ragged_dot over all E = 4 experts, so the plan's expert matmuls are 4 times the active experts' (the dense
    dispatch would be E / k = 2)."""
    config = _tiny_moe("ragged")
    plan = gpu_plan.plan_for_target(config, "h100", gemm="cublas", in_process=True)
    columns = expert_flops.row_columns(config, None, {**plan, "mesh_devices": 1})
    assert columns["compiled_to_analytic_expert_flops_ratio"] == 4.0

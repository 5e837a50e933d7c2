"""The analytic memory model's mixture-of-experts terms (jaxscale.measure.moe_memory, through memory): a hand count per
dispatch, and the estimate against XLA's compiled plans (the committed H200 plans of OLMoE's layer, this CPU's, and
deviceless H100 ones)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import REPO, load_config

from jaxscale import run
from jaxscale.config.defaults import load_config_file
from jaxscale.config.spec import capacity
from jaxscale.measure import layer_memory, memory, moe_memory
from jaxscale.measure.activation_dims import Dims, MoEDims
from jaxscale.plan import gpu_plan

GIB = 2**30


def test_capacity_by_hand():
    """Slots per expert per sequence (jaxscale.config.spec.capacity, which the dispatches and this model share),
    ceil(f·T·k / E) and at least 1, by hand: 2·2048·8/64 = 512; 1.25·64·2/8 = 20; 4/64 rounds up to 1;
    0.5·100·3/7 = 21.4 rounds up to 22."""
    cases = {(2048, 8, 64, 2.0): 512, (64, 2, 8, 1.25): 20, (4, 1, 64, 1.0): 1, (100, 3, 7, 0.5): 22}
    assert {case: capacity(*case) for case in cases} == cases


def _dims(dispatch: str, **moe_changes) -> Dims:
    """b=2 sequences of s=4 tokens (N = 8), h=8, bf16 (p=2), E=4 experts, k=2 a token, F=6, C=3 slots."""
    experts = dataclasses.replace(MoEDims(e=4, k=2, f=6, c=3, shared=0, dispatch=dispatch), **moe_changes)
    return Dims(b=2, s=4, h=8, a=2, k=4, f=32, v=16, p=2, q=4, mask=0, kernel_casts=False, attention="reference",
                family="llama", moe=experts)  # fmt: skip


# Bytes one MoE layer keeps, unrolled, by hand at the dims above. Every dispatch: the RMSNorm's input and output
# (2·8·8 = 128 each) and float32 statistic (4·8 = 32), the router's float32 probabilities (4·8·4 = 128), the top-k
# float32 weights and int32 indices (8·8·2 = 128): 544.
# dense: gate, up, hidden [8, 4, 6] (2·192 = 384 each), outputs [8, 4, 8] (512), combine weights [8, 4] (64): 1,728.
# capacity: masks [2, 4, 4, 3] (2·96 = 192 each), dispatched tokens and outputs [2, 4, 3, 8] (384 each), gate, up,
# hidden [2, 4, 3, 6] (288 each): 2,016.
# ragged: sorted tokens and unsorted outputs [16, 8] (256 each), gate, up, hidden [16, 6] (192 each), two int32
# permutations [16] (64 each): 1,216.
# scatter: capacity's tokens and gate, up, hidden (384 + 3·288), the choices' gathered outputs [2, 4, 2, 8] (256) and
# two int32 copies of their slot rows [2, 8] (64 each): 1,632.
HAND_COUNT = {"dense": 544 + 1728, "capacity": 544 + 2016, "ragged": 544 + 1216, "scatter": 544 + 1632}


@pytest.mark.parametrize("dispatch", sorted(HAND_COUNT))
def test_moe_layer_terms_by_hand(dispatch):
    assert sum(layer_memory.moe_mlp_residuals(_dims(dispatch), scanned=False).values()) == HAND_COUNT[dispatch]
    # One shared expert of width 6: a dense SwiGLU's gate, up and hidden [8, 6], 2·48 = 96 bytes each.
    shared = layer_memory.moe_mlp_residuals(_dims(dispatch, shared=6), scanned=False)
    assert sum(shared.values()) == HAND_COUNT[dispatch] + 3 * 96


def test_moe_scanned_terms_policies_and_exchange_by_hand():
    """Scanned, the capacity dispatch keeps besides: silu's three intermediates of each [2, 4, 3, 6] tensor (3·288),
    the one-hot slots [2, 4, 2, 4, 3] (2·192 = 384), the RMSNorm's three float32 [8, 8] intermediates (3·256) in place
    of its input and statistic (128 + 32); with bf16 compute on float32 weights, the experts' bf16 copies 3·(4·8·6)·2
    = 1,152 and the router's float32 input [8, 8] (256). Expert parallelism over 2 devices keeps 2 experts' copies
    (576) and adds the exchange's second [2, 4, 3, 8] copy, 384 bytes, to the working set."""
    unrolled = sum(layer_memory.moe_mlp_residuals(_dims("capacity"), scanned=False).values())
    scanned = sum(layer_memory.moe_mlp_residuals(_dims("capacity"), scanned=True).values())
    assert scanned == unrolled + 3 * 288 + 384 + 3 * 256 - 128 - 32
    casts = dataclasses.replace(_dims("capacity"), kernel_casts=True)
    assert sum(layer_memory.moe_mlp_residuals(casts, scanned=True).values()) == scanned + 1152 + 256
    split = dataclasses.replace(casts, moe=dataclasses.replace(casts.moe, ep=2))
    assert sum(layer_memory.moe_mlp_residuals(split, scanned=True).values()) == scanned + 576 + 256
    assert (moe_memory.all_to_all_bytes(split), moe_memory.all_to_all_bytes(casts)) == (384, 0)
    # Policies by name keep the experts' gate and up (minimal_flash: 2·384 in dense) and outputs (512); by dot type,
    # dots_with_no_batch_dims_saveable keeps the router's float32 logits (128) and, of the dispatches, only the dense
    # one's einsums (no batch dims): gate, up, outputs; capacity's batch over sequence or expert, ragged_dot is none.
    assert layer_memory._policy_saved(_dims("dense"), "minimal_flash")["MLP"] == 2 * 384 + 512
    assert layer_memory._policy_saved(_dims("capacity"), "minimal_flash")["MLP"] == 2 * 288 + 384
    no_batch = {d: layer_memory._policy_saved(_dims(d), "dots_with_no_batch_dims_saveable")["MLP"] for d in HAND_COUNT}
    assert no_batch == {"dense": 128 + 2 * 384 + 512, "capacity": 128, "ragged": 128, "scatter": 128}


def test_first_dense_layers_keep_a_dense_layers_activations():
    """tiny-moe (2 layers, 8 x 32 tokens, hidden 64, bf16, unrolled) with its first layer dense: that layer keeps a
    SwiGLU of the dense width 192, not a MoE layer's terms. By hand, N = 256 tokens: the SwiGLU layer keeps the
    RMSNorm's input and output (2·256·64 = 32,768 each) and statistic (1,024) and gate, up, hidden (2·256·192 =
    98,304 each): 361,472; the ragged MoE layer (4 experts of 32, 2 a token: 512 rows) the same norm terms (66,560),
    router probabilities and top-k (4,096 + 4,096), gate, up, hidden (2·512·32 = 32,768 each), sorted tokens and
    outputs (2·512·64 = 65,536 each) and permutations (4,096): 308,224."""
    config = load_config("bf16_noscan", "tiny-moe")
    config.train.num_minibatches, config.model.moe_dispatch = 1, "ragged"  # the dispatch counted by hand above
    all_moe = memory.analytic_memory(config)["analytic_activation_bytes"]
    config.model.first_dense_layers = 1
    assert memory.analytic_memory(config)["analytic_activation_bytes"] - all_moe == 361_472 - 308_224


# The committed deviceless H200 plans of experiments/moe_dispatch.py:olmoe-1b-7b (OLMoE's layer, 4 layers, 8 x 2048
# tokens, scanned, Block remat, flash; docs/models.md, "Which dispatch on one GPU"), both GEMM modes.
OLMOE_PLANS = REPO / "experiments" / "results" / "moe_dispatch_olmoe-1b-7b_plan_h200" / "results.jsonl"


def _olmoe_rows() -> dict[str, tuple[dict, dict]]:
    """variant -> (its committed plan row, the analytic estimate of the same config rebuilt from the sweep file)."""
    sweep = REPO / "experiments" / "moe_dispatch.py"
    rows = {}
    for line in OLMOE_PLANS.read_text().splitlines():
        row = json.loads(line)
        config = load_config_file(sweep, "olmoe-1b-7b")
        config.model.moe_dispatch = row["config.model.moe_dispatch"]
        config.model.moe_capacity_factor = row["config.model.moe_capacity_factor"]
        shape = (row["config.data.seq_len"], row["config.data.batch_size"])
        assert (config.data.seq_len, config.data.batch_size) == shape
        rows[row["variant"]] = (row, memory.analytic_memory(config))
    return rows


def test_olmoe_estimate_against_the_committed_h200_plans():
    """Capacity (factor 2) within the 8% docs/models.md claims for the Llama estimate of both GEMM modes' plans
    (measured 0.95 of each); dense within 8% of the Triton plan (measured 0.99), while the cuBLAS plan is 1.17x: it
    also materialises the gradient of the experts' outputs [N, E, H] (4 GiB here), which Triton fuses into its GEMM.
    docs/models.md states the three ratios (plan / estimate) as these rows give them."""
    rows = _olmoe_rows()
    row, analytic = rows["capacity"]
    for mode in ("triton", "cublas"):
        assert analytic["analytic_peak_bytes"] == pytest.approx(row[f"compiled_{mode}_peak_bytes"], rel=0.08), mode
    capacity = {
        f"{row[f'compiled_{mode}_peak_bytes'] / analytic['analytic_peak_bytes']:.2f}" for mode in ("triton", "cublas")
    }
    row, analytic = rows["dense"]
    assert analytic["analytic_peak_bytes"] == pytest.approx(row["compiled_triton_peak_bytes"], rel=0.08)
    gradient_of_outputs = 2 * 8 * 2048 * 64 * 2048  # bf16 [N, E, H]: 4 GiB
    cublas_over = row["compiled_cublas_peak_bytes"] - analytic["analytic_peak_bytes"]
    assert gradient_of_outputs < cublas_over < 2.5 * gradient_of_outputs
    (capacity,) = capacity  # the same to two decimals in both GEMM modes, as the doc says
    triton, cublas = (
        row[f"compiled_{mode}_peak_bytes"] / analytic["analytic_peak_bytes"] for mode in ("triton", "cublas")
    )
    text = " ".join((REPO / "docs" / "models.md").read_text().split())
    assert (f"capacity's plan is {capacity} of its estimate in both GEMM modes and dense's Triton plan {triton:.2f} of "
            f"its estimate, while dense's cuBLAS plan is {cublas:.2f}x the estimate") in text  # fmt: skip


def test_estimate_orders_the_dispatches_as_the_committed_plans_except_ragged():
    """Dense above capacity at factor 2, in the plans and the estimate. Ragged: the estimate counts what a grouped
    GEMM keeps, the smallest of the three, while XLA's GPU backend expands `ragged_dot` over every expert, and its
    plan (140.7 GiB, out of memory on the H200 as planned) is over 4x the estimate: the estimate does not stand for
    that program (docs/models.md)."""
    rows = _olmoe_rows()
    plan = {name: row["compiled_peak_bytes"] for name, (row, _) in rows.items()}
    analytic = {name: a["analytic_peak_bytes"] for name, (_, a) in rows.items()}
    assert plan["ragged"] > plan["dense"] > plan["capacity"]
    assert analytic["dense"] > analytic["capacity"] > analytic["ragged"]
    assert plan["ragged"] > 4 * analytic["ragged"]


def _small_moe(dispatch: str, name: str = "bf16_noscan", **changes):
    """tiny-moe widened to 128 (4 heads of 32, 2 K/V heads), 8 experts of 64, 2 a token, capacity factor 2 (C = 32),
    float32, 16 x 64 tokens in one minibatch: each dispatch compiles in seconds with its terms well apart."""
    config = load_config(name, "tiny-moe")
    config.model.update(dtype="float32", hidden_size=128, head_dim=32, max_seq_len=64, num_kv_heads=2)
    config.model.update(mlp_hidden_size=256, num_experts=8, moe_hidden_size=64, moe_capacity_factor=2.0)
    config.model.update(moe_dispatch=dispatch, **changes)
    config.data.update(seq_len=64, batch_size=16)
    config.train.num_minibatches = 1
    return config


def test_cpu_plan_orders_dense_above_capacity_and_expands_ragged():
    """This CPU's float32 plan (where it keeps no extra copies, docs/measurements.md) against the estimate, unrolled:
    dense above capacity in both (measured plans 62.8 and 55.0 MB, estimates 43.0 and 40.8), each within the small-
    scale band of tests/measure/test_memory.py (0.8 to 2.0: measured 1.46 and 1.35); ragged's plan is 2.8x its
    estimate (XLA:CPU expands ragged_dot over every expert too, jaxscale.measure.expert_flops)."""
    peaks = {}
    for dispatch in ("dense", "capacity", "ragged"):
        config = _small_moe(dispatch)
        compiled, *_ = run.compile_step(config)
        peaks[dispatch] = (memory.compiled_memory(compiled)["compiled_peak_bytes"], memory.analytic_memory(config))
    (plan_dense, dense), (plan_capacity, capacity), (plan_ragged, ragged) = peaks.values()
    assert plan_dense > 1.1 * plan_capacity and dense["analytic_peak_bytes"] > capacity["analytic_peak_bytes"]
    for plan, analytic in ((plan_dense, dense), (plan_capacity, capacity)):
        assert 0.8 < plan / analytic["analytic_peak_bytes"] < 2.0
    assert plan_ragged > 2 * ragged["analytic_peak_bytes"]


@pytest.mark.slow
@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
def test_dense_experts_cost_the_h100_plan_what_the_estimate_adds():
    """Scanned with Block remat (the experiment's layout), float32: doubling the dense dispatch's experts from 8 to 16
    adds to XLA's deviceless H100 plan (Triton GEMMs) what it adds to the estimate within 10% (measured 0.93: the
    experts' weights, gradients and Adam state and the recomputed unit's [N, E, F] and [N, E, H] tensors); ~35 s."""
    rows = {}
    for experts in (8, 16):
        config = _small_moe("dense", "bf16_remat_block", num_experts=experts)
        plan = gpu_plan.plan_for_target(config, "h100", gemm="triton", in_process=True)["compiled_peak_bytes"]
        rows[experts] = (plan, memory.analytic_memory(config)["analytic_peak_bytes"])
    added_plan, added_estimate = rows[16][0] - rows[8][0], rows[16][1] - rows[8][1]
    assert added_estimate == pytest.approx(added_plan, rel=0.10)

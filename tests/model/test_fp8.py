"""model.fp8 = "dynamic" (jaxscale.model.fp8): FP8 GEMMs against a NumPy model of e4m3/e5m2 rounding, a closed-form
bound, training within a band of bf16, and what XLA compiles it to for a GPU target (deviceless)."""

from __future__ import annotations

import gzip
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import load_config, train_losses

from jaxscale.config import ConfigError, validate
from jaxscale.config.spec import ModelConfig
from jaxscale.model import fp8
from jaxscale.plan import gpu_plan, targets
from jaxscale.plan.errors import PlanFlagError

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the formats' largest finite values (OCP FP8 spec; float8_e4m3fn has no inf)
E4M3_U, E5M2_U = 2.0**-4, 2.0**-3  # unit roundoff: half the spacing at 1.0 with 3 and 2 mantissa bits
DIMS = (((1,), (0,)), ((), ()))  # x [m, k] @ w [k, n], as nn.DenseGeneral contracts its input's last axis


def _np_quantized(x: np.ndarray, fmt, fmt_max: float) -> np.ndarray:
    """x rounded to `fmt` at its own tensorwise scale amax / fmt_max, scaled back, in float64 (ml_dtypes rounds to
    nearest even, as XLA's convert does)."""
    scale = np.abs(x).max() / fmt_max
    return (x / scale).astype(fmt).astype(np.float64) * scale


def _operands(seed: int = 0, m: int = 16, k: int = 64, n: int = 32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (m, k))).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.1
    return x, w


def _fp8_dot(x: np.ndarray, w: np.ndarray):
    cfg = ModelConfig(dtype="float32", fp8="dynamic")
    return fp8.dot_general(cfg, ("embed", "mlp"))(jnp.asarray(x), jnp.asarray(w), DIMS)


def test_one_fp8_gemm_equals_the_product_of_e4m3_rounded_operands():
    """The forward GEMM is x and w each rounded to e4m3 at amax/448 and multiplied (in float32 here): equal to
    NumPy's float64 product of the same roundings within float32 accumulation, and off the exact product by no
    more than e4m3's rounding allows (the closed form below), and by more than float32 alone would be."""
    x, w = _operands()
    out = np.asarray(_fp8_dot(x, w), np.float64)
    xq, wq = _np_quantized(x, ml_dtypes.float8_e4m3fn, E4M3_MAX), _np_quantized(w, ml_dtypes.float8_e4m3fn, E4M3_MAX)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    np.testing.assert_allclose(out, xq @ wq, rtol=0, atol=64 * 2**-24 * magnitude.max())  # k=64 float32 adds
    # Closed form: a normal e4m3 value is within u = 2^-4 of x relative; a subnormal one (below 2^-6 x scale) within
    # half the subnormal spacing, 2^-10 x scale, absolute. So |xq_i wq_j - x_i w_j| <= ((1+u)^2 - 1) |x_i w_j| +
    # the subnormal terms, summed over k.
    sx, sw = np.abs(x).max() / E4M3_MAX, np.abs(w).max() / E4M3_MAX
    sub_x, sub_w = 2.0**-10 * sx, 2.0**-10 * sw
    bound = ((1 + E4M3_U) ** 2 - 1) * magnitude + sub_x * np.abs(w).sum(0) + sub_w * np.abs(x).sum(1)[:, None]
    bound += len(w) * sub_x * sub_w  # both operands subnormal: negligible, counted anyway
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.all(np.abs(out - exact) <= bound * (1 + 1e-6) + 64 * 2**-24 * magnitude.max())
    assert np.abs(out - exact).max() > 1e-3 * np.abs(exact).max()  # FP8's error, not float32's (~1e-7)


def test_the_backward_gemms_take_the_gradient_in_e5m2_and_the_forward_operands_in_e4m3():
    """dx = round_e5m2(g) @ round_e4m3(w).T and dw = round_e4m3(x).T @ round_e5m2(g), each at its tensor's scale."""
    x, w = _operands(1)
    g = np.random.default_rng(2).standard_normal((x.shape[0], w.shape[1])).astype(np.float32)
    _, vjp = jax.vjp(_fp8_dot, x, w)
    dx, dw = (np.asarray(a, np.float64) for a in vjp(jnp.asarray(g)))
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    xq, wq, gq = _np_quantized(x, e4m3, E4M3_MAX), _np_quantized(w, e4m3, E4M3_MAX), _np_quantized(g, e5m2, E5M2_MAX)
    for got, want in ((dx, gq @ wq.T), (dw, xq.T @ gq)):
        np.testing.assert_allclose(got, want, rtol=0, atol=64 * 2**-24 * np.abs(want).max() * 4)
    assert np.abs(dx - g.astype(np.float64) @ w.T).max() > 1e-3 * np.abs(dx).max()  # e5m2's error is there


def test_fp8_targets_choose_the_projections_and_bad_ones_are_one_line():
    cfg = ModelConfig(family="llama", fp8="dynamic", fp8_targets=("mlp", "head"))
    assert [name for name in ("q", "k", "v", "out", "gate", "up", "down", "output") if fp8.applies(cfg, name)] == [
        "gate", "up", "down", "output"]  # fmt: skip
    assert not fp8.applies(ModelConfig(family="llama", fp8="none"), "up")
    config = load_config("bf16_remat", "tiny")
    config.model.fp8, config.model.fp8_targets = "dynamic", ("attention", "gate")  # gate: llama's, not gpt's
    with pytest.raises(ConfigError, match=r"^model.fp8_targets: unknown 'gate' for model.family=gpt; allowed: "):
        validate(config)
    config.model.fp8 = "rowwise"  # torchao's other recipe: not offered
    with pytest.raises(ConfigError, match=r"^model.fp8: "):
        validate(config)


def _losses(preset: str, fp8_mode: str, steps: int) -> np.ndarray:
    config = load_config("bf16_remat", preset)
    config.model.fp8 = fp8_mode
    config.model.dropout_rate = 0.0
    validate(config)
    return train_losses(config, steps)[0]


# Measured on this CPU with the tests' own setup (bf16 compute, 30 steps on four random-token batches in turn): bf16's
# loss falls 5.386 -> 3.537 (tiny GPT) and 4.867 -> 4.357 (tiny Llama); FP8's differs from it by at most 0.045 and
# 0.021 nats at any step, 2.4% and 4.2% of those falls. The band, 10% of bf16's fall, is 4x and 2.4x the gaps seen;
# a GEMM that lost its scale (or quantized without one) diverges from the first steps on.
STEPS, BAND_OF_FALL = 30, 0.10


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_a_tiny_model_trained_in_fp8_stays_within_a_band_of_bf16(preset):
    bf16, fp8_losses = _losses(preset, "none", STEPS), _losses(preset, "dynamic", STEPS)
    fall = bf16[0] - bf16[-1]
    assert fall > 0.3  # it trains
    gap = np.abs(fp8_losses - bf16)
    assert gap.max() < BAND_OF_FALL * fall, (gap, fall)
    assert gap.max() > 0  # FP8 rounding changed the program's numbers: not bf16's program


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
def test_a_gpu_target_compiles_fp8_gemms_and_the_kernels_read_them_as_fp8(tmp_path):
    """Deviceless H100 compile of the tiny GPT in FP8: cuBLAS mode calls cuBLASLt's FP8 matmul, Triton mode fuses
    GEMMs over f8 operands, and the kernels read from the program carry flop_dtype f8 for exactly those. By hand,
    per layer (the scanned body): the 4 projections (qkv, out, up, down) forward, their 4 input gradients and 4
    weight gradients, and the remat of MLP and Attn recomputing qkv and up, whose outputs the attention's and the
    GELU's backward read (out's and down's outputs nobody reads: XLA drops their recomputation): 14."""
    from jaxscale.measure import kernels

    config = load_config("bf16_remat", "tiny")
    config.model.fp8 = "dynamic"
    validate(config)
    text = targets.target_config_text(targets.get_target("h100"))
    counts = {}
    for gemm in ("cublas", "triton"):
        path = tmp_path / f"{gemm}.hlo.gz"
        gpu_plan.compile_in_process(config, text, gemm, hlo_path=path)
        program = gzip.open(path, "rt").read()
        found = [k for k in kernels.kernels(program) if k.category == "matmul"]
        counts[gemm] = sum(k.flop_dtype == "f8" for k in found)
        if gemm == "cublas":
            assert program.count('custom_call_target="__cublas$lt$matmul$f8"') == counts[gemm] > 0
        else:
            fused = re.findall(r"\n%gemm_fusion\S* \(parameter_0\S*: (f8e[45]m[23]\w*)\[", program)
            assert len(fused) >= counts[gemm] > 0
    assert counts["cublas"] == counts["triton"]
    assert counts["cublas"] == 4 + 4 + 4 + 2


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
@pytest.mark.slow
@pytest.mark.parametrize("target", ["b200", "gb200", "l40s"])
def test_blackwell_and_ada_targets_compile_the_same_fp8_gemms(tmp_path, target):
    """The B200 and GB200 (sm_100) and L40S (sm_89) targets: cuBLASLt's FP8 matmul for the same 14 GEMMs per layer
    as the H100 (the count by hand in the test above)."""
    config = load_config("bf16_remat", "tiny")
    config.model.fp8 = "dynamic"
    validate(config)
    path = tmp_path / "cublas.hlo.gz"
    gpu_plan.compile_in_process(config, targets.target_config_text(targets.get_target(target)), "cublas",
                                hlo_path=path)  # fmt: skip
    assert gzip.open(path, "rt").read().count('custom_call_target="__cublas$lt$matmul$f8"') == 4 + 4 + 4 + 2


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_one_line():
    config = load_config("bf16_remat", "tiny")
    config.model.fp8 = "dynamic"
    with pytest.raises(PlanFlagError, match=r"^model.fp8: 'dynamic' needs FP8 tensor cores .* a100-80gb is 8.0;"):
        gpu_plan.check_fp8(config, "a100-80gb")
    gpu_plan.check_fp8(config, "l4")  # Ada: has them
    gpu_plan.check_fp8(config, "b200")


def _gathered(program: str) -> dict[tuple[str, str], int]:
    """(dtype, shape) -> count of the arrays the program's all-gathers produce (async starts and sync ones)."""
    counts: dict[tuple[str, str], int] = {}
    for line in program.splitlines():
        if " all-gather-start(" not in line and " all-gather(" not in line:
            continue
        result = line.split(" all-gather")[0].split("), (")[-1]  # an async start's tuple: (operands), (results)
        for found in re.findall(r"(f8e4m3fn|f8e5m2|bf16|f32)\[(\d+(?:,\d+)*)\]", result):
            counts[found] = counts.get(found, 0) + 1
    return counts


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
@pytest.mark.parametrize("mode", ["dynamic", pytest.param("delayed", marks=pytest.mark.slow)])
def test_fsdp_on_a_gpu_target_gathers_the_fp8_weights_in_fp8(tmp_path, mode):
    """torchtitan's "Float8 + FP8 all-gather" is what XLA's GPU compiler does by itself: with FSDP over 8 H100s (the
    tiny GPT, scanned) every projection kernel is all-gathered as float8_e4m3fn (quantized on its shard, the scale
    an all-reduced max), none in bf16; the embedding tables, which are not FP8, still gather bf16. The gathered
    shapes by hand: qkv [64, 4, 48] (hidden, heads, 3 x head_dim), out [64, 16, 4] as laid out, up and down 64 x 256."""
    config = load_config("bf16_remat", "tiny")
    config.model.fp8, config.model.scan_layers, config.mesh.fsdp, config.data.batch_size = mode, True, 8, 16
    validate(config)
    path = tmp_path / "fsdp.hlo.gz"
    gpu_plan.compile_in_process(config, targets.target_config_text(targets.get_target("h100")), "cublas", devices=8,
                                hlo_path=path)  # fmt: skip
    gathered = _gathered(gzip.open(path, "rt").read())
    kernels = ("64,4,48", "64,16,4", "64,256")
    assert all(gathered.get(("f8e4m3fn", shape), 0) > 0 for shape in kernels), gathered
    assert not any(gathered.get(("bf16", shape), 0) for shape in kernels), gathered
    assert gathered.get(("bf16", "64,128"), 0) > 0  # the token table [vocab 128, hidden 64]: bf16 as without FP8

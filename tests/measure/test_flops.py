"""jaxscale.flops: analytic model and hardware FLOPs against XLA's count and the compiled matmuls."""

from __future__ import annotations

import functools
import re

import pytest
from conftest import load_config

from jaxscale import run
from jaxscale.config import REMAT_POLICIES, base_config
from jaxscale.measure import flops, hlo

SLOW = pytest.mark.slow


def _columns(config) -> tuple[dict, dict, str]:
    compiled, *_ = run.compile_step(config)
    text = compiled.as_text()
    return flops.analytic_columns(config), flops.compiled_columns(compiled, text), text


def test_reference_param_count():
    config = load_config("bf16", "seed")
    assert flops.param_count(config.model) == 155_877_376  # the notebook's parameter count
    assert flops.recompute_flops_per_step(config) == 0  # no remat


def _attention_dot_flops(module: hlo.Module) -> int:
    """FLOPs of the dots with batch dimensions (batch, heads): QK^T and AV and their gradients, nothing else
    (the projections' dots, forward and backward, have none). No loops here, so each dot runs once."""
    return sum(
        hlo.matmul_flops(instruction, computation)
        for computation in module.computations.values()
        for instruction in computation.values()
        if hlo.is_matmul(instruction) and re.search(r"lhs_batch_dims=\{\d", instruction.attributes)
    )


@functools.cache
def _unrolled_step():
    """(config, compiled step) of bf16_noscan (no scanned layers, minibatches in an unrolled loop) at hidden 512 without
    dropout, which the two tests below read: compiled once a test process."""
    config = load_config("bf16_noscan")
    config.train.accumulate = "loop"
    config.model.update(hidden_size=512, head_dim=128, dropout_rate=0.0)  # matmuls dominate, as at scale
    compiled, *_ = run.compile_step(config)
    return config, compiled


def test_model_flops_terms_against_the_compiled_matmuls():
    """6N + 12·L·H·Q·T per token, checked term by term against the dots of a compiled step (unrolled, no remat,
    no dropout): the attention term is exactly the attention einsums' FLOPs (forward and backward), causal
    halves it, and 6N is the projections' dots up to the biases and LayerNorms N counts (0.2% here)."""
    config, compiled = _unrolled_step()
    module = hlo.parse(compiled.as_text())
    assert hlo.count_matmul_flops(module).matmul_loops == 0  # every dot runs once (a loop of the RNG has none)
    matmuls, attention = hlo.count_matmul_flops(module).matmul_flops, _attention_dot_flops(module)
    model, six_n = flops.model_flops_per_step(config), flops.six_n_flops_per_step(config)
    assert attention > 0 and model - six_n == attention
    assert model - flops.model_flops_per_step(config, causal=True) == attention / 2
    assert six_n == pytest.approx(matmuls - attention, rel=5e-3) and six_n > matmuls - attention


def test_unrolled_step_xla_count_agrees_with_analytic():
    config, step = _unrolled_step()  # no scanned layers, minibatches in an unrolled loop
    analytic, compiled = flops.analytic_columns(config), flops.compiled_columns(step, step.as_text())
    assert compiled["compiled_matmul_loops"] == 0
    xla = compiled["compiled_xla_flops_per_step"]
    assert xla == pytest.approx(analytic["analytic_model_flops_per_step"], rel=0.05)
    assert compiled["compiled_matmul_flops_per_step"] == pytest.approx(analytic["analytic_hardware_flops_per_step"])


_FAST_CELLS = {("Block", "nothing_saveable"), ("Block", "dots_saveable"), ("Block", "selective_op"),
               ("Attn", "save_qkv_proj"), ("MLP", "nothing_saveable")}  # fmt: skip
# The default suite checks five cells (every remat target, saving nothing, every dot, one projection and
# torchtitan's every-second matmul; ~8 s a cell on 2 shared cores); every cell runs under -m slow.
_POLICY_CELLS = [
    (target, policy) if (target, policy) in _FAST_CELLS else pytest.param(target, policy, marks=SLOW)
    for policy in REMAT_POLICIES
    for target in ("Attn", "MLP", "Block")
]


@pytest.mark.parametrize("target, policy", _POLICY_CELLS)
def test_recompute_table_matches_the_compiled_matmuls_for_every_policy(target, policy):
    """Every cell of flops.recomputed (docs/measurements.md's table): the scanned step's dots, each loop body
    times its trip count, equal 3 x the forward matmuls plus what the table says remat recomputes."""
    config = load_config("bf16_remat")  # layers and minibatches scanned
    config.model.update(remat=(target,), remat_policy=policy, dropout_rate=0.0)
    analytic, compiled, text = _columns(config)
    hardware = analytic["analytic_hardware_flops_per_step"]
    assert compiled["compiled_matmul_flops_per_step"] == pytest.approx(hardware)  # every dot, trip counts applied
    recomputed = flops.recomputed(policy, "gpt")[target]
    assert (analytic["analytic_recompute_flops_per_step"] > 0) == bool(recomputed)
    assert compiled["compiled_xla_flops_lower_bound"] and compiled["compiled_matmul_loops"] >= 2
    assert compiled["compiled_xla_flops_per_step"] < 0.6 * hardware  # XLA counts each loop body once
    assert compiled["compiled_xla_flops_corrected_per_step"] >= compiled["compiled_matmul_flops_per_step"]
    if recomputed:  # the trace analysis can tell recomputed ops from the others
        assert any(remat for _, remat in hlo.op_table(hlo.parse(text)).values())


def test_mfu_divides_model_flops_per_second_by_the_peak(monkeypatch):
    monkeypatch.setattr(flops.peaks, "resolve_peak", lambda dtype, device=None: (1e12, "test peak"))
    row = {"step_s_median": 0.5, "analytic_model_flops_per_step": 2e11, "analytic_hardware_flops_per_step": 3e11}
    columns = flops.utilization_columns(row, "bfloat16")
    assert columns["mfu"] == pytest.approx(0.4) and columns["hfu"] == pytest.approx(0.6)
    assert columns["peak_flops_source"] == "test peak"
    monkeypatch.setattr(flops.peaks, "resolve_peak", lambda dtype, device=None: (None, "unknown device"))
    assert flops.utilization_columns(row, "bfloat16")["mfu"] is None  # never divided by a guessed peak


@pytest.mark.parametrize(
    "remat, policy, scan_layers, tie",
    [
        ((), "nothing_saveable", True, True),
        pytest.param(("MLP", "Attn"), "nothing_saveable", True, False, marks=SLOW),
        pytest.param(("Block",), "nothing_saveable", True, True, marks=SLOW),
        (("MLP", "Attn"), "save_qkv_proj", True, True),
        pytest.param(("Block",), "dots_with_no_batch_dims_saveable", True, False, marks=SLOW),
        pytest.param(("Block",), "save_qkv_proj", False, True, marks=SLOW),
        # torchtitan's every-second matmul: llama recomputes k alone and up without its gate (flops.recomputed)
        (("Block",), "selective_op", True, True),
        pytest.param(("Attn",), "selective_op", True, True, marks=SLOW),
        pytest.param(("MLP",), "selective_op", True, False, marks=SLOW),
        pytest.param(("Block",), "save_dot_with_context_except_mlp", True, False, marks=SLOW),
        pytest.param(("Block",), "minimal_flash", True, True, marks=SLOW),
        # a per-activation policy keeping llama's up without its gate recomputes the gate alone (the frontier's walk)
        (("Block",), "per_activation:mlp_up=device", True, True),
    ],
)
def test_llama_compiled_matmuls_equal_the_analytic_hardware_flops(remat, policy, scan_layers, tie):
    """Three MLP matrices, the narrower K/V of GQA, the tied head and each remat's recomputation: the loop-aware
    count of the compiled step's dots equals the analytic hardware FLOPs exactly."""
    config = base_config("tiny-llama", "flops")  # 4 query heads share 2 K/V heads
    config.model.update(remat=remat, remat_policy=policy, scan_layers=scan_layers, tie_embeddings=tie)
    config.model.update(hidden_size=128, head_dim=32, mlp_hidden_size=256)
    analytic, compiled, _ = _columns(config)
    assert compiled["compiled_matmul_flops_per_step"] == pytest.approx(analytic["analytic_hardware_flops_per_step"])
    assert (analytic["analytic_recompute_flops_per_step"] > 0) == bool(remat)


def test_llama_formulas_count_gqa_swiglu_and_the_tied_head():
    config = base_config("llama3.1-8b", "flops")
    m, per_token = config.model, flops.forward_matmul_flops_per_token(config)
    h, kv, f = 4096, 8 * 128, 14336
    assert (
        per_token["qkv"] == 2 * h * (h + 2 * kv) and per_token["up"] == 2 * 2 * h * f and per_token["down"] == 2 * f * h
    )
    assert flops.non_embedding_params(m) == 8_030_261_248 - 128256 * h  # untied: the embedding is a gather only
    tied = base_config("llama3.2-1b", "flops").model
    assert flops.non_embedding_params(tied) == 1_235_814_400  # tied: the embedding is the head's matmul too
    gpt2 = base_config("gpt2", "flops").model
    assert flops.non_embedding_params(gpt2) == 124_439_808 - 1024 * 768  # only the position table is a gather


@pytest.mark.parametrize(
    "family, fields",
    [
        ("llama", dict(lora_rank=4, lora_targets=("all",), train="adapters", head=False, remat=("Block",))),
        pytest.param("gpt", dict(lora_rank=8, lora_targets=("attention",), train="adapters", head=True, remat=()),
                     marks=SLOW),
        ("llama", dict(lora_rank=0, lora_targets=(), train="last_blocks", head=True, remat=("MLP", "Attn"))),
        pytest.param("llama", dict(lora_rank=2, lora_targets=("q", "v"), train="adapters", head=False,
                                   remat=("Attn",), policy="save_qkv_proj"), marks=SLOW),
        ("gpt", dict(lora_rank=0, lora_targets=(), train="last_blocks", last_blocks=0, head=True, remat=("Block",))),
        pytest.param("gpt", dict(lora_rank=2, lora_targets=("all",), train="adapters", head=False, remat=("Block",),
                                 policy="dots_with_no_batch_dims_saveable"), marks=SLOW),
    ],
    ids=["llama_lora_all_block_remat", "gpt_lora_attention_head", "llama_last_block_remat", "llama_lora_qv_attn_remat",
         "gpt_head_alone", "gpt_lora_dots_saved"],
)  # fmt: skip
def test_fine_tuning_compiled_matmuls_equal_the_analytic_hardware_flops(family, fields):
    """Frozen kernels lose their weight-gradient matmuls, LoRA adds its adapters' three, and frozen blocks below the
    trained ones lose their backward pass (and remat's recomputation): the compiled step's dots, counted with trip
    counts, equal the analytic hardware FLOPs exactly."""
    config = base_config("tiny" if family == "gpt" else "tiny-llama", "flops")
    config.model.update(lora_rank=fields["lora_rank"], lora_targets=fields["lora_targets"], remat=fields["remat"])
    config.model.remat_policy = fields.get("policy", "nothing_saveable")
    config.model.scan_layers = fields["train"] != "last_blocks"
    config.finetune.update(train=fields["train"], head=fields["head"], last_blocks=fields.get("last_blocks", 1))
    analytic, compiled, _ = _columns(config)
    full = base_config(config.preset, "full")
    full.model.update(lora_rank=fields["lora_rank"], lora_targets=fields["lora_targets"], remat=fields["remat"])
    full.model.remat_policy = config.model.remat_policy
    full.finetune.train = "all"  # the base and the adapters (with adapters, "auto" would train them alone)
    assert analytic["analytic_hardware_flops_per_step"] < flops.hardware_flops_per_step(full)
    assert compiled["compiled_matmul_flops_per_step"] == pytest.approx(analytic["analytic_hardware_flops_per_step"])


def test_chunked_loss_recomputed_head_is_in_the_hardware_flops():
    """train.loss_chunk_len runs each chunk's head under jax.checkpoint: the backward pass computes the logits again.
    The compiled step's dots (loop-aware) equal the analytic hardware FLOPs with it, and the chunked step has exactly
    one more head forward than the whole-sequence step: 2·H·V per token, counted here by hand."""
    counts = {}
    for chunk_len in (0, 8):
        config = base_config("tiny", "flops")
        config.model.update(remat=("Block",), scan_layers=True)
        config.train.loss_chunk_len = chunk_len
        analytic, compiled, _ = _columns(config)
        assert compiled["compiled_matmul_flops_per_step"] == pytest.approx(analytic["analytic_hardware_flops_per_step"])
        counts[chunk_len] = compiled["compiled_matmul_flops_per_step"]
    m, d = config.model, config.data
    assert (d.batch_size, d.seq_len, m.hidden_size, m.vocab_size) == (8, 32, 64, 128)  # the hand count's sizes
    assert counts[8] - counts[0] == 2 * 64 * 128 * (8 * 32)  # one head forward more, per token of the step

"""jaxscale.memory: the analytic estimate's breakdown, its targets at the reference scale, and its ordering
of variants against XLA's compiled plan."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
from conftest import REPO, load_config

from jaxscale import run
from jaxscale.config.spec import RunSpec
from jaxscale.measure import flops, layer_memory, memory, params
from jaxscale.measure.activation_dims import Dims
from jaxscale.plan import gpu_plan
from jaxscale.report import docs_tables

GIB = 2**30
# The notebook's measured A5000 peaks, in GiB: it read them from TensorBoard's memory viewer, which prints
# binary units (experiments/seed_table.py, docs/gpu_planning.md). fp32 ran at the card's edge with XLA's
# auto-remat warnings, so only the bf16 variants are compared.
NOTEBOOK_PEAK_GIB = {
    "bf16": 14.6,
    "bf16_noscan": 8.8,
    "bf16_remat": 3.9,
    "bf16_remat_block": 3.8,
    "bf16_remat_noaccum": 6.2,
}


def test_breakdown_of_states_follows_the_optimizer_and_accumulation():
    config = load_config("bf16_remat")
    n = flops.param_count(config.model)
    row = memory.analytic_memory(config)
    assert row["analytic_params_bytes"] == 4 * n
    assert row["analytic_optimizer_bytes"] == 2 * 4 * n  # Adam: two float32 moments
    # the accumulator, and what the backward pass makes besides it with the layers' gradients added into it
    # (train.grad_accumulation auto: in_backward, the tiny GPT scanned): one layer's, by hand (qkv 64 x 4 x 48 and its
    # bias, out 4 x 16 x 64 and its bias, two LayerNorms' scales and biases, up 64 x 256, down 256 x 64 and their
    # biases) and the parameters outside the stack but the untied token table (whose scatter-add XLA folds into the
    # accumulator): positions 32 x 64, the final LayerNorm, the output projection 64 x 128 and its bias
    layer = 64 * 4 * 48 + 4 * 48 + 4 * 16 * 64 + 64 + 4 * 64 + 64 * 256 + 256 + 256 * 64 + 64
    assert row["analytic_grads_bytes"] == 4 * n + 4 * (layer + 32 * 64 + 2 * 64 + 64 * 128 + 128)
    parts = ("params", "grads", "optimizer", "activation")
    assert row["analytic_peak_bytes"] == sum(row[f"analytic_{p}_bytes"] for p in parts)
    config.train.grad_accumulation = "after_backward"
    assert memory.analytic_memory(config)["analytic_grads_bytes"] == 2 * 4 * n  # minibatch gradients + accumulator
    config.optimizer.name, config.train.num_minibatches = "sgd", 1
    row = memory.analytic_memory(config)
    assert row["analytic_optimizer_bytes"] == 4 * n and row["analytic_grads_bytes"] == 4 * n


def test_activations_respond_to_dtype_remat_scan_and_sequence():
    def activation(name, **changes):
        config = load_config(name, "seed")
        for field, value in changes.items():
            group, key = field.split(".")
            config[group][key] = value
        return memory.analytic_memory(config)["analytic_activation_per_layer_bytes"]

    assert activation("fp32") > activation("bf16") > activation("bf16_noscan")  # scan keeps more than unrolled
    assert activation("bf16_noscan") > 5 * activation("bf16_remat") > 5 * activation("bf16_remat_block")
    assert activation("bf16_remat_block") == 64 // 4 * 512 * 1024 * 2  # remat Block keeps its bf16 input only
    # The attention matrices grow with the square of the sequence, the rest linearly.
    short, long = activation("bf16_noscan", **{"data.seq_len": 256}), activation("bf16_noscan")
    assert 2 < long / short < 4
    assert activation("bf16_noscan", **{"model.softmax_dtype": "bfloat16"}) < activation("bf16_noscan")


# What the model claims (docs/measurements.md): it leaves out transients, the allocator and the CUDA context,
# so it sits at or just below a measured peak, by at most 6% (measured: 3.2% to 5.1% below). The exception is
# one minibatch of 64 sequences: there the A5000 plan's peak sits in the layers' backward pass, not at the
# logits (a vocabulary of 8192 instead of 2048 moves the plan by 1.5%), where the estimate misses about
# 0.4 GiB (11% below the notebook, 7% below the plan). The logits term is the plans' 4 bytes per logit where
# the logits decide the peak (vocabulary 32768 at :seed, 128256 for llama3.2-1b; docs/measurements.md).
BELOW, ABOVE = 0.94, 1.02
BELOW_ONE_MINIBATCH = 0.88


def _estimate_over_notebook(name: str) -> float:
    config = load_config(name, "seed")
    config.train.grad_accumulation = "after_backward"  # the notebook's program: each minibatch's gradient, then added
    return memory.analytic_memory(config)["analytic_peak_bytes"] / GIB / NOTEBOOK_PEAK_GIB[name]


def _band(name: str) -> tuple[float, float]:
    return (BELOW_ONE_MINIBATCH if name == "bf16_remat_noaccum" else BELOW), ABOVE


@pytest.mark.parametrize("name", sorted(NOTEBOOK_PEAK_GIB))
def test_reference_scale_estimate_sits_just_below_the_notebooks_peak(name):
    below, above = _band(name)
    assert below <= _estimate_over_notebook(name) <= above


@pytest.mark.parametrize(
    "drop",
    [("attention_residuals", "ln_float32"), ("mlp_residuals", "ln_float32"), ("mlp_residuals", "gelu_intermediates")],
)
def test_the_check_above_fails_without_a_term_of_the_model(drop, monkeypatch):
    """The band is narrow enough to notice a missing term: without the scanned layers' float32 LayerNorm
    intermediates or the GELU intermediates, a variant leaves it."""
    function, term = drop
    original = getattr(layer_memory, function)

    def without(*args, **kwargs):
        terms = original(*args, **kwargs)
        terms.pop(term, None)
        return terms

    monkeypatch.setattr(layer_memory, function, without)
    ratios = {name: _estimate_over_notebook(name) for name in NOTEBOOK_PEAK_GIB}
    assert any(not _band(name)[0] <= ratio <= _band(name)[1] for name, ratio in ratios.items()), ratios


# (preset, config files, model changes) of the ordering check, one per family, in float32.
ORDERING_CASES = {
    "gpt": ("tiny", ("fp32", "bf16_noscan", "bf16_remat", "bf16_remat_noaccum"), {}),
    "llama": (
        "tiny-llama",
        ("fp32", "bf16_noscan", "bf16_remat", "bf16_remat_block", "bf16_remat_noaccum"),
        {"mlp_hidden_size": 384},
    ),
}


@pytest.mark.parametrize(
    "family",
    ["gpt", pytest.param("llama", marks=pytest.mark.slow)],  # the Llama's analytic terms: test_llama_*
)
def test_estimate_orders_variants_like_the_compiled_plan(family):
    """float32 variants, where the CPU compiler keeps no extra copies (in bf16 it keeps float32 ones, see
    docs/measurements.md): every pair the compiled plan separates by over 10% is ordered the same."""
    preset, names, changes = ORDERING_CASES[family]
    peaks = {}
    for name in names:
        config = load_config(name, preset)
        config.model.update(dtype="float32", hidden_size=128, head_dim=32, max_seq_len=64, **changes)
        config.data.update(seq_len=64, batch_size=16)
        compiled, *_ = run.compile_step(config)
        peaks[name] = (memory.compiled_memory(compiled)["compiled_peak_bytes"], memory.analytic_memory(config))
    for (a, (compiled_a, analytic_a)), (b, (compiled_b, analytic_b)) in itertools.combinations(peaks.items(), 2):
        if abs(compiled_a / compiled_b - 1) > 0.10:
            same = (compiled_a > compiled_b) == (analytic_a["analytic_peak_bytes"] > analytic_b["analytic_peak_bytes"])
            assert same, f"{a} vs {b}: compiled {compiled_a} vs {compiled_b}, analytic {analytic_a} vs {analytic_b}"
    for name, (compiled, analytic) in peaks.items():  # at this small scale transients the model omits weigh more
        assert 0.8 < compiled / analytic["analytic_peak_bytes"] < 2.0, name


def test_ratio_column_compares_compiled_with_analytic():
    config = load_config("bf16_remat")
    analytic = memory.analytic_memory(config)["analytic_peak_bytes"]
    columns = memory.analytic_columns(config, compiled_peak_bytes=2 * analytic)
    assert columns["compiled_to_analytic_peak_ratio"] == pytest.approx(2.0)
    assert memory.analytic_columns(config, compiled_peak_bytes=None)["compiled_to_analytic_peak_ratio"] is None
    assert columns["analytic_fitted_terms"] == "logits"  # the one term fitted to plans (docs/measurements.md)


@pytest.mark.slow
@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
@pytest.mark.parametrize("name", sorted(NOTEBOOK_PEAK_GIB))
def test_reference_scale_estimate_matches_the_a5000_plan(name, tmp_path):
    """The estimate against XLA's deviceless A5000 plan (both GEMM modes, the larger) at :seed, ~20 s each."""
    row = run.run(load_config(name, "seed"), tmp_path, name, plan_only=True, progress=False, target="a5000")
    assert row["status"] == "ok", row["error"]
    assert row["compiled_to_analytic_peak_ratio"] == pytest.approx(1.0, rel=0.10)


def test_adafactor_state_is_factored_and_counted_per_shape():
    config = load_config("bf16_remat", "llama3.2-1b")
    adam = memory.analytic_memory(config)["analytic_optimizer_bytes"]
    config.optimizer.name = "adafactor"
    row = memory.analytic_memory(config)
    shapes = params.param_shapes(config.model)
    assert row["analytic_optimizer_bytes"] == 4 * params.adafactor_state_elements(shapes)
    assert row["analytic_optimizer_bytes"] < 0.1 * adam  # row and column second moments instead of two full copies


# Mixtral 8x7B's tensors (params.param_table, scanned: [layers, ...]) whose 8-bit absmax is split by fsdp, read off
# their shapes by hand: the blocks run along the smallest trailing run of axes that is whole 2048-element blocks, and
# the absmax is split only where "embed" lies before that run. q [32, 4096, 32, 128]: run 32 x 128 = 2 blocks;
# gate and up [32, 8, 4096, 14336]: run 14336 = 7 blocks. Every other tensor's run holds its embed axis, so its absmax
# is whole on every device: k and v [32, 4096, 8, 128] (8 x 128 = 1024 is half a block: run 4096 x 1024), router
# [32, 4096, 8], out [32, 32, 128, 4096] and down [32, 8, 14336, 4096] (run 4096), the embedding [32000, 4096] (run
# 4096), the head [4096, 32000] (32000 = 15.6 blocks: the whole tensor), the norm scales [32, 4096] and [4096].
MIXTRAL_ABSMAX_SPLIT = ("transformer/blocks/attn/q/kernel", "transformer/blocks/mlp/experts/gate",
                        "transformer/blocks/mlp/experts/up")  # fmt: skip


def test_int8_adam_state_of_mixtral_under_fsdp8_is_split_and_below_float32_adams():
    """Mixtral 8x7B (46,702,792,704 parameters) at mesh.fsdp=8, ZeRO-3: the analytic 8-bit Adam state on one device
    is 11,753,535,504 bytes (10.95 GiB), float32 Adam's 46,702,792,704 (43.50 GiB, 3.97x), each equal to a hand count
    from the parameter shapes. Every tensor has 4096 x 2048 elements or more (none keeps float32 moments) and an embed
    axis, split 8 ways (fsdp x context x expert = 8 x 1 x 1; the experts' expert axis takes mesh.expert = 1): per
    moment 1 byte per element / 8 of codes, and 4 bytes per 2048-element block of absmax, / 8 where the blocks run
    after the embed axis (MIXTRAL_ABSMAX_SPLIT), whole elsewhere (the 7,861,890 blocks of the other tensors, 31 MB a
    moment on every device). Float32 Adam: 2 moments x 4 bytes per element / 8."""
    config = load_config("bf16_remat", "mixtral-8x7b")
    config.mesh.fsdp = 8
    adam = memory.optimizer_state_bytes(RunSpec.from_config(config))
    config.optimizer.state_dtype = "int8"
    int8 = memory.optimizer_state_bytes(RunSpec.from_config(config))
    table = params.param_table(config.model)
    n = sum(math.prod(shape) for shape, _ in table.values())
    assert n == 46_702_792_704 and min(math.prod(shape) for shape, _ in table.values()) == 4096
    assert all("embed" in names and shape[names.index("embed")] % 8 == 0 for shape, names in table.values())
    assert set(MIXTRAL_ABSMAX_SPLIT) <= set(table)
    codes = n // 8
    blocks = {path: math.prod(shape) // 2048 for path, (shape, _) in table.items()}  # every tensor whole blocks
    absmax = 4 * sum(b // 8 if path in MIXTRAL_ABSMAX_SPLIT else b for path, b in blocks.items())
    assert int8 == 2 * (codes + absmax) == 11_753_535_504
    assert adam == 2 * 4 * n // 8 == 46_702_792_704
    assert int8 < adam


def _small_llama(**changes):
    """tiny-llama widened to 128 (4 heads of 32, 2 K/V heads, SwiGLU 256), float32, unrolled, no remat,
    16 x 64 tokens in one minibatch: small enough to compile in seconds, the terms still apart."""
    config = load_config("bf16_noscan", "tiny-llama")
    config.model.update(dtype="float32", hidden_size=128, head_dim=32, max_seq_len=64, num_kv_heads=2)
    config.model.update({"mlp_hidden_size": 256, **changes})
    config.data.update(seq_len=64, batch_size=16)
    config.train.num_minibatches = 1
    return config


def test_llama_gqa_term_equals_the_compiled_plans_difference():
    """Grouped-query attention's K/V width, against the float32 CPU plan: going from 2 to 4 K/V heads costs
    the plan exactly what the estimate adds (the k and v activations and their weights' state)."""
    peaks = {}
    for kv_heads in (2, 4):
        config = _small_llama(num_kv_heads=kv_heads)
        compiled, *_ = run.compile_step(config)
        peaks[kv_heads] = (memory.compiled_memory(compiled)["compiled_peak_bytes"], memory.analytic_memory(config))
    (plan_2, analytic_2), (plan_4, analytic_4) = peaks[2], peaks[4]
    added = analytic_4["analytic_peak_bytes"] - analytic_2["analytic_peak_bytes"]
    assert added > 0 and plan_4 - plan_2 == added


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
def test_small_llama_estimate_and_its_swiglu_term_against_the_a5000_plan():
    """The fast counterpart of the llama3.2-1b test: at a small size the estimate is within the documented
    8% of XLA's deviceless A5000 plan (Triton GEMMs), and doubling SwiGLU's width adds what the plan adds
    within 5% (measured: estimate / plan 1.06 and 1.05; the width's cost 1.4% apart)."""
    rows = {}
    for width in (256, 512):
        config = _small_llama(mlp_hidden_size=width)
        plan = gpu_plan.plan_for_target(config, "a5000", gemm="triton", in_process=True)["compiled_peak_bytes"]
        rows[width] = (plan, memory.analytic_memory(config)["analytic_peak_bytes"])
    for width, (plan, analytic) in rows.items():
        assert analytic == pytest.approx(plan, rel=0.08), width
    added = rows[512][1] - rows[256][1]
    assert added == pytest.approx(rows[512][0] - rows[256][0], rel=0.05)


@pytest.mark.slow
@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
@pytest.mark.parametrize("name", ["bf16_remat", "bf16_remat_block"])
def test_llama_1b_estimate_against_the_a5000_plan(name, tmp_path):
    """llama3.2-1b at full size (Adafactor, so it fits), 4 x 2048 tokens: the estimate within the 8% that
    docs/models.md claims of XLA's plan (both GEMM modes; ~1 min per compile on 2 shared cores)."""
    config = load_config(name, "llama3.2-1b")
    config.data.batch_size = 4
    config.optimizer.name = "adafactor"
    row = run.run(config, tmp_path, name, plan_only=True, progress=False, target="a5000")
    assert row["status"] == "ok", row["error"]
    assert row["compiled_to_analytic_peak_ratio"] == pytest.approx(1.0, rel=0.08)


def _tiny_dims(family: str, attention: str = "reference") -> Dims:
    """b=2 sequences of s=4 tokens, h=8 (2 heads), f=32, bf16 activations: s·b·h = 64 elements, s·b·f = 256;
    gpt's K/V width 8, llama's 4 (s·b·k = 32)."""
    k = 8 if family == "gpt" else 4
    return Dims(b=2, s=4, h=8, a=2, k=k, f=32, v=16, p=2, q=4, mask=0, kernel_casts=False, attention=attention,
                family=family)  # fmt: skip


# Bytes each named policy keeps per layer (Attn, MLP, Block), counted by hand from the tensors it saves:
# gpt qkv 2·(64 + 2·64) = 384, llama q, k, v 2·(64 + 2·32) = 256, q and v 2·(64 + 32) = 192; the attention
# output 2·64 = 128 (+ flash's float32 log-sum-exp 4·a·s·b = 64); the out projection's 128 and the down projection's
# 128 under Block only (each is its sub-block's output; tests/model/test_stack.py -k remat_policys finds minimal_flash's
# down in the compiled loop); gpt's up 2·256 = 512, llama's gate and up 1024, one of them 512; nothing for what goes to
# host memory.
NAMED_POLICY_BYTES = [
    ("gpt", "reference", "save_out_proj", (0, 0, 128)),
    ("gpt", "reference", "save_dot_with_context_except_mlp", (384 + 128, 0, 384 + 128 + 128)),
    ("gpt", "reference", "minimal_flash", (384 + 128, 512, 384 + 128 + 512 + 128 + 128)),
    ("gpt", "reference", "selective_op", (384 + 128, 512, 384 + 128 + 512)),
    ("gpt", "reference", "qkv_proj_offloaded", (0, 0, 0)),
    ("llama", "flash", "minimal_flash", (256 + 128 + 64, 1024, 256 + 128 + 64 + 1024 + 128 + 128)),
    ("llama", "reference", "selective_op", (192 + 128, 512, 192 + 128 + 512 + 128)),
    ("llama", "reference", "save_dot_with_context_except_mlp", (256 + 128, 0, 256 + 128 + 128)),
]


@pytest.mark.parametrize("family, attention, policy, expected", NAMED_POLICY_BYTES)
def test_named_policies_keep_the_bytes_of_the_tensors_they_save(family, attention, policy, expected):
    saved = layer_memory._policy_saved(_tiny_dims(family, attention), policy)
    assert (saved["Attn"], saved["MLP"], saved["Block"]) == expected


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fused_kernels_keep_no_attention_matrix_and_a_chunked_loss_one_chunk_of_logits(family):
    """Hand counts at the tiny dims above (a=2 heads, s=4, b=2: as²b = 64 logits; s·b·h = 64): the reference
    keeps float32 exp and bf16 weights of the T x T matrices (4·64 + 2·64 = 384 bytes); chunked and flash keep
    none of them and a float32 log-sum-exp per row and head (4·a·s·b = 64) plus q, k, v like cuDNN's;
    dots_saveable keeps the kernels' output and log-sum-exp (128 + 64) where the reference keeps its logits
    and AV output (4·64 + 128). A chunked loss of C=2 positions keeps 2p·b·C·v = 2·2·2·2·16 = 256 bytes of
    logits instead of 2p·b·s·v = 512."""
    attn = layer_memory.residual_functions(family)[0]
    reference = attn(_tiny_dims(family), False)
    assert reference["softmax_exp"] + reference["softmax_weights"] == 4 * 64 + 2 * 64
    for kernel in ("chunked", "flash"):
        kept = attn(_tiny_dims(family, kernel), False)
        assert "softmax_exp" not in kept and kept["logsumexp"] == 4 * 2 * 4 * 2
        assert kept == attn(_tiny_dims(family, "cudnn"), False)
        saved = layer_memory._policy_saved(_tiny_dims(family, kernel), "dots_saveable")
        projections = layer_memory._policy_saved(_tiny_dims(family, kernel), "dots_with_no_batch_dims_saveable")
        assert saved["Attn"] - projections["Attn"] == 128 + 64
    saved = layer_memory._policy_saved(_tiny_dims(family), "dots_saveable")
    projections = layer_memory._policy_saved(_tiny_dims(family), "dots_with_no_batch_dims_saveable")
    assert saved["Attn"] - projections["Attn"] == 4 * 64 + 128
    whole = layer_memory.head_residuals(_tiny_dims(family), causal_mask=False)["logits"]
    chunked = layer_memory.head_residuals(dataclasses.replace(_tiny_dims(family), c=2), causal_mask=False)["logits"]
    assert (whole, chunked) == (512, 256)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["save_qkv_proj", "save_dot_with_context_except_mlp"])
def test_policy_bytes_against_the_compiled_plan(policy):
    """gpt, float32, scanned Block remat on this machine's compiler: the plan's peak grows over nothing_saveable's
    by the analytic estimate's growth for the policies keeping the attention's tensors, within 64 bytes, one buffer's
    alignment on XLA's CPU (measured: equal with each minibatch's gradient added after the backward pass; 64 bytes
    over in both cases with the layers' gradients added into the accumulator inside it, train.grad_accumulation's
    default here; for the policies that keep MLP tensors the CPU plan's peak moves elsewhere and the two differ)."""
    peaks = {}
    for name in ("nothing_saveable", policy):
        config = load_config("bf16_remat_block")
        config.model.update(dtype="float32", hidden_size=128, head_dim=32, max_seq_len=64, remat_policy=name)
        config.model.dropout_rate = 0.0
        config.data.update(seq_len=64, batch_size=16)
        compiled, *_ = run.compile_step(config)
        compiled_peak = memory.compiled_memory(compiled)["compiled_peak_bytes"]
        peaks[name] = (compiled_peak, memory.analytic_memory(config)["analytic_peak_bytes"])
    (compiled_0, analytic_0), (compiled_1, analytic_1) = peaks["nothing_saveable"], peaks[policy]
    assert abs((compiled_1 - compiled_0) - (analytic_1 - analytic_0)) <= 64 and analytic_1 > analytic_0


def test_the_host_allocator_is_the_malloc_library_mapped_into_the_process():
    glibc = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n7f20-7f30 rw-p 0 0:0 0 [heap]\n"
    preloaded = glibc + "7f40-7f50 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
    assert memory.host_allocator(glibc) == "glibc"
    assert memory.host_allocator(preloaded) == "tcmalloc"
    assert memory.host_allocator(glibc + "7f60 r-xp 0 0:0 3 /opt/lib/libjemalloc.so.2\n") == "jemalloc"
    # A path that only mentions a name is not the library.
    assert memory.host_allocator(glibc + "7f70 r--p 0 0:0 4 /home/tcmalloc/notes.txt\n") == "glibc"


TCMALLOC = pathlib.Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@pytest.mark.skipif(not TCMALLOC.exists() or not pathlib.Path("/proc/self/maps").exists(),
                    reason="needs Linux and tcmalloc (apt install libgoogle-perftools4)")  # fmt: skip
def test_a_process_started_with_tcmalloc_preloaded_says_so():
    code = "from jaxscale.measure import memory; print(memory.host_allocator())"
    env = {**os.environ, "LD_PRELOAD": str(TCMALLOC)}
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})  # fmt: skip
    assert (said.stdout.split()[-1], plain.stdout.split()[-1]) == ("tcmalloc", "glibc")


def test_docs_allocator_table_holds_the_committed_sweeps():
    """docs/measurements.md, 'The CPU's allocator': the seven variants' medians with glibc (sweeps A, B, C) and
    tcmalloc (D, E, F, G) and the median change, redone by hand against the table docs_tables writes from the
    committed rows (tests/report/test_docs_tables.py holds the doc to it); the 64- over 16-sequence ratios."""
    results = REPO / "experiments" / "results"

    def steps(name: str) -> dict[str, float]:
        lines = (results / name / "results.jsonl").read_text().splitlines()
        return {r["variant"]: r["step_s_median"] for r in map(json.loads, lines)}

    glibc = [steps(f"seed_table_cpu_{n}") for n in ("calibrate_a", "calibrate_b", "calibrated_bf16_remat_batch64")]
    tcmalloc = [steps(f"seed_table_cpu_{n}") for n in ("tcmalloc_d", "tcmalloc_e", "tcmalloc_f",
                                                      "calibrated_bf16_scan_remat_mlp_attn")]  # fmt: skip
    (written,) = [docs_tables.render(table) for table in docs_tables.TABLES if table.name == "cpu-allocator"]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in written.splitlines()[2:]]
    assert [row[0] for row in table] == list(glibc[0])
    for variant, old, new, change in table:
        g, t = [m[variant] for m in glibc], [m[variant] for m in tcmalloc]
        assert old == " / ".join(f"{x:.3f}" for x in g) and new == " / ".join(f"{x:.3f}" for x in t)
        assert change == f"{statistics.median(t) / statistics.median(g) - 1:+.0%}"
        assert statistics.median(t) < statistics.median(g)  # "Every variant is faster"
    changes = [1 - statistics.median([m[v] for m in tcmalloc]) / statistics.median([m[v] for m in glibc])
               for v in glibc[0]]  # fmt: skip
    predict_md = " ".join((REPO / "docs" / "predict.md").read_text().split())
    assert f"steps {min(changes):.0%}-{max(changes):.0%} shorter with tcmalloc".replace("%-", "-") in predict_md
    text = " ".join((REPO / "docs" / "measurements.md").read_text().split())
    ratio = [m["bf16_remat_batch64"] / m["bf16_remat_1minibatch"] for m in (glibc[0], tcmalloc[0])]
    assert (f"With glibc the 64-sequence step took {ratio[0]:.1f}x the 16-sequence one (`bf16_remat_1minibatch`) "
            f"for 4x the tokens (sweep A); with tcmalloc {ratio[1]:.1f}x (sweep D)") in text  # fmt: skip


@pytest.mark.parametrize("preset,elements", [("llama3.1-8b", 17), ("gpt2", 16)])
def test_closed_form_is_what_the_backward_reads_by_hand(preset, elements):
    """docs/measurements.md's closed form per token per layer: Llama 3.1 8B 17h elements (the attention's input and
    norm output 2h, q h, k and v h/4 each, its output h; the MLP's input and norm output 2h, gate, up and the down
    input 3 x 3.5h), the GPT at the same width 16h (q, k, v 3h, up and the down input 2 x 4h), 2 bytes each, plus a
    float32 log-sum-exp a head (32 heads)."""
    config = load_config("bf16_remat", preset)
    config.model.update(hidden_size=4096, head_dim=128, attention="flash", remat=())
    config.data.update(batch_size=1, seq_len=1024)
    config.train.num_minibatches = 1
    per_token = memory.analytic_memory(config)["analytic_closed_form_per_layer_bytes"] / 1024
    assert per_token == 2 * elements * 4096 + 4 * 32


def test_a_pipelines_activations_follow_its_loop_and_its_relayout_within_a_quarter_of_the_compiled_plans():
    """With a pipeline a stage keeps its L/p layers' residuals of one microbatch in each of the loop's m + p - 1
    iterations (and runs the head on 1/p of the positions): the analytic peak of each GPipe plan of Llama 3.1 8B on 8
    H100s (experiments/pipeline.py, 4 stages x tensor 2, 1 to 16 microbatches, the committed rows' compiled peaks)
    is within 25% of the plan (counted as a minibatch through every layer, as before the pipeline term, it was up
    to 1.93x the plan at 16 microbatches)."""
    from jaxscale.sweep.sweep_file import load_sweep

    root = pathlib.Path(__file__).resolve().parents[2]
    name = "pipeline_llama3.1-8b_plan_h100_cublas_x8"
    rows = {}
    for line in (root / "experiments/results" / name / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["variant"]] = row
    sweep = load_sweep(f"{root}/experiments/pipeline.py:llama3.1-8b")
    # GPipe within a quarter; the circular schedule (2 and 4 visits), which holds the stack's weights in the
    # stage-major layout and their gradients in it too (2 x 4 bytes a parameter of the device's share of the stack),
    # within 10%: 0.98 and 0.93 of the plans with that term, 0.81 and 0.77 without it.
    for prefix, count, (low, high) in (("pp4_tp2_m", 5, (0.8, 1.25)), ("pp4v", 2, (0.9, 1.1))):
        variants = [v for v in sweep.variants if v.name.startswith(prefix)]
        assert len(variants) == count
        for variant in variants:
            analytic = memory.analytic_memory(variant.config)["analytic_peak_bytes"]
            ratio = analytic / rows[variant.name]["compiled_peak_bytes"]
            assert low < ratio < high, (variant.name, ratio)

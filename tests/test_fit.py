"""`python -m jaxscale.fit`: the table and recommendation, rows with the sweep's conventions, resuming from
finished rows and probes, a budget nothing meets, --measure, and one-line errors."""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import CONFIGS

from jaxscale import fit as fit_cli
from jaxscale.plan import gpu_plan
from jaxscale.sweep import load_results
from jaxscale.sweep.results import ResultsFile

TINY = f"{CONFIGS}/bf16_remat.py:tiny"
REPO = pathlib.Path(__file__).resolve().parents[1]
needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
# The local plans these tests search compile once a test process (conftest's local_plans_once): several tests ask
# for the same minibatches of the same configs; each still searches, records and reuses its probes as it did.
pytestmark = pytest.mark.usefixtures("local_plans_once")


def _fit(tmp_path, *args: str) -> int:
    """fit on the tiny config; the levers tried when nothing fits (a compile each) are tests/plan/test_fit_levers.py's
    to check, so they are skipped here."""
    return fit_cli.main(["fit", "--config", TINY, "--output_root", str(tmp_path), "--remat", "block",
                         "--nowhat_would_fit", *args])  # fmt: skip


def _rows(tmp_path, name="fit_bf16_remat_tiny_cpu", sub=""):
    path = tmp_path / "experiments" / "results" / name / sub / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fit_finds_the_edge_records_a_row_and_resumes(tmp_path, capsys):
    # 3.5 MiB: the search grows to the analytic guess (9, too big) and bisects (4 too big, 2 and 3 fit): 4 compiles,
    # where 4 MiB took 5 to find 4 (13, 6, 3, 4, 5) on this CPU; an edge found by bisection either way
    assert _fit(tmp_path, "--memory", "3.5MiB", "--max_minibatch", "16") == 0
    out = capsys.readouterr().out
    assert "a CPU plan is only a proxy" in out and "recommendation: Block at minibatch" in out
    (row,) = _rows(tmp_path)
    largest = row["fit_largest_minibatch"]
    assert row["status"] == "ok" and row["variant"] == "block" and row["sweep"] == "fit_bf16_remat_tiny_cpu"
    assert row["compiled_peak_bytes"] <= 3.5 * 2**20 and row["config.data.batch_size"] == 2 * largest
    assert row["tokens_per_step"] == 2 * largest * 32 and row["compiled_to_analytic_peak_ratio"] > 0
    probes = {p[0]: (p[1], p[2]) for p in row["fit_probes"]}
    assert probes[largest][1] is True
    assert largest == 16 or probes[largest + 1][1] is False  # the edge: the next minibatch was compiled, too big
    frame = load_results(tmp_path / "experiments" / "results" / "fit_bf16_remat_tiny_cpu")  # the sweep's reader
    assert list(frame["variant"]) == ["block"] and list(frame["status"]) == ["ok"]
    # the same question again: answered from the row, nothing compiled
    assert _fit(tmp_path, "--memory", "3.5MiB", "--max_minibatch", "16") == 0
    assert "block: already answered" in capsys.readouterr().out
    # a fit killed after its probes but before its row: the rerun reuses every probe
    (tmp_path / "experiments" / "results" / "fit_bf16_remat_tiny_cpu" / "results.jsonl").unlink()
    assert _fit(tmp_path, "--memory", "3.5MiB", "--max_minibatch", "16") == 0
    (again,) = _rows(tmp_path)
    assert again["fit_largest_minibatch"] == largest and again["fit_probes_reused"] == again["fit_compiles"]


def test_rerun_compiles_every_probe_again(tmp_path):
    """--rerun (fresh) reads none of the kept plans: a kept plan names the config and the target, not the lab's
    program that compiled it; without it the plans of the same question are reused."""
    store = ResultsFile(tmp_path / "probes")
    store.directory.mkdir(parents=True)
    store.record({"variant": "block@4", "status": "ok", "plan": {}, "error": None, "seconds": 1.0,
                  "fit_plan_question": "q"})  # fmt: skip
    assert set(fit_cli.ProbeCache(store, "q").known) == {"block@4"}
    assert fit_cli.ProbeCache(store, "q", fresh=True).known == {}
    assert fit_cli.ProbeCache(store, "another question").known == {}


def test_a_budget_no_minibatch_meets_is_an_oom_row_naming_the_smallest_plan(tmp_path, capsys):
    assert _fit(tmp_path, "--memory", "100KiB") == 0
    out = capsys.readouterr().out
    assert "none (oom)" in out and "recommendation: none" in out
    (row,) = _rows(tmp_path)
    assert row["status"] == "oom" and row["fit_largest_minibatch"] is None
    assert "smallest plan (minibatch 1)" in row["error"] and row["config.data.batch_size"] == 2


def test_measure_runs_the_largest_batch_and_recommends_by_measured_speed(tmp_path, capsys):
    args = ["--memory", "4MiB", "--max_minibatch", "2", "--measure", "--remat", "block", "--train_tokens", "1e9"]
    assert _fit(tmp_path, *args, "--gpu_hour_usd", "3") == 0
    out = capsys.readouterr().out
    assert "fastest measured" in out
    (row,) = _rows(tmp_path)
    assert row["measure_status"] == "ok" and row["tokens_per_s"] > 0 and row["step_s_median"] > 0
    assert row["config.data.batch_size"] == 2 * row["fit_largest_minibatch"]  # it ran the planned batch
    # the training's cost at the measured speed, on the one device it ran on, kept in the row and printed
    hours = 1e9 / row["tokens_per_s"] / 3600
    assert row["cost_basis"] == "measured tokens/s" and row["cost_devices"] == 1
    assert row["cost_device_hours"] == pytest.approx(hours) and row["cost_usd"] == pytest.approx(3 * hours)
    assert f"Block: training cost of 1e+09 tokens: {hours:,.0f} device-hours" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--remat", "everything"], "--remat: unknown everything; allowed: none, mlp_attn, block"),
        ([], "--memory: required without --target on the cpu backend"),
        (["--memory", "4MiB", "--headroom", "1.5"], "--headroom: must be in [0, 1)"),
        (["--memory", "lots"], "--memory: 'lots' is not a positive memory size"),
        (["--memory", "4MiB", "--devices", "8"], "--devices / mesh 1x1x1: the fit planner plans a mesh for a GPU"),
        (["--memory", "4MiB", "--config.mesh.fsdp=2"], "add --target (e.g. --target h100 --devices 8)"),
        (["--memory", "4MiB", "--config.model.scan_layers=True", "--config.model.dropout_rate=0.0",
          "--config.mesh.stage=2"], "--devices / mesh 1x1x1x1x1x2: the fit planner plans a mesh for a GPU target"),
        (["--memory", "4MiB", "--rank", "predicted"], "--rank predicted: needs --target"),
        (["--memory", "4MiB", "--mem_fraction", "0.9"], "--mem_fraction: sets the share of a --target's memory"),
        (["--memory", "4MiB", "--gpu_hour_usd", "2"], "--gpu_hour_usd: prices a whole training; add --train_tokens"),
        (["--memory", "4MiB", "--finetune", "lora,full"], "--finetune: unknown lora; allowed: full, full_bf16_state"),
        (["--memory", "4MiB", "--precision", "fp4"], "--precision: unknown fp4; allowed: bf16, fp8"),
        (["--memory", "4MiB", "--remat", "per_activation:bogus=device"],
         "--remat: unknown per_activation:bogus=device; allowed: "),
        (
            ["--memory", "4MiB", "--finetune", "lora_all", "--config.model.lora_rank=100"],
            "model.lora_rank: 100 exceeds the qkv projection's 64 x 192",
        ),
    ],
)
def test_bad_input_is_one_line_with_exit_2(tmp_path, capsys, args, message):
    code = fit_cli.main(["fit", "--config", TINY, "--output_root", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("jaxscale: error: ") and message in err and err.count("\n") == 1


def test_fine_tuning_methods_are_searched_and_recommended_one_by_one(tmp_path, capsys):
    """--finetune: a row per method and remat choice, a recommendation per method; LoRA's frozen weights (bf16,
    no gradient, no Adam state) leave room for a larger minibatch than full fine-tuning's in the same budget: in 2.75
    MiB full fits 1 and LoRA 2, the limit (3 compiles; the search's edge is test_fit_finds_the_edge_records_a_row_and_
    resumes's to check). Measured, the local plans at minibatch 1 and 2: full 2.58 and 2.92 MiB, LoRA 1.84 and 2.20."""
    assert _fit(tmp_path, "--memory", "2.75MiB", "--max_minibatch", "2", "--finetune", "full,lora_all") == 0
    out = capsys.readouterr().out
    assert "recommendation for full, Adam: Block at minibatch" in out
    assert "recommendation for LoRA on all projections: Block at minibatch" in out
    full, lora = _rows(tmp_path)
    assert (full["variant"], lora["variant"]) == ("full:block", "lora_all:block")
    # tiny gpt, rank 16 on every projection: 16 x (64 + 192 + 64 + 64 + 64 + 256 + 256 + 64) per block, 2 blocks
    assert full["trainable_params"] == full["params"] and lora["trainable_params"] == 2 * 16 * 1024
    assert lora["config.finetune.train"] == "adapters" and lora["config.model.lora_rank"] == 16
    assert lora["fit_largest_minibatch"] > full["fit_largest_minibatch"]
    assert _fit(tmp_path, "--memory", "2.75MiB", "--max_minibatch", "2", "--finetune", "full,lora_all") == 0
    assert "lora_all:block: already answered" in capsys.readouterr().out


def test_qlora_methods_are_planned_with_the_base_in_nf4(tmp_path, capsys):
    """--finetune lora_all,qlora_all: QLoRA trains LoRA's adapters, and its compiled arguments are LoRA's less the
    frozen kernels' bf16 bytes plus their NF4 bytes, by hand (tiny gpt, 2 scanned layers: kernels 64 x 192, 64 x 64
    and two 64 x 256, 98,304 weights, 196,608 bytes in bf16; in NF4 per layer 6,344 + 2,120 + 2 x 8,456 bytes,
    tests/model/test_nf4.py: 50,752 for two)."""
    assert _fit(tmp_path, "--memory", "3MiB", "--max_minibatch", "2", "--finetune", "lora_all,qlora_all") == 0
    assert "recommendation for QLoRA on all projections (NF4 base): Block at minibatch" in capsys.readouterr().out
    lora, qlora = _rows(tmp_path)
    assert qlora["variant"] == "qlora_all:block" and qlora["config.finetune.frozen_dtype"] == "nf4"
    assert (qlora["params"], qlora["trainable_params"]) == (lora["params"], lora["trainable_params"])
    assert lora["compiled_argument_bytes"] - qlora["compiled_argument_bytes"] == 196_608 - 50_752
    assert lora["analytic_params_bytes"] - qlora["analytic_params_bytes"] == 196_608 - 50_752


def test_precisions_are_searched_side_by_side_and_recommended_one_by_one(tmp_path, capsys):
    """--precision bf16,fp8: a row per precision and remat choice, each with its model.fp8, and an answer per
    precision; the local (CPU) compiler plans FP8's program too (its numbers in bf16: no FP8 units here). Minibatch 1
    only: one compile a precision (the search is test_fit_finds_the_edge_records_a_row_and_resumes's)."""
    assert _fit(tmp_path, "--memory", "3MiB", "--max_minibatch", "1", "--precision", "bf16,fp8") == 0
    out = capsys.readouterr().out
    assert "recommendation for bf16 matmuls: Block at minibatch" in out
    assert "recommendation for FP8 matmuls (dynamic tensorwise scaling): Block at minibatch" in out
    bf16, fp8 = _rows(tmp_path)
    assert (bf16["variant"], fp8["variant"]) == ("bf16:block", "fp8:block")
    assert (bf16["config.model.fp8"], fp8["config.model.fp8"]) == ("none", "dynamic")
    assert fp8["fit_precision"] == "fp8" and fp8["fit_largest_minibatch"] == 1


def test_an_unknown_remat_choice_lists_every_choice_with_the_named_policies(tmp_path, capsys):
    """The planner searches the named policies too: an unknown --remat names all of them, in the table's order."""
    code = fit_cli.main(["fit", "--config", TINY, "--output_root", str(tmp_path), "--remat", "block,everything"])
    err = capsys.readouterr().err
    expected = ["none", "mlp_attn", "block", "block_qkv_proj_offloaded", "block_save_out_proj",
                "block_save_qkv_proj", "block_selective_op", "block_save_dot_with_context_except_mlp",
                "block_dots_no_batch", "block_minimal_flash", "block_dots"]  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert err.strip().endswith("--remat: unknown everything; allowed: " + ", ".join(expected)
                                + ", or per_activation:<activation>=<device|offload|remat>+... (docs/fit.md), or "
                                "frontier alone")


@needs_extra
@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "a5000", "--measure"], "--measure: runs on this machine's device"),
        (["--target", "h100", "--devices", "8"], "1x1x1 plans 1 GPU(s), but --devices is 8"),
        (["--target", "a5000", "--mem_fraction", "0.99"], "--mem_fraction: 0.99 of target a5000's 23.99 GiB leaves"),
        (["--target", "a5000", "--memory", "23GiB"], "--memory 23 GiB: more than JAX's allocator can have"),
        (["--target", "a5000", "--precision", "bf16,fp8"], "model.fp8: 'dynamic' needs FP8 tensor cores"),
        (["--target", "bogus", "--precision", "fp8"], "--target: unknown 'bogus'; known: "),
    ],
)
def test_bad_target_input_is_one_line_with_exit_2(tmp_path, capsys, args, message):
    test_bad_input_is_one_line_with_exit_2(tmp_path, capsys, args, message)


@needs_extra
def test_fit_plans_a_mesh_on_several_target_gpus_per_device(tmp_path, capsys):
    """--target h100 --devices 2 with FSDP over 2: the minibatch, plan and budget are per device, the batch is
    the minibatch times the devices, and the recommendation ranks by predicted tokens/s (labelled)."""
    args = ["--target", "h100", "--devices", "2", "--config.mesh.fsdp=2", "--memory", "12MiB", "--gemm", "cublas"]
    assert _fit(tmp_path, *args, "--max_minibatch", "2", "--mem_fraction", "0.9") == 0
    out = capsys.readouterr().out
    assert "x2, mesh 1x2x1 (data x fsdp x tensor); per device" in out and "fastest predicted" in out
    # the answer names the allocator setting it was planned for, in the header and in the recommendation
    assert "to run as planned: set XLA_CLIENT_MEM_FRACTION=0.9 (" in out
    assert "run it with XLA_CLIENT_MEM_FRACTION=0.9 set" in out.splitlines()[-2]
    (row,) = _rows(tmp_path, "fit_bf16_remat_tiny_h100_x2")
    assert (row["fit_mem_fraction"], row["fit_context_reserve_bytes"]) == (0.9, 2**30)
    assert row["status"] == "ok" and row["fit_devices"] == 2 and row["plan_devices"] == 2
    assert row["config.data.batch_size"] == 2 * 2 * row["fit_largest_minibatch"]  # 2 minibatches x 2 devices
    assert row["compiled_peak_bytes"] <= 12 * 2**20 and row["predicted_tokens_per_s"] > 0


PIPELINE = ["--config.model.scan_layers=True", "--config.model.dropout_rate=0.0", "--config.mesh.stage=2",
            "--config.mesh.pipeline_microbatches=4", "--config.train.num_minibatches=1", "--target", "h100",
            "--devices", "2", "--gemm", "cublas", "--xla_limit", "ignore", "--remat", "block"]  # fmt: skip


def test_fit_plans_a_pipeline_on_target_gpus_at_a_multiple_of_its_microbatches(tmp_path, capsys):
    """A pipeline of 2 stages and 4 microbatches on 2 target GPUs, the search bounded at minibatch 10: the analytic
    start (44) is brought to the largest multiple of 4 within the bound, 8, which fits the 6 MiB budget (planned
    5.5 MiB), so one compile answers and the answer is complete (the bound fits)."""
    assert _fit(tmp_path, *PIPELINE, "--memory", "6MiB", "--max_minibatch", "10") == 0
    out = capsys.readouterr().out
    assert "x2, mesh 1x1x1x1x1x2 (data x fsdp x tensor x context x expert x stage); per device" in out
    (row,) = _rows(tmp_path, "fit_bf16_remat_tiny_h100_x2")
    assert row["status"] == "ok" and row["fit_probes"][0][0] == 8 and row["fit_compiles"] == 1
    assert row["fit_largest_minibatch"] == 8 and row["fit_search_complete"] and row["config.data.batch_size"] == 8
    assert row["analytic_largest_minibatch"] % 4 == 0 and row["compiled_peak_bytes"] <= 6 * 2**20
    assert row["compiled_peak_bytes"] > 2 * row["analytic_peak_bytes"]  # docs/fit.md: the analytic start is far off
    assert "recommendation: Block at minibatch 8:" in out


@pytest.mark.slow
def test_fit_searches_a_pipelines_minibatch_in_multiples_of_its_microbatches(tmp_path, capsys):
    """The same pipeline searched to its edge (5 compiles, ~40 s): every minibatch compiled is a multiple of 4, the
    answer's largest fits and the next multiple of 4 does not, and the recommendation names that minibatch."""
    assert _fit(tmp_path, *PIPELINE, "--memory", "6MiB", "--max_minibatch", "64") == 0
    out = capsys.readouterr().out
    (row,) = _rows(tmp_path, "fit_bf16_remat_tiny_h100_x2")
    largest = row["fit_largest_minibatch"]
    assert row["status"] == "ok" and row["fit_search_complete"] and largest % 4 == 0
    assert all(minibatch % 4 == 0 for minibatch, _, _ in row["fit_probes"])
    fits = {minibatch: fit for minibatch, _, fit in row["fit_probes"]}
    assert fits[largest] and fits[largest + 4] is False and row["fit_first_too_large_minibatch"] == largest + 4
    assert row["config.data.batch_size"] == largest and row["compiled_peak_bytes"] <= 6 * 2**20
    assert f"recommendation: Block at minibatch {largest}:" in out


def test_a_partial_plan_is_reused_only_to_say_it_does_not_fit(tmp_path):
    """A probe whose Triton plan was skipped (its cuBLAS plan already failed the budget of its fit) is kept; a
    later fit with a budget it would fit compiles both GEMM modes instead of trusting the cuBLAS half."""
    from jaxscale.config import base_config
    from jaxscale.sweep.results import ResultsFile

    compiled: list[bool] = []  # whether each compile was partial

    def planner(budget):
        def plan(config):
            partial = 100 > budget  # the cuBLAS plan (peak 100) does not fit: Triton skipped
            compiled.append(partial)
            return {"compiled_peak_bytes": 100, "plan_fits": True, "plan_gemm_partial": partial}

        return plan

    config = base_config("tiny", "fit")
    cache = fit_cli.ProbeCache(ResultsFile(tmp_path / "probes"), "q")
    assert not cache.measure(planner(50), config, "block", 50, 2).fits  # partial: does not fit 50
    assert not cache.measure(planner(50), config, "block", 80, 2).fits and compiled == [True]  # reused
    assert cache.measure(planner(200), config, "block", 200, 2).fits and compiled == [True, False]  # recompiled
    assert cache.measure(planner(200), config, "block", 200, 2).fits and compiled == [True, False]  # whole: reused
    assert cache.reused == 2


def test_the_probes_of_two_questions_in_one_store_are_both_kept(tmp_path):
    """Two --finetune methods of one fit share its probes directory: the same choice at the same minibatch of each is
    kept apart (a store keeps one row per variant: untagged, the second had replaced the first), and each question
    reuses its own."""
    from jaxscale.config import base_config

    store = ResultsFile(tmp_path / "probes")
    config = base_config("tiny", "fit")
    plans = {"q1": 100, "q2": 200}
    for question, peak in plans.items():
        cache = fit_cli.ProbeCache(store, question)
        cache.measure(lambda c, peak=peak: {"compiled_peak_bytes": peak, "plan_fits": True}, config, "block", 500, 1)
    assert len(store.rows()) == 2
    for question, peak in plans.items():
        (entry,) = fit_cli.ProbeCache(store, question).known.values()
        assert entry["plan"]["compiled_peak_bytes"] == peak


def test_numpy_numbers_in_a_row_are_recorded_as_numbers_and_tabulated():
    """A count computed with NumPy integers (Adafactor's sharded state) once reached the row as text and the
    table's GiB column raised TypeError; it is recorded as the number."""
    import numpy as np

    row = json.loads(json.dumps({"analytic_peak_bytes": np.int64(3 * 2**30)}, default=fit_cli._plain))
    assert row["analytic_peak_bytes"] == 3 * 2**30
    table = fit_cli.format_table([{**row, "fit_remat": "Block", "fit_largest_minibatch": None, "status": "oom"}])
    assert "none (oom)" in table and " 3 " in table


def test_the_committed_llama8b_flash_fit_holds_what_docs_models_says():
    """docs/models.md, llama3.1-8b on 8 H100s with flash (its tables are the rows, tests/report/test_docs_tables.py):
    the recommendation (the fastest prediction, a tie, the roomiest named) recomputed from the committed rows, and
    the cuBLAS and Triton plans agreeing to a few kilobytes."""
    from jaxscale.plan import fit_recommend

    path = CONFIGS.parent / "experiments" / "results" / "fit_bf16_remat_llama3.1-8b_flash_h100_x8" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    best, why = fit_recommend.recommend(rows, rank="predicted")
    assert best["variant"] == "block_minimal_flash" and "but a tie" in why
    assert "the tied choice leaving the most is Block, selective_op" in why
    block = next(row for row in rows if row["variant"] == "block")
    assert block["compiled_cublas_peak_bytes"] == pytest.approx(block["compiled_triton_peak_bytes"], abs=2**14)


_GIB = 2**30
_FINETUNE_GPUS = ("rtx4090", "l4", "a100-40gb")
_FINETUNE_METHODS = ("full", "full_bf16_state", "full_adafactor", "full_int8_state", "lora_attention", "lora_all")


def _finetune_rows(gpu: str, suffix: str) -> dict[str, list[dict]]:
    rows = _rows(REPO, f"finetune_llama3.1-8b_{gpu}{suffix}")
    methods: dict[str, list[dict]] = {}
    for row in rows:
        methods.setdefault(row["fit_finetune"], []).append(row)
    return methods


def test_the_committed_finetune_fits_hold_what_docs_finetune_says():
    """docs/finetune.md's answer for llama3.1-8b on three GPUs, recomputed from the committed fit rows: each full
    method's smallest plan and its factor over both budgets, each LoRA method's fastest predicted fitting choice."""
    doc = (REPO / "docs" / "finetune.md").read_text()
    for gpu in _FINETUNE_GPUS:
        default, raised = _finetune_rows(gpu, ""), _finetune_rows(gpu, "_mem95")
        assert set(default) == set(raised) == set(_FINETUNE_METHODS)  # docs/finetune.md's command's --finetune
        for method in ("full", "full_bf16_state", "full_adafactor", "full_int8_state"):
            assert all(r["status"] == "oom" for r in default[method] + raised[method]), (gpu, method)
            least = [min(rows, key=lambda r: r["compiled_peak_bytes"]) for rows in (default[method], raised[method])]
            ratios = [r["compiled_peak_bytes"] / r["fit_budget_bytes"] for r in least]
            assert f"{least[0]['compiled_peak_bytes'] / _GIB:.1f} GiB: {ratios[0]:.2f}x / {ratios[1]:.2f}x" in doc
        for method in ("lora_attention", "lora_all"):
            for rows in (default[method], raised[method]):
                best = max((r for r in rows if r["status"] == "ok"), key=lambda r: r["predicted_tokens_per_s"])
                peak, tokens = best["compiled_peak_bytes"] / _GIB, best["predicted_tokens_per_s"]
                where = f"{best['fit_remat']}, minibatch {best['fit_largest_minibatch']}"
                cell = f"{where}: {peak:.1f} GiB, {tokens:,.0f} tokens/s"
                assert cell in doc, (gpu, method, cell)


def test_the_torchtune_lora_plan_holds_what_docs_finetune_says():
    """The plan of torchtune's published RTX 4090 LoRA setup: the counts PEFT prints for it, and the ratios to
    torchtune's measured 16.2 GiB and 3,083 tokens/s as docs/finetune.md gives them."""
    path = REPO / "experiments" / "results" / "finetune_published" / "torchtune_lora_llama3.1-8b_rtx4090.json"
    row, doc = json.loads(path.read_text()), (REPO / "docs" / "finetune.md").read_text()
    assert (row["trainable_params"], row["params"]) == (3_407_872, 8_033_669_120)
    assert row["config.model.lora_targets"] == ["q", "v"] and row["config.data.batch_size"] == 2
    peak, tokens = row["compiled_peak_bytes"] / _GIB, row["predicted_tokens_per_s"]
    plan = f"{peak:.2f} GiB (XLA's plan, cuBLAS GEMMs)"
    assert f"| peak memory | {plan} | 16.2 GiB (PyTorch's peak) | {peak / 16.2:.2f} |" in doc
    assert f"| tokens/s | {tokens:,.0f} (predicted) | 3,083 | {tokens / 3083:.2f} |" in doc
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"planned at {peak / 16.2:.2f}x its measured peak" in readme


def test_the_readme_summary_of_the_rtx4090_answer_is_the_rows():
    """README's one line on the RTX 4090: the full methods' factors over both budgets and LoRA's largest
    minibatches, from the committed rows."""
    readme = " ".join((REPO / "README.md").read_text().split())
    factors, lora = [], []
    for suffix in ("", "_mem95"):
        for method, rows in _finetune_rows("rtx4090", suffix).items():
            if method.startswith("full"):
                factors.append(min(r["compiled_peak_bytes"] for r in rows) / rows[0]["fit_budget_bytes"])
            else:
                lora.append(max(r["fit_largest_minibatch"] or 0 for r in rows))
    assert f"{min(factors):.1f} to {max(factors):.1f} times over the budget" in readme
    assert f"LoRA fits {min(lora)} to {max(lora)} sequences of 2048 tokens" in readme


def test_the_committed_cpu_finetune_sweep_holds_what_docs_finetune_says():
    """docs/finetune.md's CPU table and its reading, recomputed from the committed rows: every method starts from
    the same loaded model and lowers the validation loss on code; the shares of full fine-tuning's drop."""
    path = REPO / "experiments" / "results" / "finetune_cpu-llama" / "results.jsonl"
    rows = {row["variant"]: row for row in (json.loads(line) for line in path.read_text().splitlines())}
    doc, mib = (REPO / "docs" / "finetune.md").read_text(), 2**20
    full = rows["full"]["validation_loss_all"]
    for name in ("full", "full_bf16_state", "lora_attention", "lora_all", "last_block"):
        row = rows[name]
        losses = row["validation_loss_all"]
        assert row["validation_steps"] == [0, 50, 100] and losses[-1] < losses[0] - 0.25, name
        assert abs(losses[0] - full[0]) < 1e-3  # the loaded model, whatever trains next
        assert ", ".join(f"{x:.4f}" for x in losses) in doc, name
        assert f"{row['trainable_params']:,} / {row['params']:,}" in doc
        parts = [row[f"analytic_{k}_bytes"] / mib for k in ("params", "grads", "optimizer", "activation")]
        peak = row["compiled_peak_bytes"] / mib
        assert f"{parts[0]:.2f} + {parts[1]:.2f} + {parts[2]:.2f}, {parts[3]:.2f} | {peak:.1f}" in doc
    drop = full[0] - full[-1]
    for name, share in (("lora_all", 64), ("lora_attention", 49), ("last_block", 81)):
        losses = rows[name]["validation_loss_all"]
        assert round(100 * (losses[0] - losses[-1]) / drop) == share


def test_the_committed_llama1b_flash_fits_hold_what_docs_models_says():
    """docs/models.md, llama3.2-1b with flash attention on an A5000 and an L4 (its table is the rows,
    tests/report/test_docs_tables.py): each choice's largest minibatch is an edge (the next one was planned and
    refused), and Adam's smallest plan, recomputed from the committed fit rows."""

    def rows(name: str) -> dict[str, dict]:
        return {r["variant"]: r for r in _rows(REPO, name)}

    for gpu in ("a5000", "l4"):
        for r in rows(f"fit_bf16_remat_llama3.2-1b_adafactor_flash_{gpu}").values():
            assert r["status"] == "ok" and r["fit_search_complete"]
            # the next minibatch was planned and refused: above the budget, or by XLA's own limit (no bytes)
            refused = [p for p in r["fit_probes"] if p[0] == r["fit_largest_minibatch"] + 1]
            assert refused and refused[0][2] is False
    for gpu in ("a5000", "l4"):  # docs/models.md: Adam's smallest flash plan is below the reference's, above budget
        adam = rows(f"fit_bf16_remat_llama3.2-1b_flash_{gpu}")
        reference = rows(f"fit_bf16_remat_llama3.2-1b_{gpu}")
        assert all(r["status"] == "oom" for r in adam.values())
        assert adam["block"]["compiled_peak_bytes"] < reference["block"]["compiled_peak_bytes"]
        assert adam["block"]["compiled_peak_bytes"] > adam["block"]["fit_budget_bytes"]


def test_the_committed_gpt2_flash_fit_holds_what_docs_models_says():
    """docs/models.md, gpt2 on an RTX 4090 with flash attention (its table is the rows,
    tests/report/test_docs_tables.py): with remat the plans equal the reference attention's within 1 KiB at every
    minibatch both compiled, and the recommendation the doc names."""
    from jaxscale.plan import fit_recommend

    def probes(name: str) -> dict[str, int]:
        return {r["variant"]: r["plan"]["compiled_peak_bytes"] for r in _rows(REPO, name, "probes") if r["plan"]}

    best, why = fit_recommend.recommend(_rows(REPO, "fit_bf16_remat_gpt2_flash_rtx4090"), rank="predicted")
    assert best["variant"] == "block_minimal_flash" and "but a tie" in why
    assert "the tied choice leaving the most is Block, qkv_proj_offloaded" in why
    a, b = probes("fit_bf16_remat_gpt2_rtx4090"), probes("fit_bf16_remat_gpt2_flash_rtx4090")
    remat = [k for k in set(a) & set(b) if not k.startswith("none@")]
    assert len(remat) == 15 and all(a[k] - b[k] == 1024 for k in remat)
    doc = " ".join((REPO / "docs" / "models.md").read_text().split())
    assert (
        f"minibatches with remat that both searches compiled, the flash plan is {a[remat[0]] - b[remat[0]]:,} bytes"
        in doc
    )
    assert f"(MLP+Attn at 41: a {b['mlp_attn@41'] / 2**30:.2f} GiB plan, refused)" in doc


def test_the_committed_gpt2_chunked_loss_fit_holds_what_docs_models_says():
    """docs/models.md, gpt2 on an RTX 4090 with flash and the loss in chunks (its table is the rows,
    tests/report/test_docs_tables.py): a search cut short stopped at --max_compiles' default, the factors over the
    whole-logits fit, and its best prediction below the whole logits' best, from the rows."""
    chunked = {r["variant"]: r for r in _rows(REPO, "fit_bf16_remat_gpt2_flash_chunked_loss_rtx4090")}
    whole = {r["variant"]: r for r in _rows(REPO, "fit_bf16_remat_gpt2_flash_rtx4090")}
    assert all(r["config.train.loss_chunk_len"] == 128 and r["status"] == "ok" for r in chunked.values())
    assert all(r["fit_compiles"] == 12 for r in chunked.values() if not r["fit_search_complete"])
    factors = [chunked[v]["fit_largest_minibatch"] / whole[v]["fit_largest_minibatch"] for v in chunked if v != "none"]
    doc = " ".join((REPO / "docs" / "models.md").read_text().split())
    assert f"fits {min(factors):.1f} to {max(factors):.1f} times the sequences with remat" in doc
    best = max(r["predicted_tokens_per_s"] for r in chunked.values())
    assert best < max(r["predicted_tokens_per_s"] for r in whole.values()) and "predicts no faster" in doc


def test_the_committed_llama8b_cudnn_fit_holds_what_docs_models_says():
    """docs/models.md, llama3.1-8b on 8 H100s with cuDNN attention beside flash (its table is the rows,
    tests/report/test_docs_tables.py): the comparison (plans within 512 bytes for 8 choices, the others'
    differences, 1-7% faster predicted at the same batch)."""
    cudnn = {r["variant"]: r for r in _rows(REPO, "fit_bf16_remat_llama3.1-8b_cudnn_h100_x8")}
    flash = {r["variant"]: r for r in _rows(REPO, "fit_bf16_remat_llama3.1-8b_flash_h100_x8")}
    assert all(r["config.model.attention"] == "cudnn" for r in cudnn.values())
    near = [v for v in cudnn if abs(cudnn[v]["compiled_peak_bytes"] - flash[v]["compiled_peak_bytes"]) <= 512]
    assert len(near) == 8
    at_same_batch = [v for v in cudnn if cudnn[v]["fit_largest_minibatch"] == flash[v]["fit_largest_minibatch"]]
    same = [v for v in at_same_batch if v not in near]
    doc = " ".join((REPO / "docs" / "models.md").read_text().split())
    assert len(same) == 2
    for v in same:
        less = (flash[v]["compiled_peak_bytes"] - cudnn[v]["compiled_peak_bytes"]) / 2**30
        assert f"`{v.removeprefix('block_')}` plans {less:.2f} GiB less" in doc
    faster = [cudnn[v]["predicted_tokens_per_s"] / flash[v]["predicted_tokens_per_s"] - 1 for v in at_same_batch
              if cudnn[v]["status"] == "ok"]  # fmt: skip
    assert f"cuDNN is predicted {min(faster) * 100:.0f}-{max(faster):.0%} faster" in doc

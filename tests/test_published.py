"""jaxscale.published: the published runs as data, the lab's configuration of each, the published step derived
from what was published, the command on a tiny run, and the committed table docs/published.md quotes."""

from __future__ import annotations

import copy
import json
import re

import pytest
from conftest import REPO

from jaxscale import published
from jaxscale.config import mesh_shape
from jaxscale.measure import flops, peaks
from jaxscale.plan import gpu_plan, targets
from jaxscale.report import published_errors

RESULTS = REPO / "experiments" / "results" / "published" / "results.jsonl"
needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")


def test_the_runs_are_at_least_8_from_4_projects_each_quoting_its_source_and_a_measured_time():
    runs = published.load_runs()
    # JAX-Toolbox's Paxml and MaxText tables are one project (NVIDIA's JAX-Toolbox README files)
    projects = {run["project"].split(" ")[0] for run in runs}
    assert len(runs) >= 8 and len(projects) >= 4, projects
    for run in runs:
        assert run["source"] and run["quote"] and run["source_url"].startswith("https://"), run["id"]
        if "measured" not in run:  # pre-registered, awaiting its figures: its prediction is there
            first = run["first_sight"]
            assert first["predicted_step_s"] and re.fullmatch(r"[0-9a-f]{40}", first["commit"]), run["id"]
            continue
        measured = run["measured"]
        rates = ("step_time_s", "tokens_per_s_per_gpu", "sequences_per_s", "tflops_per_gpu")
        assert any(measured.get(k) for k in rates), run["id"]
        assert published.published_step_s(run)[0], run["id"]  # a rate in TFLOP/s only with its derived step
        assert run["lab"]["differences"], run["id"]  # what the lab cannot express, named per run


@pytest.mark.parametrize("run", published.load_runs(), ids=lambda r: r["id"])
def test_each_lab_configuration_validates_and_lays_out_the_published_gpus(run):
    config = published.lab_config(run)
    lab = run["lab"]
    assert lab["target"] in targets.TARGETS and lab["devices"] == run["n_gpus"]
    assert mesh_shape(config).devices == run["n_gpus"]
    assert config.data.seq_len == run["seq_len"]
    # the published batch: sequences per GPU x accumulation x data-parallel ranks (GPUs over tensor x context x
    # pipeline groups, whose GPUs share their sequences)
    stages = run["layout"].get("pp") or 1
    groups = max(1, run["layout"].get("tp") or 1) * max(1, run["layout"].get("cp") or 1) * stages
    per_step = run["per_gpu_batch"] * (run["grad_accum"] or 1) * run["n_gpus"] // groups
    assert config.data.batch_size == run["global_batch"] == per_step, run["id"]
    if stages == 1:
        assert config.train.num_minibatches == (run["grad_accum"] or 1)
    else:  # a pipeline's accumulation is its microbatches, which the lab splits as minibatches x microbatches in
        # flight (its GPipe / circular program holds every one in flight): each run's differences say how
        assert any("microbatches" in difference for difference in lab["differences"]), run["id"]


def test_the_published_step_follows_from_what_was_published():
    runs = {run["id"]: run for run in published.load_runs()}
    # torchtitan: 16 sequences of 8192 per step at 5,762 tokens/s on each of 8 GPUs
    step, how = published.published_step_s(runs["torchtitan-l31-8b-8xh100-fsdp"])
    assert step == pytest.approx(16 * 8192 / (5762 * 8)) and "tokens/s per GPU" in how
    # Pax: 256 sequences per step at 2,098.16 sequences/s
    assert published.published_step_s(runs["jaxtoolbox-pax-gpt126m-64xa100-bf16"])[0] == pytest.approx(256 / 2098.16)
    assert published.published_step_s(runs["llmc-gpt2-124m-8xa100"]) == (0.3, "published step time")
    # MaxText's A3 table gives TFLOP/s per chip only: the step is MaxText's own count of a device's FLOPs per step
    # (calculate_tflops_training_per_device @ efb6d9e: 6 x parameters x tokens, plus 12 x heads x layers x head dim x
    # seq^2 x batch halved for causality) over it, counted here from Llama 2 7B's shapes
    vocab, d, layers, mlp, heads, seq, batch = 32000, 4096, 32, 11008, 32, 4096, 4
    parameters = 2 * vocab * d + layers * (4 * d * d + 3 * d * mlp + 2 * d) + d  # Llama 2 7B's 6.74 billion
    assert parameters == 6_738_415_616
    device_flops = 6 * parameters * seq * batch + 12 * heads * layers * (d // heads) * seq**2 * batch / 2
    for name, tflops in (("maxtext-a3-llama2-7b-8xh100-fsdp8", 492), ("maxtext-a3-llama2-7b-128xh100-dp16-fsdp8", 375)):
        step, how = published.published_step_s(runs[name])
        assert runs[name]["measured"]["tflops_per_gpu"] == tflops and not runs[name]["measured"]["step_time_s"]
        assert step == pytest.approx(device_flops / (tflops * 1e12), rel=1e-9) and "TFLOP/s per GPU" in how


def test_an_excluded_run_is_one_whose_published_step_is_above_its_gpus_peak():
    """The one excluded figure, llm.c's GPT-3 125M at ~150 ms: 6 FLOPs per parameter and token over the step's
    tokens and the 8 GPUs is above the A100's bf16 peak, so it cannot be a measured step time."""
    excluded = [run for run in published.load_runs() if run.get("exclude")]
    assert [run["id"] for run in excluded] == ["llmc-gpt3-125m-8xa100"]
    run = excluded[0]
    tokens = run["global_batch"] * run["seq_len"]
    per_gpu = 6 * flops.param_count(published.lab_config(run).model) * tokens / run["measured"]["step_time_s"] / 8
    peak, _ = peaks.peak_flops(targets.TARGETS["a100-80gb"].device_kind, "bfloat16")
    assert per_gpu > peak == 312e12 and "328 TFLOP/s" in run["exclude"] and round(per_gpu / 1e12) == 328


def test_a_run_whose_plan_does_not_fit_its_card_is_not_counted():
    """A published run fitted its GPU; a lab plan that does not is not the program that ran, so its prediction is
    shown but not held in the mean: the row says why, and the table's mean leaves it out (hand-made rows)."""
    run = {**published.load_runs()[0], "exclude": None}
    reason = published.excluded(run, {"plan_fits": False, "plan_fits_reason": "planned peak 9 bytes > device memory 8"})
    assert reason.startswith("the lab's nearest program does not fit the ") and "planned peak 9 bytes" in reason
    assert published.excluded(run, {"plan_fits": True}) is None
    bigger_card = {**run, "gpu_memory_gib": 96}  # torchtitan's 96 GB H100s against the lab's 80 GB target
    assert published.excluded(bigger_card, {"plan_fits": False, "compiled_peak_bytes": 60 * 2**30}) is None
    too_big = {"plan_fits": False, "compiled_peak_bytes": 100 * 2**30, "plan_fits_reason": "x"}
    assert published.excluded(bigger_card, too_big).startswith("the lab's nearest program")

    def row(name: str, ratio: float, fits: bool) -> dict:
        return {"status": "ok", "variant": name, "published_n_gpus": 8, "plan_target": "h100", "published_step_s": 1.0,
                "predicted_step_s": ratio, "predicted_over_published_step": ratio, "published_peak_gib": None,
                "compiled_peak_bytes": 2**30, "plan_fits": fits,
                "published_excluded": published.excluded(run, {"plan_fits": fits,
                                                               "plan_fits_reason": "x"})}  # fmt: skip

    table = published.format_table([row("a", 1.1, True), row("b", 0.8, True), row("c", 3.0, False)])
    assert "| c (excluded: see its row) |" in table
    assert "mean absolute error 15.0% over 2 runs, 2 within ±25%" in table  # (10% + 20%) / 2, c left out


def test_bad_input_is_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_plan, "missing_extra", lambda: None)  # bad input is bad on any machine
    assert published.main(["published", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxscale: error: --only: unknown run 'nope'; known: torchtitan-") and err.count("\n") == 1
    assert published.main(["published", "--runs", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err == f"jaxscale: error: --runs: no file {tmp_path / 'none.json'}\n"
    (tmp_path / "bad.json").write_text('{"id": 1}')
    assert published.main(["published", "--runs", str(tmp_path / "bad.json")]) == 2
    assert "must be a list of runs" in capsys.readouterr().err


TINY_RUN = {
    "id": "tiny-a5000", "project": "test", "framework": "JAX", "source": "this test", "model": "tiny",
    "gpu": "RTX A5000", "n_gpus": 1, "seq_len": 32, "global_batch": 8, "measured": {"step_time_s": 0.01},
    "lab": {"config": "configs/bf16_remat.py", "preset": "tiny", "overrides": {"data.batch_size": 8},
            "target": "a5000", "devices": 1, "gemm": "triton", "differences": ["none: a test"]},
}  # fmt: skip


@pytest.fixture
def no_compile(monkeypatch):
    """Planning refused: a test of what happens before the first compile fails if one is attempted."""

    def refuse(*args, **kwargs):
        raise AssertionError("a plan was compiled")

    monkeypatch.setattr(published.run, "run", refuse)


def _set(run: dict, dotted: str, value: object) -> dict:
    """A copy of `run` with one field set ("lab.preset") or, for value None, removed."""
    run = copy.deepcopy(run)
    *groups, field = dotted.split(".")
    node = run
    for group in groups:
        node = node[group]
    if value is None:
        del node[field]
    else:
        node[field] = value
    return run


BAD_RUNS = {  # a change to a good run -> what its one line must say (the run and the field)
    "missing_seq_len": (_set(TINY_RUN, "seq_len", None), "seq_len: missing"),
    "missing_target": (_set(TINY_RUN, "lab.target", None), "lab.target: missing"),
    "n_gpus_as_text": (_set(TINY_RUN, "n_gpus", "1"), "n_gpus: must be a positive integer, got '1'"),
    "measured_as_text": (_set(TINY_RUN, "measured.step_time_s", "10 ms"), "measured.step_time_s: must be a positive"),
    "unknown_preset": (_set(TINY_RUN, "lab.preset", "huge"), "lab.preset: unknown 'huge'; allowed: seed, cpu, tiny"),
    "unknown_config_file": (_set(TINY_RUN, "lab.config", "configs/nope.py"), "lab.config: no file 'configs/nope.py'"),
    "unknown_override": (_set(TINY_RUN, "lab.overrides", {"data.batch_size": 8, "model.bogus": 1}),
                         "lab.overrides: model.bogus: no field 'bogus' in model; allowed: "),
    "override_of_wrong_type": (_set(TINY_RUN, "lab.overrides", {"data.batch_size": "8"}),
                               "lab.overrides: data.batch_size: Could not override"),
    "remat_as_text": (_set(TINY_RUN, "lab.overrides", {"data.batch_size": 8, "model.remat": "Block"}),
                      "lab.overrides: model.remat: Could not override"),
    "mesh_not_the_gpu_count": (_set(_set(_set(TINY_RUN, "lab.overrides", {"data.batch_size": 8, "mesh.fsdp": 2}),
                                         "n_gpus", 4), "lab.devices", 4),
                               "mesh: data x fsdp x tensor = 1x2x1 = 2 devices, but target a5000 (--devices) has 4"),
    "devices_not_n_gpus": (_set(TINY_RUN, "lab.devices", 2), "lab.devices: 2, but the run's n_gpus is 1"),
    "batch_not_published": (_set(TINY_RUN, "global_batch", 16),
                            "lab.overrides: data.batch_size is 8, but the run's global_batch is 16"),
    "unknown_target": (_set(TINY_RUN, "lab.target", "rtx3090"), "lab.target: unknown 'rtx3090'; allowed: "),
    "power_limit_not_the_targets": (_set(TINY_RUN, "gpu_power_limit_w", 500),
                                    "gpu_power_limit_w: 500, but lab.target 'a5000' plans the card at its board power; "
                                    "targets capped at 500 W: h100-96gb-500w"),
    "power_limit_missing_on_a_capped_target": (
        _set(_set(TINY_RUN, "lab.target", "h100-96gb-500w"), "lab.gemm", "both"),
        "gpu_power_limit_w: null, but lab.target 'h100-96gb-500w' is capped at 500 W"),
    "power_limit_as_text": (_set(TINY_RUN, "gpu_power_limit_w", "500 W"),
                            "gpu_power_limit_w: must be a positive integer (watts) or null, got '500 W'"),
    "unknown_framework": (_set(TINY_RUN, "framework", "Keras"),
                          "framework: must be one of 'PyTorch', 'PyTorch + Megatron-Core', 'JAX', 'CUDA', got 'Keras'"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_RUNS)
def test_a_bad_runs_file_is_one_line_naming_the_run_and_field_before_anything_is_compiled_or_written(
    name, tmp_path, capsys, monkeypatch, no_compile
):
    monkeypatch.setattr(gpu_plan, "missing_extra", lambda: None)
    bad, says = BAD_RUNS[name]
    (tmp_path / "runs.json").write_text(json.dumps([TINY_RUN, {**bad, "id": "tiny-bad"}]))
    code = published.main(["published", "--runs", str(tmp_path / "runs.json"), "--output_root", str(tmp_path),
                           "--only", "tiny-a5000"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("jaxscale: error: --runs: run 'tiny-bad': ") and says in err, err
    assert not (tmp_path / "experiments").exists()  # nothing written, not even the results directory


def _committed_results(tmp_path) -> bytes:
    """The committed rows copied under tmp_path (an --output_root), as bytes."""
    directory = tmp_path / "experiments" / "results" / "published"
    directory.mkdir(parents=True)
    (directory / "results.jsonl").write_bytes(RESULTS.read_bytes())
    return RESULTS.read_bytes()


def test_without_the_gpu_plan_extra_a_rerun_is_one_line_exit_2_and_keeps_every_row(
    tmp_path, capsys, monkeypatch, no_compile
):
    needs = "GPU planning needs the gpu-plan extra (jax_cuda12_plugin not installed): pip install x"
    monkeypatch.setattr(gpu_plan, "missing_extra", lambda: f"--target: {needs}")  # as gpu_plan words it
    before = _committed_results(tmp_path)
    assert published.main(["published", "--rerun", "--output_root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"jaxscale: error: {needs}\n"
    directory = tmp_path / "experiments" / "results" / "published"
    assert (directory / "results.jsonl").read_bytes() == before and sorted(p.name for p in directory.iterdir()) == [
        "results.jsonl"
    ]


@pytest.mark.parametrize("status, kept", [("error", True), ("oom", False)])
def test_a_plan_that_fails_keeps_the_ok_row_unless_it_is_the_runs_own_oom(status, kept, tmp_path, capsys, monkeypatch):
    """A rerun whose plan fails on this machine (status error: a compiler failure, a missing library) keeps the
    committed ok row and says so in one line, exit 1; an oom is the run's own result and replaces it."""
    monkeypatch.setattr(gpu_plan, "missing_extra", lambda: None)
    failure = f"{status}: target compile failed (exit 1): ptxas fatal: Unknown option"
    monkeypatch.setattr(published.run, "run", lambda *a, **k: {"status": status, "error": failure})
    before = _committed_results(tmp_path)
    name = "llmc-gpt2-124m-8xa100"
    assert published.main(["published", "--rerun", "--only", name, "--output_root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jaxscale: error: {name}: ") and failure in err, err
    after = (tmp_path / "experiments" / "results" / "published" / "results.jsonl").read_bytes()
    rows = {r["variant"]: r for r in map(json.loads, after.splitlines())}
    assert len(rows) == len(before.splitlines())
    if kept:
        assert after == before and "earlier ok row kept" in err
    else:
        assert rows[name]["status"] == "oom" and all(r["status"] == "ok" for v, r in rows.items() if v != name)


def test_the_llmc_runs_pose_a_chunked_loss_no_larger_than_llmcs_one_bf16_logits_buffer():
    """llm.c never holds float32 logits: its fused classifier overwrites one bf16 [B, T, Vp] buffer (Vp = 50,304)
    with the logits' gradient. Each llm.c run is posed with the largest power-of-two loss chunk whose bf16 logits
    and float32 gradient (6 bytes a logit) hold no more than that buffer (2 bytes a logit), and its notes and
    differences quote the buffer, counted from the quoted -b and -t."""
    llmc = [run for run in published.load_runs() if run["project"] == "llm.c"]
    assert len(llmc) == 5
    for run in llmc:
        b, t = map(int, re.search(r"-b (\d+) -t (\d+)", run["quote"]).groups())
        config = published.lab_config(run)
        chunk, vocab = config.train.loss_chunk_len, config.model.vocab_size
        per_gpu = config.data.batch_size // config.train.num_minibatches // run["lab"]["devices"]
        assert per_gpu == b and config.data.seq_len == t and t % chunk == 0 and chunk & (chunk - 1) == 0, run["id"]
        assert 6 * b * chunk * vocab <= 2 * b * t * 50304 < 6 * b * 2 * chunk * vocab, run["id"]
        assert f"train.loss_chunk_len={chunk}" in run["notes"], run["id"]
        gib = b * t * 50304 * 2 / 2**30
        (difference,) = [d for d in run["lab"]["differences"] if f"train.loss_chunk_len={chunk}" in d]
        assert f"= {gib:.1f} GiB per GPU at -b {b}" in difference, run["id"]
    # The committed rows are planned with that pose; one whose plan still does not fit its card is not counted.
    rows = {r["variant"]: r for r in map(json.loads, RESULTS.read_text().splitlines())}
    for run in llmc:
        row = rows[run["id"]]
        assert row["config.train.loss_chunk_len"] == published.lab_config(run).train.loss_chunk_len > 0, run["id"]
        if row["plan_fits"] is False and not run.get("exclude"):
            assert "does not fit" in row["published_excluded"], run["id"]


@needs_extra
def test_the_command_plans_a_run_and_tables_it_against_its_published_step(tmp_path, capsys):
    run = TINY_RUN
    (tmp_path / "runs.json").write_text(json.dumps([run]))
    assert published.main(["published", "--runs", str(tmp_path / "runs.json"), "--output_root", str(tmp_path)]) == 0
    directory = tmp_path / "experiments" / "results" / "published"
    (row,) = [json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["plan_target"] == "a5000"
    assert row["predicted_over_published_step"] == pytest.approx(row["predicted_step_s"] / 0.01)
    assert row["published_tokens_per_s_per_gpu"] == pytest.approx(8 * 32 / 0.01)
    table = (directory / "published.md").read_text()
    assert f"| {row['predicted_over_published_step']:.2f} |" in table and table in capsys.readouterr().out


def test_the_committed_rows_hold_their_ratios():
    """The rows' predicted / published (published from the runs file as it is now), by hand; the development set
    and the pre-registered runs' first sight apart. docs/published.md's table is tests/report/test_docs_tables.py's."""
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    runs = {run["id"]: run for run in published.load_runs()}
    assert {r["variant"] for r in rows} == set(runs)
    development, first_sight, fit_since = [], [], []
    for row in rows:
        assert row["status"] == "ok", row["variant"]
        run = runs[row["variant"]]
        step, _ = published.published_step_s(run)
        if step is None:
            continue
        if "first_sight" in run and not run.get("first_sight_void"):
            # the first-sight error is over the runs whose registered plan fitted their card (never rewritten by a
            # later plan); a run whose plan fits only since is counted apart, by its current prediction
            first = run["first_sight"]
            card = run.get("gpu_memory_gib")
            fitted = first["plan_fits"] or bool(card and first["plan_peak_gib"] < card)
            if fitted and not run.get("exclude"):
                first_sight.append(first["predicted_step_s"] / step)
            elif not published.excluded(run, row):
                fit_since.append(row["predicted_step_s"] / step)
        elif not published.excluded(run, row):
            development.append(row["predicted_step_s"] / step)
    table = published.format_table(sorted(rows, key=lambda row: row["variant"]), list(runs.values()))
    for label, ratios in (("time, development set", development), ("time, first sight (pre-registered)", first_sight),
                          ("time, registered runs whose plan fits only since their first sight", fit_since)):
        if ratios:
            error = 100 * sum(abs(r - 1) for r in ratios) / len(ratios)  # the table's line, by hand
            within = sum(0.75 <= r <= 1.25 for r in ratios)
            assert f"{label}: mean absolute error {error:.1f}% over {len(ratios)} runs, {within} within ±25%" in table


def test_a_run_is_registered_once_before_its_figures_and_its_first_sight_is_kept(tmp_path, capsys, monkeypatch):
    """--register plans a run that has no figures, writes its prediction and the commit into the runs file; a second
    --register of it, or of a run with figures, is one line; with the figures added, the table shows first sight and
    current apart from the development set."""
    monkeypatch.setattr(published, "uncommitted_code", lambda: None)
    monkeypatch.setattr(published, "head_commit", lambda: "a" * 40)
    pending = {k: v for k, v in TINY_RUN.items() if k != "measured"}
    runs_file, root = tmp_path / "runs.json", ["--output_root", str(tmp_path)]
    runs_file.write_text(json.dumps([TINY_RUN, {**pending, "id": "tiny-new"}]))
    assert published.main(["published", "--runs", str(runs_file), "--register", *root]) == 0
    runs = json.loads(runs_file.read_text())
    assert "first_sight" not in runs[0]  # it had its figures: not a first sight
    first = runs[1]["first_sight"]
    rows = {r["variant"]: r for r in map(json.loads, (tmp_path / "experiments/results/published/results.jsonl")
                                         .read_text().splitlines())}  # fmt: skip
    assert first["predicted_step_s"] == rows["tiny-new"]["predicted_step_s"] and first["commit"] == "a" * 40
    assert "registered, not yet measured" in capsys.readouterr().out
    for only in ("tiny-new", "tiny-a5000"):
        assert published.main(["published", "--runs", str(runs_file), "--register", "--only", only, *root]) == 2
        assert capsys.readouterr().err.startswith(f"jaxscale: error: --register: run {only!r} has ")
    runs[1]["measured"] = {"step_time_s": 2 * first["predicted_step_s"]}  # the figures, added afterwards
    runs_file.write_text(json.dumps(runs))
    table = published.format_table(list(rows.values()), published.load_runs(runs_file))
    assert "time, first sight (pre-registered): mean absolute error 50.0% over 1 runs, 0 within ±25%" in table
    assert "| tiny-new | 1 x a5000 |" in table and "| 0.50 | 0.50 |" in table  # current = first sight: nothing changed
    runs[1]["first_sight_void"] = "its figure was in the repository before it was registered"
    runs_file.write_text(json.dumps(runs))
    table = published.format_table(list(rows.values()), published.load_runs(runs_file))
    assert "| tiny-new (registered, not a first sight: its runs-file entry says why) |" in table
    assert "time, development set: mean absolute error 50.0% over 1 runs" in table and "first sight (pre" not in table


def test_register_is_refused_while_the_code_differs_from_its_commit(tmp_path, capsys, monkeypatch, no_compile):
    monkeypatch.setattr(gpu_plan, "missing_extra", lambda: None)
    monkeypatch.setattr(published, "uncommitted_code", lambda: "jaxscale/plan/predict.py")
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps([{k: v for k, v in TINY_RUN.items() if k != "measured"}]))
    before = runs_file.read_text()
    assert published.main(["published", "--runs", str(runs_file), "--register", "--output_root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("jaxscale: error: --register: the lab's code has uncommitted changes "
                                       "(jaxscale/plan/predict.py); commit them first, so that each prediction names "
                                       "the code that made it\n")  # fmt: skip
    assert runs_file.read_text() == before and not (tmp_path / "experiments").exists()


def test_the_torchtitan_rows_in_docs_are_the_committed_plans_of_their_own_target():
    """docs/published.md's torchtitan H100 paragraph, from the committed rows: each run planned on h100-96gb-500w (the
    card its benchmark names), its step at the middle and at both ends of the card's compute range (the ends bracket
    the middle), against the published step (TPS/GPU turned into a step by the batch, as the runs file gives it)."""
    rows = {r["variant"]: r for r in map(json.loads, RESULTS.read_text().splitlines())}
    runs = {run["id"]: run for run in published.load_runs()}
    text = " ".join((REPO / "docs" / "published.md").read_text().split())
    names = ("8xh100-fsdp", "128xh100-fsdp", "8xh100-fsdp-compile")
    eight, many, compiled = (rows[f"torchtitan-l31-8b-{n}"] for n in names)
    for row in (eight, many, compiled):
        assert row["plan_target"] == "h100-96gb-500w" == runs[row["variant"]]["lab"]["target"]
        slow, fast = row["predicted_step_s_range"]
        assert slow > row["predicted_step_s"] > fast
    tokens = 16 * 8192  # Table 1: global batch 16 at sequence 8192, on 8 GPUs
    published_8 = tokens / (5762 * 8)
    assert eight["published_step_s"] == pytest.approx(published_8)
    e, m = eight["predicted_step_s_range"], many["predicted_step_s_range"]
    assert (f"the 8-GPU run is predicted {eight['predicted_step_s']:.3f} s ({e[0]:.3f} s at the NVL's peak, "
            f"{e[1]:.3f} s at the SXM's) against {published_8:.3f} s published, "
            f"{eight['predicted_step_s'] / published_8:.2f} of it; "
            f"the 128-GPU run {many['predicted_step_s']:.3f} s ({m[0]:.3f}-{m[1]:.3f} s) against "
            f"{many['published_step_s']:.3f} s, {many['predicted_over_published_step']:.2f}.") in text
    assert (f"the 8-GPU `torch.compile` row ({compiled['published_step_s']:.3f} s) is predicted "
            f"{compiled['predicted_over_published_step']:.2f} of its step") in text


def test_docs_published_md_states_the_torchtune_first_sights_as_the_committed_rows_give_them():
    """docs/published.md's prose on the two torchtune runs, from the runs file's first sights and figures (and the
    RTX 4090 LoRA row's 3,083 tokens/s, the figure docs/finetune.md quotes from the same table)."""
    runs = {run["id"]: run for run in published.load_runs()}
    text = " ".join((REPO / "docs" / "published.md").read_text().split())
    finetune = " ".join((REPO / "docs" / "finetune.md").read_text().split())
    qlora, lora = runs["torchtune-l31-8b-qlora-1x4090"], runs["torchtune-l31-8b-lora-1xa6000"]

    def step(run: dict) -> float:  # tokens per step over the published tokens/s
        return run["global_batch"] * run["seq_len"] / run["measured"]["tokens_per_s_per_gpu"]

    time_off = abs(qlora["first_sight"]["predicted_step_s"] / step(qlora) - 1)
    memory_off = abs(qlora["first_sight"]["plan_peak_gib"] / qlora["measured"]["peak_memory_gib"] - 1)
    assert f"predicted within {time_off:.0%} (time) and {memory_off:.0%} (memory)" in text
    ratio = lora["first_sight"]["predicted_step_s"] / step(lora)
    assert (f"predicted {ratio:.2f}x slow, with a plan of {lora['first_sight']['plan_peak_gib']:.1f} GiB against the "
            f"{lora['measured']['peak_memory_gib']:.1f} GiB it ran in") in text  # fmt: skip
    assert "| Llama 3.1 8B | LoRA | 1x 4090 | 16.2 GiB | 3083 |" in finetune
    assert f"({lora['measured']['tokens_per_s_per_gpu'] / 3083:.1f}x the RTX 4090 LoRA row's tokens/s" in text
    assert f"first sight of torchtune's A6000 LoRA run, {ratio:.2f}, docs/published.md" in " ".join(
        (REPO / "docs" / "fit.md").read_text().split())


QWEN3_MOE_RUNS = ("mbridge-2604p-qwen3-30b-a3b-16xh100-ep16-fp8cs", "mbridge-2604p-qwen3-30b-a3b-8xb200-ep8-mxfp8",
                  "mbridge-2604p-qwen3-30b-a3b-8xgb200-ep8-mxfp8", "automodel-qwen3-30b-a3b-8xh100-ep8-fsdp8-bf16")


def test_docs_published_md_states_the_moe_first_sights_as_the_runs_file_gives_them():
    """docs/published.md's prose on the four Qwen3-30B-A3B runs: their plans' GiB and the range of their first sights
    over the published steps (tokens a step / the published tokens/s, or the published step), from the runs file."""
    runs = {run["id"]: run for run in published.load_runs()}
    text = " ".join((REPO / "docs" / "published.md").read_text().split())
    ratios, plans = [], []
    for name in QWEN3_MOE_RUNS:
        run = runs[name]
        measured = run["measured"]
        step = measured["step_time_s"] or run["global_batch"] * run["seq_len"] / (
            measured["tokens_per_s_per_gpu"] * run["n_gpus"])
        ratios.append(run["first_sight"]["predicted_step_s"] / step)
        plans.append(f"{run['first_sight']['plan_peak_gib']:.1f}")
    assert f"plans of {', '.join(plans[:-1])} and {plans[-1]} GiB" in text
    assert f"predict {min(ratios):.2f}x to {max(ratios):.2f}x the published steps" in text


ISSUE_42_RUNS = (  # the runs registered for issue 42, in the order of their docs paragraph
    "dgxc-maxtext-l3-70b-128xh100-fsdp128-bf16", "dgxc-maxtext-l3-70b-128xh100-fsdp128-fp8",
    "jaxtoolbox-pax-gpt5b-256xh100-te-bf16", "jaxtoolbox-pax-gpt5b-256xh100-te-fp8",
    "dgxc-pax-gpt5b-16xh100-dp2-fsdp8-te-bf16", "llmfoundry-mpt7b-8xh100-fsdp-bf16-noac",
    "llmfoundry-mpt3b-8xh100-fsdp-fp8-noac", "llmfoundry-mpt70b-64xh100-fsdp-bf16-fullac",
    "llmfoundry-mpt13b-128xh100-fsdp-bf16-fullac", "fmsfsdp-llama2-7b-96xh100-hsdp-compile",
    "vectorlm-l3-8b-lora-1xa100-80gb-s2048",
)


def test_docs_published_md_states_the_issue_42_first_sights_as_the_runs_file_gives_them():
    """The paragraph on the twelve runs registered for issue 42: each first sight over its published step (the
    published step from the runs file's figures, tokens or sequences per second turned into a step by the batch), and
    the excluded full fine-tune's plan against its card."""
    runs = {run["id"]: run for run in published.load_runs()}
    text = " ".join((REPO / "docs" / "published.md").read_text().split())

    def step(run: dict) -> float:
        measured, tokens = run["measured"], run["global_batch"] * run["seq_len"]
        if measured["step_time_s"]:
            return measured["step_time_s"]
        if measured["tokens_per_s_per_gpu"]:
            return tokens / (measured["tokens_per_s_per_gpu"] * run["n_gpus"])
        return run["global_batch"] / measured["sequences_per_s"]

    ratios = {i: runs[i]["first_sight"]["predicted_step_s"] / step(runs[i]) for i in ISSUE_42_RUNS}
    r = [f"{ratios[i]:.2f}" for i in ISSUE_42_RUNS]
    assert (f"First sight / published: MaxText 70B bf16 {r[0]}, FP8 {r[1]}; Paxml 5B on 256 H100s bf16 {r[2]}, FP8 "
            f"{r[3]}, on 16 H100s {r[4]}; MPT-7B {r[5]}, MPT-3B FP8 {r[6]}, MPT-70B {r[7]}, MPT-13B {r[8]}; fms-fsdp "
            f"{r[9]}; VectorLM LoRA {r[10]}.") in text
    full = runs["vectorlm-l3-8b-full-1xa100-80gb-s2048"]["first_sight"]
    assert not full["plan_fits"] and f"plans {full['plan_peak_gib']:.1f} GiB on an 80 GB card" in text
    maxtext = [ratios[i] for i in list(ISSUE_42_RUNS)[:2]]
    others = [ratios[i] for i in list(ISSUE_42_RUNS)[2:]]
    assert max(abs(x - 1) for x in maxtext) < 0.09 and "(MaxText, within 9%)" in text
    assert f"predicted {1 - max(others):.0%}-{1 - min(others):.0%} faster than they ran".replace("%-", "-") in text


SECOND_42_RUNS = (  # the ten registered after them (predictor 214d172), in the order of their docs paragraph
    "olmocore-llama3-8b-8xh100-fsdp-compile-bf16", "olmocore-llama3-8b-8xh100-fsdp-compile-float8",
    "olmocore-olmo2-1b-8xh100-fsdp-compile-bf16", "olmocore-olmo2-7b-8xh100-fsdp-compile-bf16",
    "olmocore-olmo2-13b-8xh100-fsdp-compile-bf16", "maxtext-a3-llama2-7b-8xh100-fsdp8",
    "maxtext-a3-llama2-7b-32xh100-dp4-fsdp8", "maxtext-a3-llama2-7b-128xh100-dp16-fsdp8",
    "gpurecipes-maxtext-l31-70b-256xh200-dp2-fsdp128-bf16", "gpurecipes-maxtext-l31-70b-256xb200-fsdp256-fullremat-fp8",
)


def test_docs_published_md_states_the_ten_later_first_sights_and_the_b200_replan_as_the_files_give_them():
    """The paragraph on the ten runs registered with 214d172's predictor: each first sight over its published step,
    their mean absolute error counted here, and the B200 rows as the committed replan gives them."""
    runs = {run["id"]: run for run in published.load_runs()}
    text = " ".join((REPO / "docs" / "published.md").read_text().split())
    ratios = [runs[i]["first_sight"]["predicted_step_s"] / published.published_step_s(runs[i])[0]
              for i in SECOND_42_RUNS]
    assert all(runs[i]["first_sight"]["commit"].startswith("214d172") for i in SECOND_42_RUNS)
    r = [f"{x:.2f}" for x in ratios]
    assert (f"First sight / published: OLMo-core Llama 3 8B bf16 {r[0]}, Float8 {r[1]}, OLMo 2 1B {r[2]}, 7B {r[3]}, "
            f"13B {r[4]}; MaxText A3 on 8 H100s {r[5]}, on 32 {r[6]}, on 128 {r[7]}; the H200 70B {r[8]}, the B200 70B "
            f"FP8 {r[9]}: a mean absolute error of {sum(abs(x - 1) for x in ratios) / 10:.1%} over the ten, "
            f"{sum(abs(x - 1) <= 0.25 for x in ratios)} within ±25%.") in text
    rows = {r["variant"]: r for r in map(json.loads, RESULTS.read_text().splitlines())}
    now = {i: published.compare(runs[i], rows[i])["predicted_over_published_step"] for i in rows if "b200" in i}
    b200 = now.pop(SECOND_42_RUNS[-1])
    assert f"moves from {r[9]} (its first sight, which stays) to {b200:.2f}" in text
    low, high = min(now.values()), max(now.values())
    assert f"the excluded Megatron-Bridge rows from 1.25-1.27 to {low:.2f}-{high:.2f}" in text


def test_the_split_table_counts_each_group_by_hand():
    """split_table on five compared rows whose errors are counted by hand: two first sights on H100s (0.80 and 1.10,
    PyTorch and JAX, one predictor commit), one of them replanned since (1.05); a development-set A100 run (1.30); an
    excluded run and a run excluded only at first sight (neither in any first-sight cell)."""
    def row(variant, target, framework, now, first=None, commit=None, **flags):
        return {"variant": variant, "status": "ok", "plan_target": target, "published_framework": framework,
                "predicted_over_published_step": now, "first_sight_over_published_step": first,
                "first_sight_step_s": 1.0 if first else None, "first_sight_commit": commit, **flags}  # fmt: skip

    rows = [
        row("a", "h100", "PyTorch", now=0.80, first=0.80, commit="1234567890"),
        row("b", "h100", "JAX", now=1.05, first=1.10, commit="1234567890"),
        row("c", "a100-80gb", "CUDA", now=1.30),
        row("d", "h100", "PyTorch", now=3.0, published_excluded="a reason"),
        row("e", "h100", "PyTorch", now=0.9, first=2.0, commit="1234567890", first_sight_excluded=True),
    ]
    lines = published_errors.split_table(rows).splitlines()
    assert lines[2] == ("| all | 15.0% over 2 (2 within ±25%) | 12.5% over 2 (2 within ±25%) "
                        "| 30.0% over 1 (0 within ±25%) |")
    assert "| GPU: a100-80gb | – | – | 30.0% over 1 (0 within ±25%) |" in lines
    assert "| GPU: h100 | 15.0% over 2 (2 within ±25%) | 12.5% over 2 (2 within ±25%) | – |" in lines
    assert "| framework: JAX | 10.0% over 1 (1 within ±25%) | 5.0% over 1 (1 within ±25%) | – |" in lines
    assert "| framework: PyTorch | 20.0% over 1 (1 within ±25%) | 20.0% over 1 (1 within ±25%) | – |" in lines
    assert "| first sight made by: 1234567 | 15.0% over 2 (2 within ±25%) | 12.5% over 2 (2 within ±25%) | – |" in lines
    assert len(lines) == 2 + 1 + 2 + 3 + 1  # header, all, two GPUs, three frameworks, one commit

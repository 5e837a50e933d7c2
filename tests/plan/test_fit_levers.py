"""jaxscale.plan.fit_levers: when no remat choice fits, the cheapest lever whose plan fits is named (tiny, this CPU)."""

from __future__ import annotations

import pytest
from conftest import CONFIGS, load_config

from jaxscale import fit as fit_cli
from jaxscale.plan import fit_levers, fit_search

MIB = 2**20


def _peak(config, choice: str = "block") -> int:
    """The local compiler's minibatch-1 plan peak of `config`: computed here, apart from the levers' search."""
    row = fit_search.local_planner(fit_search.with_minibatch(config, choice, 1))
    host = row["compiled_host_argument_bytes"] or 0  # the CPU's plan counts host-memory state in its peak
    return row["compiled_peak_bytes"] - host


@pytest.mark.parametrize("memory, named", [pytest.param("2.25MiB", "adafactor", marks=pytest.mark.slow),
                                           ("2.0MiB", "offload_state")])  # fmt: skip
def test_when_nothing_fits_the_cheapest_fitting_lever_is_named(tmp_path, capsys, local_plans_once, memory, named):
    """At a budget below the tiny model's minibatch-1 plan, the answer names the first lever, in LEVERS' order,
    whose own plan fits; each cheaper lever's plan is above the budget, the named one's below. The plans are the
    compiler's, judged here apart from the levers' search (each config compiled once and kept, conftest's
    local_plans_once: the fit's compiles of the same configs are reused, which halves the test's time)."""
    budget = float(memory.removesuffix("MiB")) * MIB
    code = fit_cli.main(["fit", "--config", f"{CONFIGS}/bf16_remat.py:tiny", "--output_root", str(tmp_path),
                         "--remat", "block", "--memory", memory])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "recommendation: none: " in out
    line = next(line for line in out.splitlines() if "what would fit:" in line)
    assert line.strip().startswith(f"what would fit: {named} (")
    config = load_config("bf16_remat", "tiny")
    assert _peak(config) > budget  # nothing fit as given
    order = [lever.name for lever in fit_levers.LEVERS if lever.applies(config, 1.0) and lever.mem_fraction is None]
    for lever in fit_levers.LEVERS[: [lv.name for lv in fit_levers.LEVERS].index(named)]:
        if lever.name in order:
            assert _peak(fit_levers.with_levers(config, [lever])) > budget, lever.name
    lever = next(lv for lv in fit_levers.LEVERS if lv.name == named)
    assert _peak(fit_levers.with_levers(config, [lever])) <= budget
    assert line.strip().endswith(f"rerun with {lever.flags}")


def test_levers_used_together_keep_one_optimizer_lever_and_make_a_valid_config():
    """All levers at once: of the optimizer levers (which replace one another's state) only the last, Adafactor, and
    of the fine-tuning methods only the last, QLoRA, so the config they make validates, and the rerun flags they
    print name one optimizer state and one method (an earlier version set bf16, int8 and Adafactor together: a
    command that could not run)."""
    config = load_config("bf16_remat", "tiny")
    active = [lever for lever in fit_levers.LEVERS if lever.applies(config, 0.75)]
    combined = fit_levers.together(active)
    assert [lever.name for lever in combined] == ["mem_fraction", "bf16_weights", "adafactor", "offload_state",
                                                  "qlora_all"]  # seq 32  # fmt: skip
    made = fit_levers.with_levers(config, combined)
    assert (made.optimizer.name, made.optimizer.state_dtype) == ("adafactor", "float32")
    assert made.finetune.train == "adapters" and made.model.lora_rank == fit_search.DEFAULT_LORA_RANK
    assert made.finetune.frozen_dtype == "nf4" and made.optimizer.offload_state and made.model.param_dtype == "bfloat16"
    flags = " ".join(lever.flags for lever in combined)
    assert flags.count("--config.optimizer.state_dtype=") == 1 and flags.count("--finetune") == 1


def test_a_lever_the_model_cannot_take_is_not_tried():
    """LoRA on every projection (lora_all, qlora_all) puts adapters on the MLP, which a mixture of experts' stacked
    experts do not carry: validation refuses it (one line), so the lever search leaves it out instead of stopping
    on a traceback, as it did for olmoe-1b-7b on an RTX 4090; the same levers apply to a dense model."""
    levers = {lever.name: lever for lever in fit_levers.LEVERS}
    moe, dense = load_config("bf16_remat", "tiny-moe"), load_config("bf16_remat", "tiny-llama")
    for name in ("lora_all", "qlora_all"):
        assert not fit_levers._valid(moe, [levers[name]]) and fit_levers._valid(dense, [levers[name]])
    assert fit_levers._valid(moe, [levers["offload_state"]])
    tried = {lever.name for lever in fit_levers.applicable(moe, shared=True, fraction=0.75)}
    assert "offload_state" in tried and not tried & {"lora_all", "qlora_all"}


def test_a_data_parallel_mesh_gets_the_fsdp_and_pipeline_levers_in_their_places():
    """On a mesh with a data-parallel axis the lever list gains FSDP (after the chunked loss) and two pipeline stages
    (after the host-memory state), each keeping the mesh's device count and validating; FSDP alone joins the levers
    used together (both move mesh.data); no data axis, no layout lever; a model the pipeline cannot carry (a mixture
    of experts) gets FSDP only."""
    config = load_config("bf16_remat", "tiny-llama")
    config.mesh.update(data=4, fsdp=2)
    config.data.batch_size = 16  # 2 minibatches of 1 row a device
    names = [lever.name for lever in fit_levers.applicable(config, shared=True, fraction=0.75)]
    assert names == ["mem_fraction", "fsdp", "bf16_weights", "bf16_state", "int8_state", "adafactor", "offload_state",
                     "pipeline", "lora_all", "qlora_all"]  # seq 32: no chunked loss  # fmt: skip
    levers = {lever.name: lever for lever in fit_levers.layout_levers(config)}
    fsdp, pipeline = (fit_levers.with_levers(config, [levers[name]]) for name in ("fsdp", "pipeline"))
    assert (fsdp.mesh.data, fsdp.mesh.fsdp, fsdp.mesh.stage) == (1, 8, 1)
    assert (pipeline.mesh.data, pipeline.mesh.fsdp, pipeline.mesh.stage) == (2, 2, 2) and pipeline.model.scan_layers
    assert fit_search.minibatch_step(pipeline) == 2  # one microbatch a stage: the probes step by 2
    # each device's rows a minibatch kept: 1 with FSDP (16 over 2 minibatches x 8), rounded up to the pipeline's 2
    # microbatches (2 minibatches x 2 rows x data 2 x fsdp 2 = 16)
    assert fsdp.data.batch_size == 16 and pipeline.data.batch_size == 16
    assert levers["pipeline"].flags == "--config.mesh.data=2 --config.mesh.stage=2 --config.model.scan_layers=True"
    together = [lever.name for lever in fit_levers.together(fit_levers.applicable(config, True, 0.75))]
    assert "fsdp" in together and "pipeline" not in together
    assert fit_levers._valid(config, fit_levers.together(fit_levers.applicable(config, True, 0.75)))
    config.mesh.update(data=1, fsdp=8)
    assert fit_levers.layout_levers(config) == []
    moe = load_config("bf16_remat", "tiny-moe")
    moe.mesh.data = 2
    assert [lever.name for lever in fit_levers.applicable(moe, True, 0.75) if lever.layout] == ["fsdp"]


@pytest.mark.slow
def test_a_data_parallel_mesh_that_does_not_fit_is_answered_by_a_layout_lever_on_target_gpus(monkeypatch):
    """tiny-llama on 2 deviceless H100s, data parallel: its own plan at minibatch 1, FSDP's at 1 and the pipeline's
    at 2 (one microbatch a stage), compiled here; splitting the state (FSDP) or the layers (the pipeline) plans less
    than replicating them, and at a budget just below the data-parallel plan what_would_fit names the first layout
    lever whose plan is within it (the other levers set aside)."""
    plan = fit_search.target_planner("h100", "cublas", None, False, 2)
    config = load_config("bf16_remat", "tiny-llama")
    config.mesh.data, config.data.batch_size, config.train.num_minibatches = 2, 4, 1
    levers = {lever.name: lever for lever in fit_levers.layout_levers(config)}

    def peak(made, minibatch):
        return fit_search.device_peak(plan(fit_search.with_minibatch(made, "block", minibatch)))

    own = peak(config, 1)
    fsdp = peak(fit_levers.with_levers(config, [levers["fsdp"]]), 1)
    pipeline = peak(fit_levers.with_levers(config, [levers["pipeline"]]), 2)
    assert fsdp < own and pipeline < peak(config, 2)
    monkeypatch.setattr(fit_levers, "LEVERS", ())
    found = fit_levers.what_would_fit(config, "block", plan, own - 1, respect_xla_limit=False)
    first = "fsdp" if fsdp <= own - 1 else "pipeline" if pipeline <= own - 1 else None
    assert (found[0][0].name if found else None) == first

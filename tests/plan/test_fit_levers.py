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

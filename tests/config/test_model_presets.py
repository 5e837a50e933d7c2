"""Named real-model presets: exact published parameter counts through jax.eval_shape (nothing allocated), and
how a model preset combines with a config file and batch/sequence overrides."""

from __future__ import annotations

import jax
import pytest
from conftest import CONFIGS, load_config, run_cli

from jaxscale import train
from jaxscale.config import all_presets, validate
from jaxscale.config.model_presets import MODEL_PRESETS
from jaxscale.measure import flops
from jaxscale.model import count_params

# Published counts (Hugging Face model cards / safetensors totals).
EXPECTED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "tinyllama-1.1b": 1_100_048_384,
    "llama2-7b": 6_738_415_616,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    # by hand from the config (126 x (2 x 16384^2 + 2 x 16384 x 1024 + 3 x 16384 x 53248 + 2 x 16384) + 2 x 128256 x
    # 16384 + 16384), the figure Meta's "405B" rounds
    "llama3.1-405b": 405_853_388_800,
    # Mixtures of experts: the hand arithmetic of tests/model/test_moe.py (issue 33: 46.70B, 6.92B, 30.53B)
    "mixtral-8x7b": 46_702_792_704,
    "olmoe-1b-7b": 6_919_161_856,
    "qwen3-30b-a3b": 30_532_122_624,
}


# Scanned (the layers stacked by nn.scan), one preset a family in the default suite: a family's presets differ in
# sizes only, which the unrolled counts of every preset hold.
SCANNED_FAST = ("gpt2", "llama3.1-8b", "qwen3-30b-a3b", "llama3.1-405b")
UNROLLED_SLOW = ("llama3.1-405b",)  # its 126 unrolled layers take longest to trace; scanned in the default suite


@pytest.mark.parametrize(
    "preset, scan_layers",
    [pytest.param(p, False, marks=pytest.mark.slow if p in UNROLLED_SLOW else ()) for p in sorted(EXPECTED)]
    + [pytest.param(p, True, marks=() if p in SCANNED_FAST else pytest.mark.slow) for p in sorted(EXPECTED)],
)
def test_real_model_parameter_counts_are_exact(preset, scan_layers):
    config = load_config("bf16_remat", preset)
    config.model.scan_layers = scan_layers
    state = jax.eval_shape(train.make_init_fn(config))  # shapes only: an 8B model costs nothing here
    assert count_params(state.params) == EXPECTED[preset]
    assert flops.param_count(config.model) == EXPECTED[preset]


def test_every_preset_is_listed_and_validates_with_every_config_file():
    assert set(EXPECTED) | {"tiny-llama", "cpu-llama", "tiny-moe"} == set(MODEL_PRESETS)
    for path in CONFIGS.glob("*.py"):
        for preset in all_presets():
            config = load_config(path.stem, preset)
            validate(config)
            assert config.preset == preset


def test_a_model_preset_takes_the_technique_from_the_file_and_the_batch_from_overrides(tmp_path):
    """One command: the config file gives dtype/scan/remat, the preset the model, overrides the sequence and batch."""
    result = run_cli(
        "jaxscale.run", "--config", f"{CONFIGS}/bf16_remat_block.py:llama3.1-8b", "--config.data.seq_len=8192",
        "--config.data.batch_size=2", "--config.model.num_layers=1", "--config.model.vocab_size=1024",
        "--config.model.hidden_size=256", "--config.model.mlp_hidden_size=512", "--config.model.num_kv_heads=1",
        "--plan", "--name=preset_cli",
        "--output_root", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tokens/step 16,384" in result.stdout  # 2 x 8192
    config = load_config("bf16_remat_block", "llama3.1-8b")
    assert config.model.family == "llama" and config.model.remat == ("Block",) and config.model.scan_layers


# The lab's committed MoE answers, deviceless plans (docs/models.md): one H200 with OLMoE's layer, and Mixtral 8x7B
# and Qwen3-30B-A3B on 8 H100s, each over every dispatch (and layout).
MOE_ANSWERS = ("moe_dispatch_olmoe-1b-7b_plan_h200", "moe_layouts_mixtral-8x7b_plan_h100_x8",
               "moe_layouts_qwen3-30b-a3b_plan_h100_x8")  # fmt: skip


@pytest.mark.parametrize("answer", MOE_ANSWERS)
def test_the_moe_presets_default_dispatch_is_the_fastest_plan_that_fits_in_the_labs_answers(answer):
    """A user who names an MoE preset gets the dispatch of the fastest fitting plan in each committed answer (the
    lowest predicted step among the rows whose plan fits), and not the ragged dispatch, which fits in none."""
    import json

    from conftest import REPO

    rows = [json.loads(line) for line in (REPO / "experiments" / "results" / answer / "results.jsonl").open()]
    fitting = [row for row in rows if row["plan_fits"]]
    fastest = min(fitting, key=lambda row: row["predicted_step_s"])
    for preset in ("mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b"):
        assert load_config("bf16_remat", preset).model.moe_dispatch == fastest["config.model.moe_dispatch"]
    assert not any(row["plan_fits"] for row in rows if row["config.model.moe_dispatch"] == "ragged")

"""The cost of a whole training (jaxscale.plan.cost): hand counts, which speed a row is priced at, and the
--train_tokens / --gpu_hour_usd flags of run."""

from __future__ import annotations

import json

import pytest
from conftest import CONFIGS

from jaxscale import run
from jaxscale.plan import cost


def test_a_hand_counted_training():
    # 1,000 tokens/s over 8 devices, 3.6 million tokens: 3,600 s = 1/24 day, 8 device-hours, $16 at $2
    got = cost.training_cost(1000.0, 8, 3.6e6, 2.0)
    assert got == pytest.approx({"cost_device_hours": 8.0, "cost_wall_days": 1 / 24, "cost_usd": 16.0})
    assert cost.training_cost(1000.0, 8, 3.6e6, None)["cost_usd"] is None


def test_llama_8b_at_15t_tokens_on_h100s_at_meta_s_gpu_hours_rate():
    # Meta's 1.46M H100-hours for 15T tokens are 15e12 / (1.46e6 x 3600) = 2,854 tokens/s per GPU; pricing that
    # speed on 8 GPUs gives the same hours back
    per_gpu = 15e12 / (1.46e6 * 3600)
    got = cost.training_cost(8 * per_gpu, 8, 15e12, 2.0)
    assert got["cost_device_hours"] == pytest.approx(1.46e6)
    assert got["cost_usd"] == pytest.approx(2.92e6)
    assert got["cost_wall_days"] == pytest.approx(1.46e6 / 8 / 24)


def test_a_row_is_priced_at_its_measured_speed_else_its_prediction():
    row = {"plan_devices": 4, "predicted_tokens_per_s": 400.0, "tokens_per_s": None}
    got = cost.cost_columns(row, 1.44e6, 1.0)  # 3,600 s on 4 devices
    assert got["cost_basis"] == "predicted tokens/s" and got["cost_devices"] == 4
    assert got["cost_device_hours"] == pytest.approx(4.0) and got["cost_usd"] == pytest.approx(4.0)
    measured = cost.cost_columns({**row, "tokens_per_s": 800.0, "plan_devices": None, "mesh_devices": 2}, 1.44e6, 1.0)
    assert measured["cost_basis"] == "measured tokens/s" and measured["cost_device_hours"] == pytest.approx(1.0)
    none = cost.cost_columns({"mesh_devices": 1}, 1e9, None)
    assert none["cost_device_hours"] is None and none["cost_basis"].startswith("no speed")
    assert cost.cost_columns(row, None, 2.0) == {}


@pytest.mark.parametrize("args", [(0.0, 1, 1e9, None), (10.0, 0, 1e9, None), (10.0, 1, 0.0, None), (10.0, 1, 1e9, -1)])
def test_impossible_inputs_raise(args):
    with pytest.raises(ValueError, match="training_cost"):
        cost.training_cost(*args)


def test_a_price_without_tokens_is_one_line_with_exit_2(capsys, tmp_path):
    code = run.main(["run", "--config", "configs/bf16.py:tiny", "--gpu_hour_usd", "2", "--output_root", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == (
        "jaxscale: error: --gpu_hour_usd: prices a whole training; add --train_tokens (e.g. --train_tokens 15e12)\n"
    )


def test_a_plan_prints_and_keeps_the_cost_of_its_training(capsys, tmp_path):
    args = ["run", "--config", f"{CONFIGS}/bf16_remat.py:tiny", "--plan", "--name", "cost", "--output_root",
            str(tmp_path), "--train_tokens", "1e9", "--gpu_hour_usd", "2"]  # fmt: skip
    assert run.main(args) == 0
    row = json.loads((tmp_path / "traces" / "cost" / "result.json").read_text())
    seconds = 1e9 / row["predicted_tokens_per_s"]  # one device: the CPU's predicted step
    assert row["cost_basis"] == "predicted tokens/s" and row["cost_devices"] == 1
    assert row["cost_device_hours"] == pytest.approx(seconds / 3600)
    assert row["cost_usd"] == pytest.approx(2 * seconds / 3600)
    assert f"training cost of 1e+09 tokens: {row['cost_device_hours']:,.0f} device-hours" in capsys.readouterr().out


def test_the_committed_llama_costs_are_what_docs_published_md_says():
    """experiments/results/training_cost: Llama 3.1 8B on 8 and 70B on 64 planned H100s at 15T tokens and $2; the
    hours recomputed by hand from each row's predicted tokens/s and devices, and quoted in the doc."""
    doc = (CONFIGS.parent / "docs" / "published.md").read_text()
    for name, meta_hours in (("llama3.1-8b_h100_x8", 1.46e6), ("llama3.1-70b_h100_x64", 7.0e6)):
        row = json.loads((CONFIGS.parent / "experiments" / "results" / "training_cost" / f"{name}.json").read_text())
        hours = row["plan_devices"] * 15e12 / row["predicted_tokens_per_s"] / 3600
        assert row["cost_device_hours"] == pytest.approx(hours) and row["cost_usd"] == pytest.approx(2 * hours)
        per_gpu = row["predicted_tokens_per_s"] / row["plan_devices"]
        assert f"| {per_gpu:,.0f} ({row['predicted_mfu']:.1%}) | {hours:,.0f} |" in doc
        assert f"| {hours / meta_hours:.2f} |" in doc
    # the cost's plan is the fit's row of the same choice at 2 sequences per GPU (docs/models.md): the same program
    row = json.loads(
        (CONFIGS.parent / "experiments" / "results" / "training_cost" / "llama3.1-8b_h100_x8.json").read_text()
    )
    fit = CONFIGS.parent / "experiments" / "results" / "fit_bf16_remat_llama3.1-8b_flash_h100_x8" / "results.jsonl"
    (same,) = [
        r
        for r in map(json.loads, fit.read_text().splitlines())
        if r["variant"] == "block_save_dot_with_context_except_mlp"
    ]
    assert same["fit_largest_minibatch"] == 2 and row["config.data.batch_size"] == 2 * row["plan_devices"]
    assert same["compiled_peak_bytes"] == pytest.approx(row["compiled_peak_bytes"], rel=1e-6)
    assert same["predicted_tokens_per_s"] == pytest.approx(row["predicted_tokens_per_s"], rel=1e-6)

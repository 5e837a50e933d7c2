"""The frameworks' memory accounting beside the lab's plans (docs/published.md), against hand counts."""

from __future__ import annotations

import pytest

from jaxscale.report import published_memory


def _row(**model) -> dict:
    return {f"config.model.{key}": value for key, value in model.items()}


def test_megatron_distributed_optimizer_and_activations_for_nemos_llama2_7b_by_hand():
    """NeMo 24.07's Llama 2 7B on 8 H100s (DP 8, MBS 1, sequence 4096, float32 main gradients), counted by hand from
    Megatron's documented bytes: 2 (bf16 weights) + 4 (float32 gradients) + 12/8 (main weights, two moments), and
    34 s b h a layer + the embedding's 8 s b + s b h + the output's (s b V + s b h) x 2, x 1.05."""
    published = {"project": "NVIDIA NeMo (24.07 container, Megatron-Core + Transformer Engine)", "n_gpus": 8,
                 "seq_len": 4096, "per_gpu_batch": 1, "layout": {"dp": 8, "cp": 1}, "precision": "bf16 + FP8",
                 "optimizer": "Adam (Apex distributed_fused_adam)"}  # fmt: skip
    row = {"params": 6_738_415_616, **_row(hidden_size=4096, num_layers=32, vocab_size=32000, num_experts=0)}
    got = published_memory.framework_accounting(published, row)
    assert got.weights == 13_476_831_232
    assert got.gradients == 26_953_662_464
    assert got.optimizer == 10_107_623_424
    # 32 x 570,425,344 + 16,809,984 + 295,698,432 = 18,566,119,424, x 1.05
    assert got.activations == pytest.approx(19_494_425_395.2, rel=1e-12)


def test_context_parallel_halves_the_sequence_a_gpu_holds():
    base = {"project": "NVIDIA NeMo", "n_gpus": 8, "seq_len": 8192, "per_gpu_batch": 1, "precision": "bf16",
            "optimizer": "Adam"}  # fmt: skip
    row = {"params": 1000, **_row(hidden_size=16, num_layers=2, vocab_size=100, num_experts=0)}
    cp2 = published_memory.framework_accounting({**base, "layout": {"cp": 2}}, row)
    # s = 4096: 2 x 34 x 4096 x 16 + 8 x 4096 + 4096 x 16 + (4096 x 100 + 4096 x 16) x 2 = 5,505,024
    assert cp2.activations == pytest.approx(5_505_024 * 1.05)


def test_expert_parameters_split_over_the_expert_axis_and_bf16_gradients_move_into_the_split_state():
    """A toy MoE (1,000 parameters, 2 layers of 4 experts of hidden 8 and expert width 4: 2 x 4 x 3 x 8 x 4 = 768
    expert parameters, 232 others) on 4 GPUs at EP 4, gradients reduced in bf16: 2 + 2 bytes on the 232 + 768 / 4
    a GPU holds, and 16 bytes of split state over 232 / 4 dense and 768 / 4 / 1 expert parameters."""
    published = {"project": "NVIDIA Megatron-Bridge", "n_gpus": 4, "seq_len": 16, "per_gpu_batch": 1,
                 "layout": {"ep": 4}, "precision": "bf16", "optimizer": "Megatron distributed optimizer, gradients "
                 "reduced in bf16 (grad_reduce_in_fp32 False)"}  # fmt: skip
    row = {"params": 1000, **_row(hidden_size=8, num_layers=2, vocab_size=10, num_experts=4, moe_hidden_size=4,
                                  first_dense_layers=0)}  # fmt: skip
    got = published_memory.framework_accounting(published, row)
    assert (got.weights, got.gradients, got.optimizer) == (848, 848, 4000)


def test_fsdp2_splits_sixteen_bytes_a_parameter_and_keeps_each_layers_input():
    published = {
        "project": "NVIDIA NeMo AutoModel (PyTorch FSDP2)",
        "n_gpus": 8,
        "seq_len": 4096,
        "per_gpu_batch": 4,
        "layout": {"fsdp": 8, "ep": 8},
        "precision": "bf16",
        "optimizer": "Adam",
    }
    row = {"params": 800, **_row(hidden_size=2048, num_layers=48, vocab_size=10, num_experts=0)}
    got = published_memory.framework_accounting(published, row)
    assert (got.weights, got.gradients, got.optimizer) == (400, 400, 800)
    assert got.activations == 2 * 4096 * 4 * 2048 * 48


def test_a_framework_without_an_accounting_here_has_none():
    published = {"project": "torchtitan", "n_gpus": 8, "seq_len": 8192, "per_gpu_batch": 1, "layout": {},
                 "precision": "bf16", "optimizer": "AdamW"}  # fmt: skip
    row = {"params": 1000, **_row(hidden_size=8, num_layers=2, vocab_size=10)}
    assert published_memory.framework_accounting(published, row) is None


def test_the_runs_chosen_are_those_whose_first_sight_did_not_fit_the_card_they_ran_on():
    runs = [
        {"id": "a", "first_sight": {"plan_fits": False, "plan_peak_gib": 97.6}},
        {"id": "b", "first_sight": {"plan_fits": True, "plan_peak_gib": 40.0}},
        {"id": "c", "first_sight": {"plan_fits": False, "plan_peak_gib": 59.6}, "gpu_memory_gib": 96},  # a 96 GB card
        {"id": "d"},  # not registered
    ]
    assert [run["id"] for run in published_memory.selected(runs)] == ["a"]

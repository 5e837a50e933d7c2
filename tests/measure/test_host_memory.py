"""jaxscale.measure.host_memory: host and device bytes of a step with offloaded state, against a hand count."""

from __future__ import annotations

import pytest

from jaxscale.config import base_config
from jaxscale.measure import kernels, memory
from jaxscale.plan import gpu_plan, target_compile, targets
from jaxscale.train import sharding

needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")

# The tiny GPT's parameters by hand (hidden 64, 2 layers, 4 heads of 16, MLP 256, vocabulary 128, 32 positions):
# token and position embeddings 128*64 + 32*64; per layer QKV 64*4*48 + 4*48, out 4*16*64 + 64, two LayerNorms
# 4*64, up 64*256 + 256, down 256*64 + 64; the final LayerNorm 2*64 and the head 64*128 + 128.
TINY_LAYER = 64 * 4 * 48 + 4 * 48 + 4 * 16 * 64 + 64 + 4 * 64 + 64 * 256 + 256 + 256 * 64 + 64
TINY_PARAMS = 128 * 64 + 32 * 64 + 2 * TINY_LAYER + 2 * 64 + 64 * 128 + 128
# Adam's state: float32 mu and nu per parameter, an int32 step count, and the schedule's int32 count.
TINY_ADAM_BYTES = 2 * 4 * TINY_PARAMS + 2 * 4


def _config(offload_state: bool, offload_params: bool = False):
    config = base_config("tiny", "host")
    config.model.dropout_rate = 0.0
    config.optimizer.offload_state, config.train.offload_params = offload_state, offload_params
    return config


@pytest.mark.parametrize("offload_params", [False, True])
def test_a_cpu_plan_counts_the_host_state_from_the_programs_memory_spaces(offload_params):
    """The CPU backend's memory_analysis() keeps every host_* field 0 and counts the host arrays as arguments: the
    program's S(5) marks give them, equal to the hand count, and the device's peak is the plan's less them."""
    placement = sharding.placement(_config(True, offload_params))
    compiled = placement.step().lower(*placement.abstract_inputs()).compile()
    row = memory.compiled_memory(compiled)
    hand = TINY_ADAM_BYTES + 4 * TINY_PARAMS * offload_params
    assert compiled.memory_analysis().host_argument_size_in_bytes == 0
    assert row["compiled_host_bytes_source"] == "hlo_memory_space"
    assert row["compiled_host_argument_bytes"] == row["compiled_host_output_bytes"] == hand
    assert row["compiled_device_peak_bytes"] == row["compiled_peak_bytes"] - hand
    analytic = memory.analytic_memory(_config(True, offload_params))
    assert analytic["analytic_host_offload_bytes"] == hand - 8  # the analytic model counts no step counters


def test_a_plan_without_offload_has_no_host_bytes():
    placement = sharding.placement(_config(False))
    row = memory.compiled_memory(placement.step().lower(*placement.abstract_inputs()).compile())
    assert row["compiled_host_argument_bytes"] == 0 and row["compiled_host_bytes_source"] is None
    assert row["compiled_device_peak_bytes"] == row["compiled_peak_bytes"]


@needs_extra
def test_a_deviceless_h100_plan_separates_the_host_state_and_moves_it_once_a_step():
    """The H100 plan (XLA's own analysis) keeps the offloaded state out of the device's arguments: the device's
    argument bytes drop by the hand count, which is the plan's host arguments; the compiled program sends the new
    state back to the host in device_to_host transfers of exactly those bytes."""
    text = targets.target_config_text(targets.get_target("h100"))
    plain = target_compile.compile_for_target(_config(False), text, 1, "cublas")
    offloaded = target_compile.compile_for_target(_config(True), text, 1, "cublas")
    assert offloaded["compiled_host_bytes_source"] == "compiled"
    assert offloaded["compiled_host_argument_bytes"] == offloaded["compiled_host_output_bytes"] == TINY_ADAM_BYTES
    assert plain["compiled_argument_bytes"] - offloaded["compiled_argument_bytes"] == TINY_ADAM_BYTES
    found = kernels.from_dicts(offloaded["kernels"])
    sent = sum(k.times * k.host_bytes for k in found if k.detail == "device_to_host")
    assert sent == TINY_ADAM_BYTES
    assert not any(k.host_bytes for k in kernels.from_dicts(plain["kernels"]))


@needs_extra
def test_an_offloaded_activation_crosses_the_link_one_layer_slice_at_a_time():
    """Per-activation offload under nn.scan (the tiny GPT: 2 layers; 2 minibatches of 4 sequences of 32 positions;
    hidden 64; bf16): XLA writes each layer's attention output into a stacked host buffer [2, 4, 32, 64] with an
    async dynamic-update-slice and reads it back with an async dynamic-slice in the backward pass. Each launch moves
    one layer's slice, 4 x 32 x 64 x 2 = 16,384 bytes, with its device-side scalars (the four s32 indices and the
    async context's u32: 20 bytes), once per layer and minibatch each way (trips 2 x 2); not the whole host buffer
    per launch, which the first count charged (the whole stacked buffer in and out on every launch)."""
    config = base_config("tiny", "host")
    config.model.dropout_rate, config.model.scan_layers = 0.0, True
    config.model.remat, config.model.remat_policy = ("Block",), "per_activation:out_proj=offload"
    result = target_compile.compile_for_target(config, targets.target_config_text(targets.get_target("h100")), 1,
                                               "cublas")  # fmt: skip
    moving = [k for k in kernels.from_dicts(result["kernels"]) if k.host_bytes]
    slice_bytes = 4 * 32 * 64 * 2 + 4 * 4 + 4
    assert sorted(k.detail for k in moving) == ["device_to_host", "host_to_device"]
    assert all(k.host_bytes == slice_bytes and k.trips == (2, 2) for k in moving), moving


@needs_extra
def test_offloaded_parameters_are_read_in_place_once_a_minibatch_and_written_back_once():
    """The one account of train.offload_params (jaxscale.train.offload), held to the H100 plan of the tiny GPT
    (unrolled, no remat, autodiff's residuals, 2 minibatches; P = 4 x TINY_PARAMS bytes of float32 parameters, S =
    TINY_ADAM_BYTES): the program has no host-to-device transfer (the parameters are never copied to the device whole);
    the new parameters and state go back to the host once (device_to_host transfers of P + S); and the kernels that read
    host memory in place read P + S once (the optimizer's update) and P once a minibatch (each minibatch's forward pass
    casts the weights to bf16 from host memory; its backward pass reuses the casts), within 2% of P: the backward pass's
    reductions also read a few small tensors in place (the LayerNorms' 64-wide vectors, the embeddings' gradient fusion:
    5,116 bytes, 1.1% of P, read from the compiled kernels). Reading the weights twice a minibatch would be
    100% of P more."""
    config = _config(True, True)
    config.model.residuals = "autodiff"  # closed_form would recompute the MLP, reading its weights again (docs)
    text = targets.target_config_text(targets.get_target("h100"))
    result = target_compile.compile_for_target(config, text, 1, "cublas")
    params, state = 4 * TINY_PARAMS, TINY_ADAM_BYTES
    assert result["compiled_host_argument_bytes"] == result["compiled_host_output_bytes"] == params + state
    found = [k for k in kernels.from_dicts(result["kernels"]) if k.host_bytes]
    assert not [k for k in found if k.detail == "host_to_device"]
    assert sum(k.times * k.host_bytes for k in found if k.detail == "device_to_host") == params + state
    read_in_place = sum(k.times * k.host_bytes for k in found if k.category != "copy")
    assert read_in_place == pytest.approx(params + state + 2 * params, abs=0.02 * params)


def test_the_committed_8b_offloaded_parameters_row_moves_what_docs_say():
    """docs/finetune.md: in the committed Llama 3.1 8B H100 row with the parameters and Adam's state on the host, the
    host link carries about 3.5 times the host state a step (read from the row: predicted_host_link_bytes over
    compiled_host_argument_bytes), more than the two transfers a whole copy in and out would be."""
    import json

    from conftest import REPO

    path = REPO / "experiments" / "results" / "finetune_levers_llama3.1-8b_h100_mem95" / "results.jsonl"
    [row] = [r for r in map(json.loads, path.open()) if r["variant"] == "full_offload_params:block"]
    ratio = row["predicted_host_link_bytes"] / row["compiled_host_argument_bytes"]
    assert round(ratio * 2) / 2 == 3.5 and ratio > 2
    assert "`predicted_host_link_bytes` is about 3.5 times the host state" in " ".join(
        (REPO / "docs" / "finetune.md").read_text().split()
    )

"""jaxscale.measure.collectives: the collectives of a compiled step (one parse for the row's columns and the
kernels the step-time predictor costs), with trip counts, per-device sizes and replica group sizes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
from conftest import xla_flags_with
from test_hlo import MODULE  # a single-device module: no collectives

from jaxscale.measure import collectives, hlo, kernels
from jaxscale.plan import predict, targets

# A sharded step in miniature: a loop of 3 iterations whose body all-gathers a weight (async pair, as GPUs
# compile it) and runs a reduce-scatter wrapped in async-start/async-done; after the loop a combined
# (tuple) all-reduce over groups of 4, and a collective-permute.
SHARDED = """HloModule sharded, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p: bf16[64,16]) -> bf16[8,16] {
  %p = bf16[64,16]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = bf16[8,16]{1,0} reduce-scatter(%p), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%body (arg: (s32[], f32[2,16])) -> (s32[], f32[2,16]) {
  %arg = (s32[], f32[2,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %w = f32[2,16]{1,0} get-tuple-element(%arg), index=1
  %ag-start = (f32[2,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%w), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}
  %ag-done = f32[16,16]{1,0} all-gather-done(%ag-start)
  %g = bf16[64,16]{1,0} parameter(1)
  %rs-start = ((bf16[64,16]{1,0}), bf16[8,16]{1,0}) async-start(%g), calls=%wrapped_reduce_scatter
  %rs-done = bf16[8,16]{1,0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  ROOT %t = (s32[], f32[2,16]{1,0}) tuple(%i, %w)
}

%cond (arg.1: (s32[], f32[2,16])) -> pred[] {
  %arg.1 = (s32[], f32[2,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[2,16], b: f32[100], c: bf16[10]) -> f32[2,16] {
  %a = f32[2,16]{1,0} parameter(0)
  %b = f32[100]{0} parameter(1)
  %c = bf16[10]{0} parameter(2)
  %k = s32[] constant(0)
  %init = (s32[], f32[2,16]{1,0}) tuple(%k, %a)
  %while.1 = (s32[], f32[2,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = (f32[100]{0}, bf16[10]{0}) all-reduce(%b, /*index=1*/%c), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %cp = f32[2,16]{1,0} collective-permute(%a), source_target_pairs={{0,1},{1,0}}
  ROOT %out = f32[2,16]{1,0} get-tuple-element(%while.1), index=1
}
"""  # noqa: E501


def test_collectives_are_counted_with_trip_counts_sizes_and_groups():
    module = hlo.parse(SHARDED)
    assert module.num_partitions == 8
    found = {c.kind: c for c in collectives.count_collectives(module)}
    assert set(found) == set(collectives.COLLECTIVE_KINDS) - {"all-to-all"}
    gather = found["all-gather"]  # an async pair counted once, at its start, sized by its done
    assert (gather.executions, gather.operand_bytes, gather.result_bytes, gather.group_size) == (3, 128, 1024, 8)
    assert gather.bytes == 1024 and gather.ring_bytes == 7 / 8 * 1024
    scatter = found["reduce-scatter"]  # inside async-start's computation, not counted again at async-done
    assert (scatter.executions, scatter.bytes, scatter.group_size) == (3, 64 * 16 * 2, 8)
    reduce = found["all-reduce"]  # a combined all-reduce: every operand of the tuple (after /*index*/ markers)
    assert (reduce.executions, reduce.bytes, reduce.group_size) == (1, 400 + 20, 4)
    assert reduce.ring_bytes == 2 * 3 / 4 * 420
    permute = found["collective-permute"]
    assert (permute.bytes, permute.group_size, permute.ring_bytes) == (128, None, 128)


def test_collective_columns_sum_executions_times_bytes():
    row = collectives.collective_columns(SHARDED)
    assert row["compiled_collective_all_gather_count"] == 3
    assert row["compiled_collective_all_gather_bytes"] == 3 * 1024
    assert row["compiled_collective_reduce_scatter_bytes"] == 3 * 2048
    # The float32 part, by hand from the dtypes above: the gathered f32[16,16], none of the bf16 reduce-scatter,
    # the f32[100] of the combined (f32, bf16) all-reduce, the f32[2,16] permuted.
    assert row["compiled_collective_all_gather_f32_bytes"] == 3 * 16 * 16 * 4
    assert row["compiled_collective_reduce_scatter_f32_bytes"] == 0
    assert row["compiled_collective_all_reduce_f32_bytes"] == 100 * 4
    assert row["compiled_collective_collective_permute_f32_bytes"] == 2 * 16 * 4
    assert row["compiled_collective_all_to_all_count"] == 0
    assert row["compiled_collective_count"] == 3 + 3 + 1 + 1
    assert row["compiled_collective_bytes"] == 3 * 1024 + 3 * 2048 + 420 + 128
    ring = 3 * 7 / 8 * 1024 + 3 * 7 / 8 * 2048 + 2 * 3 / 4 * 420 + 128
    assert row["compiled_collective_ring_bytes"] == round(ring)
    assert collectives.collective_columns(MODULE)["compiled_collective_count"] == 0  # one device: none


# The forms of a GPU target's HLO (an A5000 plan of the tiny model on 8 devices, shortened) and of newer XLA:
# in a loop of 2, a combined all-gather (one -start/-done pair gathering two arrays; mesh axes printed
# without quotes), a combined reduce-scatter-start/-done pair, and an all-to-all-start/-done pair over a
# sub-axis of size 2; after the loop a fusion around a reduce-scatter (as a dynamic-slice fusion holds one).
GPU_SHARDED = """HloModule gpu_sharded, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_scatter (p: f32[64,16]) -> f32[8,16] {
  %p = f32[64,16]{1,0} parameter(0)
  ROOT %reduce-scatter.9 = f32[8,16]{1,0} reduce-scatter(%p), channel_id=9, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%body (arg: (s32[], bf16[8], bf16[8,32], f32[64], f32[64,4], s32[2,32])) -> (s32[], bf16[8], bf16[8,32], f32[64], f32[64,4], s32[2,32]) {
  %arg = (s32[], bf16[8]{0}, bf16[8,32]{1,0}, f32[64]{0}, f32[64,4]{1,0}, /*index=5*/s32[2,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %a = bf16[8]{0} get-tuple-element(%arg), index=1
  %b = bf16[8,32]{1,0} get-tuple-element(%arg), index=2
  %g = f32[64]{0} get-tuple-element(%arg), index=3
  %h = f32[64,4]{1,0} get-tuple-element(%arg), index=4
  %t = s32[2,32]{1,0} get-tuple-element(%arg), index=5
  %ag-start = ((bf16[8]{0}, bf16[8,32]{1,0}), (bf16[64]{0}, bf16[64,32]{1,0})) all-gather-start(%a, %b), channel_id=1, replica_groups=mesh[axis_0=8,axis_1=1] {axis_0}, dimensions={0}, use_global_device_ids=true
  %ag-done = (bf16[64]{0}, bf16[64,32]{1,0}) all-gather-done(%ag-start)
  %rs-start = ((f32[64]{0}, f32[64,4]{1,0}), (f32[8]{0}, f32[8,4]{1,0})) reduce-scatter-start(%g, %h), channel_id=2, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %rs-done = (f32[8]{0}, f32[8,4]{1,0}) reduce-scatter-done(%rs-start)
  %a2a-start = ((s32[2,32]{1,0}), s32[2,32]{1,0}) all-to-all-start(%t), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}, dimensions={0}
  %a2a-done = s32[2,32]{1,0} all-to-all-done(%a2a-start)
  ROOT %out = (s32[], bf16[8]{0}, bf16[8,32]{1,0}, f32[64]{0}, f32[64,4]{1,0}, /*index=5*/s32[2,32]{1,0}) tuple(%i, %a, %b, %g, %h, %t)
}

%cond (arg.1: (s32[], bf16[8], bf16[8,32], f32[64], f32[64,4], s32[2,32])) -> pred[] {
  %arg.1 = (s32[], bf16[8]{0}, bf16[8,32]{1,0}, f32[64]{0}, f32[64,4]{1,0}, /*index=5*/s32[2,32]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p0: (s32[], bf16[8], bf16[8,32], f32[64], f32[64,4], s32[2,32]), w: f32[64,16]) -> f32[8,16] {
  %p0 = (s32[], bf16[8]{0}, bf16[8,32]{1,0}, f32[64]{0}, f32[64,4]{1,0}, /*index=5*/s32[2,32]{1,0}) parameter(0)
  %w = f32[64,16]{1,0} parameter(1)
  %loop = (s32[], bf16[8]{0}, bf16[8,32]{1,0}, f32[64]{0}, f32[64,4]{1,0}, /*index=5*/s32[2,32]{1,0}) while(%p0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %scatter_fusion = f32[8,16]{1,0} fusion(%w), kind=kCustom, calls=%fused_scatter
}
"""  # noqa: E501


def test_gpu_async_pairs_are_sized_by_their_whole_tuples():
    found = {c.name: c for c in collectives.count_collectives(hlo.parse(GPU_SHARDED))}
    assert set(found) == {"ag-start", "rs-start", "a2a-start", "scatter_fusion"}  # each -done belongs to its -start
    gather = found["ag-start"]  # a combined all-gather works on both gathered arrays, not only the largest
    assert (gather.kind, gather.executions, gather.group_size) == ("all-gather", 2, 8)
    assert (gather.operand_bytes, gather.result_bytes) == (2 * 8 + 2 * 8 * 32, 2 * 64 + 2 * 64 * 32)
    scatter = found["rs-start"]  # a reduce-scatter's buffer is its operands, before scattering
    assert (scatter.kind, scatter.executions, scatter.group_size) == ("reduce-scatter", 2, 8)
    assert (scatter.bytes, scatter.result_bytes) == (4 * 64 + 4 * 64 * 4, 4 * 8 + 4 * 8 * 4)
    to_all = found["a2a-start"]  # over the sub-axis 'axis_1':(2)2: groups of 2
    assert (to_all.kind, to_all.executions, to_all.bytes, to_all.group_size) == ("all-to-all", 2, 4 * 2 * 32, 2)
    fused = found["scatter_fusion"]  # a fusion around a collective runs it
    assert (fused.kind, fused.executions, fused.bytes, fused.group_size) == ("reduce-scatter", 1, 4 * 64 * 16, 8)


def test_an_async_done_launches_no_kernel_of_its_own():
    found = kernels.kernels(GPU_SHARDED)
    assert [k.name for k in found] == ["ag-start", "rs-start", "a2a-start", "scatter_fusion"]
    assert all(k.category == "collective" for k in found)


# Compiled on 4 simulated CPU devices (XLA_FLAGS must be set before jax is imported: a child process): on a
# 2x2 mesh, a psum over axis "a" of a replicated f32[1024] and an all-gather over both axes of f32[256] shards.
_SIMULATED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
def step(x, y):
    return jax.lax.psum(x, "a"), jax.lax.all_gather(y, ("a", "b"), tiled=True)
mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("a", "b"))), out_specs=(P(), P()), check_vma=False)
array = jax.ShapeDtypeStruct((1024,), jnp.float32)
print(jax.jit(mapped).lower(array, array).compile().as_text())
"""


@functools.cache
def simulated_collectives_hlo() -> str:
    """The optimized HLO of _SIMULATED: one all-reduce over groups of 2, one all-gather over all 4 devices."""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=4"), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _SIMULATED], capture_output=True, text=True, env=env, check=True,
                          timeout=300)  # fmt: skip
    return done.stdout


def test_a_compiled_all_reduce_and_all_gather_have_the_ring_bytes_of_the_closed_form():
    """Known arrays on simulated devices: the buffers are 1024 float32 = 4096 bytes per device, and a ring over
    n devices sends 2(n-1)/n of it for an all-reduce, (n-1)/n for an all-gather (nccl-tests PERFORMANCE.md)."""
    text = simulated_collectives_hlo()
    found = sorted(k.collective for k in kernels.kernels(text) if k.collective is not None)
    assert found == [("all-gather", 4, 4096), ("all-reduce", 2, 4096)]
    row = collectives.collective_columns(text)
    assert (row["compiled_collective_all_reduce_count"], row["compiled_collective_all_gather_count"]) == (1, 1)
    assert row["compiled_collective_bytes"] == 8192
    # all-reduce over 2: 2 * 1/2 * 4096 = 4096 bytes; all-gather over 4: 3/4 * 4096 = 3072 bytes
    assert row["compiled_collective_ring_bytes"] == 4096 + 3072


def test_the_collectives_of_a_program_compiled_on_simulated_devices_are_costed_on_their_links():
    """On an A5000 target: the all-reduce over 2 devices sends 4096 ring bytes over the NVLink bridge
    (4096 / 56.25e9 = 72.818 ns), the all-gather over 4 sends 3072 over PCIe (3072 / 31.5e9 = 97.524 ns)."""
    found = [k for k in kernels.kernels(simulated_collectives_hlo()) if k.collective is not None]
    columns = predict.predict(found, predict.gpu_roofline(targets.TARGETS["a5000"]))
    assert columns["predicted_collective_s"] == pytest.approx(170.342e-9, rel=1e-4)


@pytest.mark.parametrize(
    "attributes,size",
    [
        ("replica_groups=[2,4]<=[8]", 4),  # iota: 2 groups of 4
        ("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", 2),
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
        ("replica_groups={}", 8),  # every device
        ("channel_id=1", 8),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 4),
        ("replica_groups=mesh[axis_0=2,axis_1=4] {axis_0,axis_1}", 8),  # newer XLA prints names without quotes
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}", 2),  # a sub-axis: its own size
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}", 2),  # permuted
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0','axis_1'}", 8),
    ],
)
def test_replica_group_forms_give_the_devices_per_group(attributes, size):
    assert collectives.group_size(f"channel_id=7, {attributes}, dimensions={{0}}", num_partitions=8) == size


@pytest.mark.parametrize(
    "pairs,span",
    [
        ("{{0,1},{1,0}}", 2),  # neighbours in a pair of devices
        ("{{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}", 8),  # two stages of 4 devices: within 8
        ("{{0,8},{8,16},{16,24},{24,0}}", 32),  # four stages of 8 (a host each), the last hop back to the first
        ("{{7,8}}", 16),  # neighbours across a host boundary of 8: the block of 16 holding both
        ("{}", 1),
    ],
)
def test_a_permutes_pairs_reach_the_aligned_block_that_holds_both_ends(pairs, span):
    assert collectives.pair_span(f"channel_id=3, source_target_pairs={pairs}, metadata={{}}") == span
    assert collectives.pair_span("channel_id=3, replica_groups={}") is None


def test_a_permute_across_hosts_is_priced_at_one_nic_and_within_a_host_on_nvlink():
    """H100 (targets: NVLink 450 GB/s a direction within the 8 GPUs of a host, one 400 Gb/s NIC = 50 GB/s a GPU): a
    pipeline's 1 MiB hop from GPU 0 to GPU 8 takes 2^20 / 50e9 s, and from GPU 0 to GPU 1 2^20 / 450e9 s."""
    roof = predict.gpu_roofline(targets.TARGETS["h100"])
    assert (roof.network_bytes_per_s, roof.link_bytes_per_s) == (50e9, 450e9)

    def permute(span):
        kernel = kernels.Kernel(name="cp", category="collective", detail="collective-permute", trips=(), times=1,
                                flops=0.0, flop_dtype="vector", bytes_read=2**20, bytes_written=2**20,
                                collective=("collective-permute", span, 2**20))
        return predict.predict([kernel], roof)["predicted_collective_s"]  # fmt: skip

    assert permute(16) == pytest.approx(2**20 / 50e9)
    assert permute(2) == pytest.approx(2**20 / 450e9)

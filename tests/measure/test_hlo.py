"""jaxscale.hlo: matmul FLOPs with loop trip counts and op categories, on a small hand-written module."""

from __future__ import annotations

from jaxscale.measure import hlo

# A loop of 3 iterations whose body runs one [8,16]x[16,4] dot (2*8*4*16 = 1024 FLOPs) inside a fusion,
# and an entry that runs one [8,16]x[16,4] dot directly, a copy, and a dynamic-update-slice fusion.
MODULE = """HloModule test, is_scheduled=true

%fused_dot (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_dus (p0: f32[3,8,4], p1: f32[1,8,4], p2: s32[]) -> f32[3,8,4] {
  %p0 = f32[3,8,4]{2,1,0} parameter(0)
  %p1 = f32[1,8,4]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[3,8,4]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %zero, %zero)
}

%body (arg: (s32[], f32[8,16], f32[16,4])) -> (s32[], f32[8,16], f32[16,4]) {
  %arg = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %w = f32[16,4]{1,0} get-tuple-element(%arg), index=2
  %mm_fusion = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/checkpoint/rematted_computation/dot_general"}
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) tuple(%i, %x, %w)
}

%cond (arg.1: (s32[], f32[8,16], f32[16,4])) -> pred[] {
  %arg.1 = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,16], b: f32[16,4], s: f32[3,8,4], u: f32[1,8,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %s = f32[3,8,4]{2,1,0} parameter(2)
  %u = f32[1,8,4]{2,1,0} parameter(3)
  %k = s32[] constant(1)
  %init = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) tuple(%k, %a, %b)
  %while.1 = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %copy.1 = f32[8,16]{1,0} copy(%a)
  %dus_fusion = f32[3,8,4]{2,1,0} fusion(%s, %u, %k), kind=kLoop, calls=%fused_dus
  ROOT %dot.2 = f32[8,4]{1,0} dot(%copy.1, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""  # noqa: E501


def test_parse_reads_computations_shapes_and_operands():
    module = hlo.parse(MODULE)
    assert module.entry == "main"
    assert set(module.computations) == {"fused_dot", "fused_dus", "body", "cond", "main"}
    dot = module.computations["main"]["dot.2"]
    assert dot.opcode == "dot" and dot.operands == ["copy.1", "b"]
    assert hlo.dims(dot.shape) == (8, 4)
    assert hlo.dims(module.computations["main"]["while.1"].shape) == ()  # a tuple's first element: s32[]
    assert module.computations["main"]["while.1"].trip_count == 3


def test_loop_bodies_are_multiplied_by_their_trip_count():
    count = hlo.count_matmul_flops(hlo.parse(MODULE))
    one_dot = 2 * 8 * 4 * 16
    assert count.matmul_flops_once == 2 * one_dot  # entry dot + loop body counted once, like XLA's cost analysis
    assert count.matmul_flops == (1 + 3) * one_dot  # the body runs three times
    assert (count.while_loops, count.matmul_loops, count.unknown_trip_counts) == (1, 1, 0)


def test_ops_are_categorised_by_what_they_run():
    table = hlo.op_table(hlo.parse(MODULE))
    assert table["dot.2"] == ("matmul", False)
    assert table["mm_fusion"] == ("matmul", True)  # a fusion around a dot, recomputed by remat
    assert table["dus_fusion"][0] == "dynamic_update_slice"
    assert table["copy.1"][0] == "copy"
    assert table["while.1"][0] == "control_flow"
    assert "dot.1" not in table  # instructions inside fusions never run as ops of their own


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
    found = {c.kind: c for c in hlo.count_collectives(module)}
    assert set(found) == set(hlo.COLLECTIVE_KINDS) - {"all-to-all"}
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
    from jaxscale.measure import collectives

    row = collectives.collective_columns(SHARDED)
    assert row["compiled_collective_all_gather_count"] == 3
    assert row["compiled_collective_all_gather_bytes"] == 3 * 1024
    assert row["compiled_collective_reduce_scatter_bytes"] == 3 * 2048
    assert row["compiled_collective_all_to_all_count"] == 0
    assert row["compiled_collective_count"] == 3 + 3 + 1 + 1
    assert row["compiled_collective_bytes"] == 3 * 1024 + 3 * 2048 + 420 + 128
    ring = 3 * 7 / 8 * 1024 + 3 * 7 / 8 * 2048 + 2 * 3 / 4 * 420 + 128
    assert row["compiled_collective_ring_bytes"] == round(ring)
    assert collectives.collective_columns(MODULE)["compiled_collective_count"] == 0  # one device: none


def test_shape_bytes_reads_arrays_and_tuples():
    assert hlo.shape_bytes("bf16[8,32]{1,0}") == 512
    assert hlo.shape_bytes("(f32[4]{0}, /*index=1*/s8[3], pred[])") == 16 + 3 + 1
    assert hlo.shape_bytes("token[]") == 0

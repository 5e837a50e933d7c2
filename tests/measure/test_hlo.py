"""jaxscale.measure.hlo: matmul FLOPs with loop trip counts and op categories, on a small hand-written module."""

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


def test_shape_bytes_reads_arrays_and_tuples():
    assert hlo.shape_bytes("bf16[8,32]{1,0}") == 512
    assert hlo.shape_bytes("(f32[4]{0}, /*index=1*/s8[3], pred[])") == 16 + 3 + 1
    assert hlo.shape_bytes("token[]") == 0


def test_operand_bytes_sums_the_operands_the_computation_defines():
    main = hlo.parse(MODULE).computations["main"]
    assert hlo.operand_bytes(main["dot.2"], main) == 4 * 8 * 16 + 4 * 16 * 4  # f32[8,16] and f32[16,4]
    # the dynamic-update-slice fusion: f32[3,8,4], f32[1,8,4] and the s32[] index
    assert hlo.operand_bytes(main["dus_fusion"], main) == 4 * 3 * 8 * 4 + 4 * 8 * 4 + 4
    assert hlo.operand_bytes(main["a"], main) == 0  # a parameter has no operands


def test_a_conditional_counts_one_of_its_branches():
    """lax.cond between two matmuls of the same size inside a 3-step loop: the program runs one branch a step,
    so 3 x 2·8·16·32 FLOPs (hand count), not both branches' twice that; each branch's ops run 3 x 1/2 times."""
    import jax
    import jax.numpy as jnp

    def step(carry, i):
        x, w = carry
        y = jax.lax.cond(i % 2 == 0, lambda: x @ w, lambda: (2 * x) @ w)  # [8, 16] @ [16, 32]
        return (x + y[:, :16], w), None

    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    text = jax.jit(lambda x, w: jax.lax.scan(step, (x, w), jnp.arange(3))[0]).lower(x, w).compile().as_text()
    module = hlo.parse(text)
    assert hlo.count_matmul_flops(module).matmul_flops == 3 * 2 * 8 * 16 * 32
    branch_ops = [s for s in hlo.executed(module) if s.share != 1]
    assert branch_ops and {s.share for s in branch_ops} == {0.5} and {s.times for s in branch_ops} == {1.5}

"""jaxscale.measure.kernels: the kernels a compiled step launches, with loop trips, FLOPs and boundary bytes."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest
from conftest import load_config

from jaxscale import run
from jaxscale.measure import flops, hlo, kernels

# The forms XLA's GPU compiler emits (copied from an A5000 target's optimized HLO, shortened): a cuBLAS
# GEMM returning (result, workspace), a Triton GEMM fusion, a dynamic-slice fusion reading one layer of a
# stacked buffer, an in-place dynamic-update-slice fusion, all in a loop of 3; an all-reduce over groups of
# 4 of 8 devices in the entry.
GPU_MODULE = """HloModule gpu, is_scheduled=true, num_partitions=8

%gemm_computation (p0: bf16[64,32], p1: bf16[16,32]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%slice_layer (s0: bf16[3,64,32], s1: s32[]) -> bf16[1,64,32] {
  %s0 = bf16[3,64,32]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,32]{2,1,0} dynamic-slice(%s0, %s1, %zero, %zero), dynamic_slice_sizes={1,64,32}
  ROOT %copy.2 = bf16[1,64,32]{2,1,0} copy(%ds)
}

%update_layer (u0: f32[3,64,16], u1: bf16[64,16], u2: s32[]) -> f32[3,64,16] {
  %u0 = f32[3,64,16]{2,1,0} parameter(0)
  %u1 = bf16[64,16]{1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  %cv = f32[64,16]{1,0} convert(%u1)
  %bc = f32[1,64,16]{2,1,0} bitcast(%cv)
  ROOT %dus = f32[3,64,16]{2,1,0} dynamic-update-slice(%u0, %bc, %u2, %zero.1, %zero.1)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%body (arg: (s32[], bf16[3,64,32], bf16[16,32], f32[3,64,16])) -> (s32[], bf16[3,64,32], bf16[16,32], f32[3,64,16]) {
  %arg = (s32[], bf16[3,64,32]{2,1,0}, bf16[16,32]{1,0}, f32[3,64,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[3,64,32]{2,1,0} get-tuple-element(%arg), index=1
  %w = bf16[16,32]{1,0} get-tuple-element(%arg), index=2
  %acc = f32[3,64,16]{2,1,0} get-tuple-element(%arg), index=3
  %layer = bf16[1,64,32]{2,1,0} fusion(%x, %i), kind=kCustom, calls=%slice_layer, backend_config={"fusion_backend_config":{"kind":"__custom_fusion"}}
  %flat = bf16[64,32]{1,0} bitcast(%layer)
  %cublas = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(%flat, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]}}}
  %y = bf16[64,16]{1,0} get-tuple-element(%cublas), index=0
  %triton = bf16[64,16]{1,0} fusion(%flat, %w), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %updated = f32[3,64,16]{2,1,0} fusion(%acc, %y, %i), kind=kLoop, calls=%update_layer
  ROOT %t = (s32[], bf16[3,64,32]{2,1,0}, bf16[16,32]{1,0}, f32[3,64,16]{2,1,0}) tuple(%i, %x, %w, %updated)
}

%cond (c: (s32[], bf16[3,64,32], bf16[16,32], f32[3,64,16])) -> pred[] {
  %c = (s32[], bf16[3,64,32]{2,1,0}, bf16[16,32]{1,0}, f32[3,64,16]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x0: bf16[3,64,32], w0: bf16[16,32], g: f32[1024]) -> f32[1024] {
  %x0 = bf16[3,64,32]{2,1,0} parameter(0)
  %w0 = bf16[16,32]{1,0} parameter(1)
  %g = f32[1024]{0} parameter(2)
  %k = s32[] constant(0)
  %zeros = f32[3,64,16]{2,1,0} broadcast(f32[] constant(0)), dimensions={}
  %init = (s32[], bf16[3,64,32]{2,1,0}, bf16[16,32]{1,0}, f32[3,64,16]{2,1,0}) tuple(%k, %x0, %w0, %zeros)
  %loop = (s32[], bf16[3,64,32]{2,1,0}, bf16[16,32]{1,0}, f32[3,64,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %ar = f32[1024]{0} all-reduce(%g), replica_groups=[2,4]<=[8], to_apply=%sum
}
"""  # noqa: E501


def _by_name(found: list[kernels.Kernel]) -> dict[str, kernels.Kernel]:
    return {k.name: k for k in found}


def test_gpu_kernels_are_listed_with_their_loop_trips_and_nothing_else_launches():
    found = _by_name(kernels.kernels(GPU_MODULE))
    assert set(found) == {"layer", "cublas", "triton", "updated", "lt", "zeros", "ar"}  # no tuple, gte, bitcast
    assert found["cublas"].trips == found["triton"].trips == (3,) and found["cublas"].times == 3
    assert found["lt"].trips == (4,)  # the loop condition runs once more than the body
    assert found["zeros"].trips == found["ar"].trips == ()


def test_gemms_from_cublas_and_triton_count_the_same_flops_and_dtype():
    found = _by_name(kernels.kernels(GPU_MODULE))
    for name in ("cublas", "triton"):
        assert found[name].category == "matmul"
        assert found[name].flops == 2 * 64 * 16 * 32 and found[name].gemm == (1, 64, 16, 32)
        assert found[name].flop_dtype == "bf16"
    assert found["cublas"].detail == "__cublas$lt$matmul"
    assert found["triton"].detail == "__triton_nested_gemm_fusion"
    # The cuBLAS workspace (s8[4194304]) is scratch, not traffic: bf16 A (64x32) and B (16x32) in, C out.
    assert found["cublas"].bytes_read == 2 * (64 * 32 + 16 * 32) and found["cublas"].bytes_written == 2 * 64 * 16


def test_a_slice_reads_only_its_slice_and_an_update_writes_only_its_update():
    found = _by_name(kernels.kernels(GPU_MODULE))
    layer, updated = found["layer"], found["updated"]
    assert layer.bytes_read == 2 * 64 * 32 + 4  # one layer of the bf16[3,64,32] buffer (and the s32 index)
    assert updated.category == "dynamic_update_slice"
    assert updated.bytes_read == 2 * 64 * 16 + 4  # the bf16 update; the f32[3,64,16] buffer is updated in place
    assert updated.bytes_written == 4 * 64 * 16  # one f32 layer, not the whole stacked buffer


def test_a_collective_knows_its_group_and_payload():
    ar = _by_name(kernels.kernels(GPU_MODULE))["ar"]
    assert ar.category == "collective" and ar.collective == ("all-reduce", 4, 4 * 1024)


def test_an_elementwise_op_reads_and_writes_its_arrays_once():
    compiled = jax.jit(lambda x: jnp.tanh(x) * 2.0 + 1.0).lower(jnp.ones((256, 128))).compile()
    (kernel,) = kernels.kernels(compiled.as_text())
    assert kernel.category == "fusion" and kernel.flop_dtype == "vector"
    assert kernel.bytes_read == kernel.bytes_written == 4 * 256 * 128
    assert kernel.flops == 3 * 256 * 128  # tanh, multiply, add per element


@pytest.fixture(scope="module")
def tiny_step():
    config = load_config("bf16", "tiny")  # scanned layers, 2 minibatches accumulated with lax.scan
    compiled, *_ = run.compile_step(config)
    return config, compiled.as_text()


def test_the_train_steps_gemms_sit_in_the_minibatch_and_layer_loops(tiny_step):
    config, text = tiny_step
    found = kernels.kernels(text)
    gemms = collections.Counter(k.trips for k in found if k.category == "matmul")
    minibatches, layers = config.train.num_minibatches, config.model.num_layers
    # Per layer and minibatch: 6 forward matmuls (qkv, logits, values, out, up, down) and 12 for their
    # gradients; per minibatch, the output head's forward and its two gradients.
    assert gemms == {(minibatches, layers): 18, (minibatches,): 3}
    assert all(k.times == minibatches * layers for k in found if k.trips == (minibatches, layers))


def test_the_kernels_gemm_flops_equal_the_loop_aware_matmul_count(tiny_step):
    config, text = tiny_step
    found = kernels.kernels(text)
    per_step = sum(k.times * k.flops for k in found if k.category == "matmul")
    assert per_step == hlo.count_matmul_flops(hlo.parse(text)).matmul_flops
    assert per_step == flops.hardware_flops_per_step(config)
    assert kernels.summary(found)["matmul"]["flops"] == per_step


def test_kernels_survive_the_trip_through_json(tiny_step):
    _, text = tiny_step
    found = kernels.kernels(text)
    assert kernels.from_dicts(kernels.as_dicts(found)) == found


def test_replica_groups_in_each_form_give_the_group_size():
    """The three forms XLA prints (checked on a 2x2 CPU mesh for the list and mesh forms)."""
    module = """HloModule sharded, num_partitions=4

ENTRY %main (p: f32[16,128]) -> (f32[16,128], f32[32,128], f32[64,128]) {
  %p = f32[16,128]{1,0} parameter(0)
  %listed = f32[16,128]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%sum
  %meshed = f32[32,128]{1,0} all-gather(%p), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2] {'axis_0'}, dimensions={0}
  %everyone = f32[64,128]{1,0} all-gather(%p), channel_id=3, replica_groups={}, dimensions={0}
  ROOT %t = (f32[16,128]{1,0}, f32[32,128]{1,0}, f32[64,128]{1,0}) tuple(%listed, %meshed, %everyone)
}
"""  # noqa: E501
    found = _by_name(kernels.kernels(module))
    assert found["listed"].collective == ("all-reduce", 2, 4 * 16 * 128)
    assert found["meshed"].collective == ("all-gather", 2, 4 * 32 * 128)  # the gathered result is the buffer
    assert found["everyone"].collective == ("all-gather", 4, 4 * 64 * 128)


def _fmha_config(dims: str, mask: str) -> str:
    """cuDNN's fused-attention backend config as XLA prints it (shortened; the dot dimension numbers left out)."""
    return (
        '{"operation_queue_id":"0","wait_on_operation_queues":[],"cudnn_fmha_backend_config":{"algorithm":'
        '{"algo_id":"0","math_type":"TENSOR_OP_MATH","tuning_knobs":{"17":"1","24":"0"},"is_cudnn_frontend":true,'
        '"workspace_size":"0"},"fmha_scale":0.125,"dropout_rate":0,"intermediate_tensor_shape":{"element_type":"BF16",'
        f'"dimensions":[{dims}],"tuple_shapes":[],"layout":{{"minor_to_major":["3","2","1","0"],"tiles":[]}}}},'
        f'"is_flash_attention":true,"mask_type":"{mask}"}}}}'
    )


# cuDNN's fused attention as jax.nn.dot_product_attention(implementation="cudnn") lowers it (forms copied from
# XLA's printed HLO, BTNH layout): llama3.2-1b's shapes, 4 sequences of 4096, 32 heads of 64; a causal forward
# and backward, and a forward without a mask with the spaced JSON some XLA versions print.
_CAUSAL = _fmha_config('"4","32","4096","4096"', "CAUSAL")
_FULL = _fmha_config('"4","32","4096","4096"', "NO_MASK").replace('":', '": ').replace('",', '", ')
CUDNN_MODULE = f"""HloModule cudnn, is_scheduled=true

ENTRY %main (q: bf16[4,4096,32,64], k: bf16[4,4096,32,64], v: bf16[4,4096,32,64], d: bf16[4,4096,32,64]) -> bf16[4,4096,32,64] {{
  %q = bf16[4,4096,32,64]{{3,2,1,0}} parameter(0)
  %k = bf16[4,4096,32,64]{{3,2,1,0}} parameter(1)
  %v = bf16[4,4096,32,64]{{3,2,1,0}} parameter(2)
  %d = bf16[4,4096,32,64]{{3,2,1,0}} parameter(3)
  %fwd = (bf16[4,4096,32,64]{{3,2,1,0}}, f32[4,32,4096]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{bf16[4,4096,32,64]{{3,2,1,0}}, bf16[4,4096,32,64]{{3,2,1,0}}, bf16[4,4096,32,64]{{3,2,1,0}}}}, api_version=API_VERSION_STATUS_RETURNING, backend_config={_CAUSAL}
  %o = bf16[4,4096,32,64]{{3,2,1,0}} get-tuple-element(%fwd), index=0
  %lse = f32[4,32,4096]{{2,1,0}} get-tuple-element(%fwd), index=1
  %bwd = (bf16[4,4096,32,64]{{3,2,1,0}}, bf16[4,4096,32,64]{{3,2,1,0}}, bf16[4,4096,32,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v, %lse, %d, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", api_version=API_VERSION_STATUS_RETURNING, backend_config={_CAUSAL}
  %full = (bf16[4,4096,32,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", api_version=API_VERSION_STATUS_RETURNING, backend_config={_FULL}
  ROOT %dq = bf16[4,4096,32,64]{{3,2,1,0}} get-tuple-element(%bwd), index=0
}}
"""  # noqa: E501


def test_cudnn_fused_attention_calls_count_their_matmuls_from_their_shapes():
    """B=4, H=32, T=S=4096, D=64, counted by hand: the forward's two matmuls (QK^T, PV) are
    2 · 2·4·32·4096·4096·64 = 549,755,813,888 FLOPs over the full square, half of it causal; the backward's
    five (FlashAttention-2's count) 2.5x the forward."""
    found = _by_name(kernels.kernels(CUDNN_MODULE))
    fwd, bwd, full = found["fwd"], found["bwd"], found["full"]
    assert fwd.category == bwd.category == full.category == "attention"
    assert (fwd.detail, bwd.detail) == ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    assert fwd.flop_dtype == bwd.flop_dtype == "bf16"
    assert fwd.attention == (2, 4, 32, 4096, 4096, 64, True)
    assert full.attention == (2, 4, 32, 4096, 4096, 64, False)
    assert full.flops == 549_755_813_888
    assert fwd.flops == 274_877_906_944
    assert bwd.flops == 687_194_767_360
    # Bytes at the boundary: q, k, v in (3 x 67,108,864 B); out and the float32 log-sum-exp (2,097,152 B) out.
    assert (fwd.bytes_read, fwd.bytes_written) == (201_326_592, 69_206_016)
    # The causality the backend config gives stands whatever the run's config says.
    assert kernels.resolve_causal([fwd, full], causal=False) == [fwd, full]


def test_a_custom_call_that_is_not_attention_stays_memory_traffic():
    module = CUDNN_MODULE.replace("__cudnn$fmhaSoftmaxBackward", "__my$kernel")
    found = _by_name(kernels.kernels(module))
    assert found["bwd"].category == "fusion" and found["bwd"].flops == 0 and found["bwd"].attention is None


# An async all-gather whose start and done enclose two fusions, then a second one with nothing between; a
# synchronous all-reduce last (the shapes of an FSDP step's gathers, shortened).
ASYNC_MODULE = """HloModule async, is_scheduled=true, num_partitions=4

%neg (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0} negate(%p)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main (w: bf16[256], x: f32[1024]) -> (bf16[1024], bf16[1024], f32[1024]) {
  %w = bf16[256]{0} parameter(0)
  %x = f32[1024]{0} parameter(1)
  %ag-start = (bf16[256]{0}, bf16[1024]{0}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %f1 = f32[1024]{0} fusion(%x), kind=kLoop, calls=%neg
  %f2 = f32[1024]{0} fusion(%f1), kind=kLoop, calls=%neg
  %ag-done = bf16[1024]{0} all-gather-done(%ag-start)
  %ag-start.2 = (bf16[256]{0}, bf16[1024]{0}) all-gather-start(%w), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %ag-done.2 = bf16[1024]{0} all-gather-done(%ag-start.2)
  %ar = f32[1024]{0} all-reduce(%f2), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%sum
  ROOT %t = (bf16[1024]{0}, bf16[1024]{0}, f32[1024]{0}) tuple(%ag-done, %ag-done.2, %ar)
}
"""  # noqa: E501


def test_an_async_collective_knows_the_kernels_between_its_start_and_its_done():
    found = kernels.kernels(ASYNC_MODULE)
    assert [k.name for k in found] == ["ag-start", "f1", "f2", "ag-start.2", "ar"]
    assert found[0].window == (1, 2)  # f1 and f2 run while the first gather does
    assert found[3].window == (4, 3)  # started and awaited back to back: nothing between
    assert found[4].window is None  # synchronous
    assert kernels.from_dicts(kernels.as_dicts(found)) == found


def test_scanned_layers_write_their_residuals_with_dynamic_update_slices_unrolled_ones_do_not(tiny_step):
    """The mechanism of the notebook's finding (a trace's DUS share, tests/measure/test_traces.py, -m slow): the
    scanned step stacks each layer's residuals into [layers, ...] buffers, dynamic-update-slices in the layer
    loop; the unrolled step keeps them as separate buffers. (bf16's step is tiny_step's: compiled once.)"""
    written = {}
    for name in ("bf16", "bf16_noscan"):
        text = tiny_step[1] if name == "bf16" else run.compile_step(load_config(name))[0].as_text()
        found = kernels.kernels(text)
        dus = [k for k in found if k.category == "dynamic_update_slice"]
        written[name] = sum(k.times * k.bytes_written for k in dus)
        if name == "bf16":
            assert any(len(k.trips) >= 2 for k in dus)  # inside the minibatch loop and the layer loop
    assert written["bf16"] > 0 and written["bf16"] > 3 * written["bf16_noscan"], written


# The loss's gradient as XLA's GPU compiler emits it (shortened from an A100 target's optimized HLO): a
# scatter-add of one value per token into its label's column of the [tokens, vocabulary] gradient, fused, in
# place on the buffer of its first operand; and the same scatter unfused.
SCATTER_MODULE = """HloModule scatter, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_scatter (p0: f32[64,1000], p1: s32[64]) -> f32[64,1000] {
  %p0 = f32[64,1000]{1,0} parameter(0)
  %p1 = s32[64]{0} parameter(1)
  %iota = s32[64,1]{1,0} iota(), iota_dimension=0
  %labels = s32[64,1]{1,0} bitcast(%p1)
  %at = s32[64,2]{1,0} concatenate(%iota, %labels), dimensions={1}
  %c = f32[] constant(-1)
  %updates = f32[64]{0} broadcast(%c), dimensions={}
  ROOT %scatter = f32[64,1000]{1,0} scatter(%p0, %at, %updates), update_window_dims={}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%sum
}

ENTRY %main (g: f32[64,1000], l: s32[64], at: s32[64,2], u: f32[64]) -> (f32[64,1000], f32[64,1000]) {
  %g = f32[64,1000]{1,0} parameter(0)
  %l = s32[64]{0} parameter(1)
  %at = s32[64,2]{1,0} parameter(2)
  %u = f32[64]{0} parameter(3)
  %fused = f32[64,1000]{1,0} fusion(%g, %l), kind=kInput, calls=%fused_scatter
  %plain = f32[64,1000]{1,0} scatter(%g, %at, %u), update_window_dims={}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%sum
  ROOT %t = (f32[64,1000]{1,0}, f32[64,1000]{1,0}) tuple(%fused, %plain)
}
"""  # noqa: E501


def test_a_scatter_updates_its_operand_in_place_moving_only_its_updates():
    found = _by_name(kernels.kernels(SCATTER_MODULE))
    fused, plain = found["fused"], found["plain"]
    # Fused: the 64 labels in (s32), the 64 gradient elements they add to (f32), those 64 elements out; not the
    # 64 x 1000 f32 buffer twice (512,000 bytes).
    assert (fused.bytes_read, fused.bytes_written) == (64 * 4 + 64 * 4, 64 * 4)
    # Unfused: the 64 updates and the 64 x 2 indices in, the 64 elements they combine with, the 64 out.
    assert (plain.bytes_read, plain.bytes_written) == (64 * 4 + 64 * 2 * 4 + 64 * 4, 64 * 4)

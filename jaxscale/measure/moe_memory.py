"""Activation bytes of a mixture of experts' layer (jaxscale.model.moe) for the analytic memory model, per dispatch.

jaxscale.measure.memory counts a MoE block's feed-forward with these terms instead of a dense SwiGLU's (Megatron-LM's
estimate treated MoE layers as dense, NVIDIA/Megatron-LM#1784). With N = b·s tokens on the device, E experts, k of
them a token, F one expert's width, C capacity slots per expert and sequence, p bytes per activation element:

- the router: its float32 probabilities [N, E] (the load-balancing loss and softmax routing read them) and the
  top-k weights (float32) and indices (int32) [N, k];
- dense: every expert's gate, up and silu(gate)·up [N, E, F] and outputs [N, E, H], and the combine weights [N, E];
- capacity: the dispatch and combine masks [b, s, E, C], the dispatched tokens [b, E, C, H], the experts'
  intermediates [b, E, C, F] and outputs [b, E, C, H]; under expert parallelism (mesh.expert > 1) the all-to-all
  moves the tokens from the rows' layout (b rows, E experts) to the experts' (b x expert rows, E / expert experts),
  the same b·E·C·H elements per device each side, so one exchange's second copy, p·b·E·C·H, is the transient
  `all_to_all_bytes` adds to the working set;
- scatter: capacity's slots filled by index: the dispatched tokens [b, E, C, H] and the experts' intermediates as
  capacity's, no masks, the choices' gathered outputs [N, k, H] and the slot rows' two int32 copies [N·k]; its
  exchange as capacity's;
- ragged: what a grouped GEMM needs: the sorted token copies [N·k, H], the experts' intermediates [N·k, F], their
  outputs unsorted [N·k, H] and the sort's two int32 permutations [N·k]. XLA's CPU and GPU backends do not compile
  `jax.lax.ragged_dot` so: they expand it over every expert (jaxscale.measure.expert_flops), and their plans are far
  larger than this count (docs/models.md, "Which dispatch on one GPU"); the count is what a grouped kernel keeps.

Scanned layers (nn.scan) keep, as loop outputs, what JAX's autodiff saves besides (listed with
jax.ad_checkpoint.print_saved_residuals of the MoE module): silu's three intermediates per F-wide tensor, the float32
copy of the router's input, the capacity dispatch's one-hot slots [b, s, k, E, C] (from which unrolled XLA recomputes
the masks inside its fusions), the dense dispatch's float32 one-hot [N, k, E], and the experts' compute-dtype weight
copies 3·(E / expert)·H·F·p. Tensor parallelism splits the F-wide tensors (the experts' "mlp" axis) t ways; the
shared experts and the RMSNorm are layer_memory.llama_mlp_residuals' (a dense SwiGLU of num_shared_experts x F).

The sizes are jaxscale.measure.activation_dims' (Dims, its MoEDims in d.moe); memory imports this module, not the
other way round.
"""

from __future__ import annotations

from jaxscale.measure.activation_dims import Dims

_FLOAT32 = _INT32 = 4


def _expert_rows(d: Dims) -> int:
    """Rows of the experts' tensors on one device: N·E (dense), b·E·C (capacity, scatter), N·k (ragged)."""
    m, n = d.moe, d.b * d.s
    return {"dense": n * m.e, "capacity": d.b * m.e * m.c, "scatter": d.b * m.e * m.c, "ragged": n * m.k}[m.dispatch]


def routed_residuals(d: Dims, scanned: bool) -> dict[str, int]:
    """Bytes the router and the routed experts keep for the backward pass, per MoE layer, by tensor (the module
    docstring); the RMSNorm and the shared experts are layer_memory.moe_mlp_residuals'."""
    m, n, rows = d.moe, d.b * d.s, _expert_rows(d)
    wide = d.p * rows * m.f // d.t  # one F-wide tensor of the experts
    out_rows = n * m.k if m.dispatch == "scatter" else rows  # scatter keeps its outputs gathered back to the choices
    terms = {
        "router_probs": _FLOAT32 * n * m.e,
        "routing": (_FLOAT32 + _INT32) * n * m.k,  # top-k weights and expert indices
        "expert_gate": wide,
        "expert_up": wide,
        "expert_hidden": wide,
        "expert_outputs": d.p * out_rows * d.h,  # the combine's backward (the routing weights' gradient) reads them
    }
    if m.dispatch == "dense":
        terms.update(combine_weights=d.p * n * m.e)
    elif m.dispatch == "capacity":
        terms.update(dispatch_mask=d.p * n * m.e * m.c, combine_mask=d.p * n * m.e * m.c, dispatched=d.p * rows * d.h)
    elif m.dispatch == "scatter":
        terms.update(dispatched=d.p * rows * d.h, slot_rows=2 * _INT32 * n * m.k)
    else:
        terms.update(sorted_tokens=d.p * rows * d.h, sort_indices=2 * _INT32 * rows)
    if scanned:
        terms.update(expert_silu_intermediates=3 * wide)
        terms.update(router_input=_FLOAT32 * n * d.h if d.kernel_casts else 0)  # h cast to float32 for the router
        terms.update(expert_kernel_casts=3 * (m.e // m.ep) * d.h * m.f * d.p // d.t if d.kernel_casts else 0)
        if m.dispatch == "capacity":
            terms.update(slot_one_hot=d.p * n * m.k * m.e * m.c)
        elif m.dispatch == "dense":
            terms.update(choice_one_hot=_FLOAT32 * n * m.k * m.e)
    return terms


def saved_bytes(d: Dims, kept: frozenset[str], by_type: bool, with_batch_dims: bool) -> int:
    """Bytes of the routed experts' tensors a remat policy keeps in a MoE layer (the shared experts' are memory's).

    By name (jax.checkpoint_policies.save_only_these_names): the experts' gate and up (mlp_gate, mlp_up) and their
    outputs (mlp_down), which the combine's backward reads (remat_policies.kept names no mlp_hidden). By the kind of
    dot (`by_type`; `with_batch_dims`: dots_saveable, else dots_with_no_batch_dims_saveable): the router's float32
    logits [N, E] always; the dense dispatch's gate, up and outputs (einsums without batch dimensions); the capacity
    dispatch's dispatched tokens, gate, up, outputs and combined output [N, H] only with batch dimensions (its
    einsums batch over the sequence or the expert), the scatter dispatch's the same but its tokens (a scatter, not a
    dot); nothing of ragged's (`ragged_dot` is not a dot_general).
    """
    m, rows = d.moe, _expert_rows(d)
    wide, outputs = d.p * rows * m.f // d.t, d.p * rows * d.h
    if not by_type:
        return wide * (("gate" in kept) + ("up" in kept)) + outputs * ("down" in kept)
    router = _FLOAT32 * d.b * d.s * m.e
    if m.dispatch == "dense":
        return router + 2 * wide + outputs + (d.p * d.b * d.s * d.h if with_batch_dims else 0)
    if m.dispatch in ("capacity", "scatter") and with_batch_dims:
        return router + 2 * wide + (2 if m.dispatch == "capacity" else 1) * outputs + d.p * d.b * d.s * d.h
    return router


def all_to_all_bytes(d: Dims) -> int:
    """The expert-parallel exchange's second copy of the capacity (or scatter) dispatch's tokens, p·b·E·C·H per device
    (the rows' b x E x C x H and the experts' (b·expert) x (E / expert) x C x H are the same size): 0 otherwise."""
    m = d.moe
    exchanged = m is not None and m.dispatch in ("capacity", "scatter") and m.ep > 1
    return d.p * d.b * m.e * m.c * d.h if exchanged else 0

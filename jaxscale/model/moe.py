"""Mixture of experts for the Llama family: a router, SwiGLU experts with stacked weights, three dispatches.

A block's SwiGLU MLP (jaxscale.model.llama) becomes `MoE`: the pre-RMSNorm input goes to a router (a float32
Dense to model.num_experts logits), each token to its top model.experts_per_token experts, and the output is
the routing-weighted sum of those experts' SwiGLU outputs (Shazeer et al. 2017, "Outrageously Large Neural
Networks", arXiv 1701.06538; Fedus et al. 2021, "Switch Transformers", arXiv 2101.03961). Optional shared experts
(model.num_shared_experts) are one dense SwiGLU beside the routed ones that every token goes through (Qwen2-MoE,
DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066).

The router's weights (model.moe_routing), as the Hugging Face modules compute them:
- "topk_softmax": the softmax of the top-k logits (Mixtral; HF's MixtralSparseMoeBlock takes the softmax over all
  experts and renormalises its top k, which is the same numbers).
- "softmax_topk": the top k of the softmax over all experts, not renormalised (OLMoE, norm_topk_prob false).
- "softmax_topk_norm": the same renormalised to sum to 1 (Qwen3-MoE, norm_topk_prob true).

The dispatch (model.moe_dispatch) decides how tokens reach their experts; all three compute the same function
(tests/model/test_moe.py: loss and gradients):
- "dense": every expert on every token, weighted by the routing weights (zero outside the top k): the reference,
  E / k times the routed FLOPs.
- "capacity": GShard / Switch's one-hot dispatch and combine einsums (Lepikhin et al. 2020, arXiv 2006.16668): each
  sequence is a group, each expert takes at most ceil(model.moe_capacity_factor x seq_len x k / E) tokens of it,
  first choices before second choices; the rest are dropped (the expert adds nothing for them; the residual keeps
  the token) and counted in the "moe_metrics" collection. With a factor large enough nothing drops.
- "scatter": the capacity dispatch's slots and drops, filled by a scatter and read back by a gather of the token
  choices' rows instead of the one-hot einsums, whose FLOPs and [B, T, E, C] masks grow with E x C (the
  quadratic term GShard's einsums have; scatter_dispatch says by how much for Qwen3-30B-A3B).
- "ragged": dropless: the token copies sorted by expert, the experts' matmuls as `jax.lax.ragged_dot` over the
  groups of sizes the router chose (MegaBlocks' grouped GEMM, Gale et al. 2022, arXiv 2211.15841), unsorted after.

The auxiliary losses are sown into the "aux_loss" collection, already weighted, each divided by the MoE layers so
that their sum is the mean over layers; the train step adds every leaf to the loss (jaxscale.train.step):
- load balancing (Switch, eq. 4; HF's load_balancing_loss_func): E x sum_e f_e x P_e, f_e the fraction of tokens
  whose top k includes e (summing to k, as HF counts it) and P_e the mean router probability of e; weight
  model.moe_aux_loss_weight. The product is not linear in the tokens, so where f and P are counted changes the
  function (model.moe_balance_scope): "minibatch" (the default) over every row of the minibatch, on every device
  together: one device and any mesh compute the same loss and gradients (under the step's per-device accumulation
  each device's f is averaged over the devices, a pmean of E floats a layer: jaxscale.model.axes.device_groups);
  "device" over each batch-splitting device's rows, the products averaged, as Megatron-Core's default `aux_loss` (a
  data-parallel rank's micro-batch) and HF's per-rank forward compute it, so the function depends on the mesh;
  "sequence" over each sequence, as DeepSeek-V2/V3 and Megatron-Core's `seq_aux_loss` do. Across the minibatches of
  an accumulated step the statistics are each minibatch's (Megatron-Core's `global_aux_loss` keeps a running
  average over them instead: whole-step statistics would need every minibatch's routing before the first backward
  pass).
- router z-loss (Zoph et al. 2022, "ST-MoE", arXiv 2202.08906, eq. 5): the mean of logsumexp(logits)^2; weight
  model.moe_z_loss_weight.

Parameters: "router/kernel" [H, E] named ("embed", "expert"), "experts/gate" and "experts/up" [E, H, F] named
("expert", "embed", "mlp"), "experts/down" [E, F, H] named ("expert", "mlp", "embed"), F = model.moe_hidden_size.
The experts' weights are cast to the compute dtype where they are used, their gradients summed in it
(model.reduce_dtype's float32 weight gradients cover the Dense projections only); frozen in NF4 (QLoRA,
finetune.frozen_dtype=nf4) they are dequantized inside each expert matmul (expert_einsum, expert_ragged_dot).

Expert parallelism (mesh.expert > 1; GShard, Lepikhin et al. 2020, arXiv 2006.16668): "expert" is split over the mesh's
expert axis (jaxscale.config.layout_rules), so each device holds E / mesh.expert experts (their gradients and
optimizer state too), and the batch is split over data x fsdp x expert, the expert-parallel devices being data
parallel everywhere else, where they shard the model state as FSDP does (every non-expert parameter's embed axis
over fsdp x context x expert). The capacity and scatter dispatches constrain their dispatched tokens [B, E, C, H] from
the batch's layout (rows over data x fsdp x expert) to the experts' ("batch_no_expert": rows over data x fsdp, E over
expert) and back: JAX's SPMD partitioner exchanges them by an all-to-all over the expert axis each way (the compiled
program's, tests/train/test_sharding_devices.py), and each device runs its own experts on every row's tokens for
them. With mesh.expert = 1 the constraints are not added (the partitioner's own layout, the program of old). The
dense and ragged dispatches take no constraint: the partitioner computes them correctly on the mesh by gathering
the experts' weights over the expert axis where it needs them (no token exchange: not expert-parallel compute).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxscale.config.spec import ModelConfig, capacity
from jaxscale.measure.expert_flops import EXPERT_SCOPE
from jaxscale.model import nf4, precision
from jaxscale.model.axes import batch_devices, constrain, mean_over_device_groups, mesh_axis_size, partitioned
from jaxscale.model.llama import Llama, LlamaAttention, rms_norm, swiglu
from jaxscale.model.stack import SOWN_COLLECTIONS, ResidualBlock, branch_output, whole_sequence

AUX_LOSS, METRICS = SOWN_COLLECTIONS  # the collections MoE sows into: weighted losses; metrics (dropped tokens)
EXPERT_NAMES = {  # the stacked weights' logical axis names
    "gate": ("expert", "embed", "mlp"),
    "up": ("expert", "embed", "mlp"),
    "down": ("expert", "mlp", "embed"),
}
# The capacity dispatch's [B, E, C, H] tokens: as the batch's rows lie (the dispatch and combine einsums, per row),
# and as the experts lie (the experts' matmuls); between the two the partitioner exchanges them by all-to-all.
BY_ROW = ("batch", None, None, None)
BY_EXPERT = ("batch_no_expert", "expert", None, None)


def route(logits: jax.Array, k: int, routing: str) -> tuple[jax.Array, jax.Array]:
    """The top-k experts of each token and their weights.

    Args:
      logits: [..., E] float32 router logits.
      k: experts per token.
      routing: a name of defaults.MOE_ROUTINGS (the module docstring says what each computes).

    Returns:
      (weights [..., k] float32, experts [..., k] int32), the experts in decreasing order of logit.
    """
    if routing == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts
    top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if routing == "softmax_topk_norm":
        top = top / top.sum(axis=-1, keepdims=True)
    return top, experts


def load_balancing_loss(
    logits: jax.Array, experts: jax.Array, groups: int = 1, every_device: bool = False
) -> jax.Array:
    """E x sum_e f_e x P_e: f_e the fraction of tokens routed to e (a token counts once for each of its k experts,
    so f sums to k and a uniform router scores k), P_e the mean softmax probability of e, each over a group of rows,
    the products averaged over the groups. f is a count (no gradient); the router learns through P (Switch
    Transformers, eq. 4).

    Args:
      logits: [B, ..., E] float32 router logits.
      experts: [B, ..., k] the experts each token was routed to.
      groups: how many equal groups of the B rows the statistics are taken over (1: all of them together).
      every_device: f averaged over the step's device groups (jaxscale.model.axes.mean_over_device_groups), so that
        under per-device accumulation it is the minibatch's; P stays the group's own (it is linear in the tokens:
        the devices' losses then average to the minibatch's).
    """
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1).reshape(groups, -1, num_experts).mean(axis=1)  # [G, E]
    routed = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=-2)  # [B, ..., E]
    fraction = jax.lax.stop_gradient(routed.reshape(groups, -1, num_experts).mean(axis=1))  # [G, E]
    if every_device:
        fraction = mean_over_device_groups(fraction)
    return num_experts * jnp.mean(jnp.sum(fraction * probs, axis=-1))


def balance_groups(scope: str, rows: int) -> int:
    """The groups of a minibatch's `rows` whose statistics the load-balancing loss takes apart, by
    model.moe_balance_scope: 1 (minibatch), the devices the rows are split over in context (device), each row
    (sequence)."""
    return {"minibatch": 1, "device": batch_devices(), "sequence": rows}[scope]


def z_loss(logits: jax.Array) -> jax.Array:
    """The router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE, eq. 5)."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def expert_einsum(spec: str, x: jax.Array, w: jax.Array | nf4.Nf4Kernel) -> jax.Array:
    """jnp.einsum(spec, x, w) of tokens `x` (compute dtype) and a stacked expert weight `w` (`Experts`' output: the
    compute dtype, or an NF4 view under finetune.frozen_dtype=nf4, dequantized inside the matmul: nf4.linear)."""
    if isinstance(w, nf4.Nf4Kernel):
        return nf4.linear(functools.partial(jnp.einsum, spec), x, w)
    return jnp.einsum(spec, x, w)


def expert_ragged_dot(x: jax.Array, w: jax.Array | nf4.Nf4Kernel, sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x, w, sizes) with `w` as in expert_einsum: [N k, in] x [E, in, out] -> [N k, out]."""
    if isinstance(w, nf4.Nf4Kernel):
        return nf4.linear(jax.lax.ragged_dot, x, w, sizes)
    return jax.lax.ragged_dot(x, w, sizes)


def expert_swiglu(x: jax.Array, w: dict, up: Callable, down: Callable) -> jax.Array:
    """The routed experts' SwiGLU on their tokens, down(silu(x gate) * (x up)), under EXPERT_SCOPE (the experts'
    matmuls, found by name in the compiled program: jaxscale.measure.expert_flops) and with the MLP's checkpoint
    names (mlp_gate, mlp_up, mlp_hidden, mlp_down) that the remat policies read.

    Args:
      x: the tokens as the dispatch lays them out.
      w: `Experts`' "gate", "up" and "down".
      up, down: (activations, stacked weight) -> product: the dispatch's matmul into the experts' width and back.
    """
    with jax.named_scope(EXPERT_SCOPE):
        gate = checkpoint_name(up(x, w["gate"]), "mlp_gate")
        lifted = checkpoint_name(up(x, w["up"]), "mlp_up")
        hidden = checkpoint_name(nn.silu(gate) * lifted, "mlp_hidden")
        return checkpoint_name(down(hidden, w["down"]), "mlp_down")


# The einsums of the dispatches whose experts see every token ([B, T, H] -> [B, T, E, F] -> [B, T, E, H]) and their
# [B, E, C, H] slots (capacity, scatter), for expert_swiglu.
_EVERY_TOKEN = (functools.partial(expert_einsum, "bth,ehf->btef"), functools.partial(expert_einsum, "btef,efh->bteh"))
_ON_SLOTS = (functools.partial(expert_einsum, "bech,ehf->becf"), functools.partial(expert_einsum, "becf,efh->bech"))


def dense_dispatch(h: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """Every expert on every token, their outputs summed with the routing weights (zero outside a token's top k).

    Args:
      h: [B, T, H] normalized activations (compute dtype).
      weights, experts: [B, T, k] from `route`.
      w: "gate", "up" [E, H, F] and "down" [E, F, H] in the compute dtype.

    Returns:
      [B, T, H].
    """
    num_experts = w["gate"].shape[0]
    out = checkpoint_name(expert_swiglu(h, w, *_EVERY_TOKEN), "moe_outputs")  # [B, T, E, H]
    combine = (jax.nn.one_hot(experts, num_experts, dtype=weights.dtype) * weights[..., None]).sum(axis=-2)
    return jnp.einsum("bteh,bte->bth", out, combine.astype(h.dtype))  # [B, T, H]


def capacity_dispatch(
    h: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array], factor: float
) -> tuple[jax.Array, jax.Array]:
    """GShard's dispatch: each sequence's tokens to [E, C] expert slots by one-hot einsums, the experts on their
    slots, the outputs combined back with the routing weights. A token's i-th choice takes the next free slot of
    its expert after every token's earlier choices (first choices first, then by position); a choice past the
    capacity C (`capacity`) is dropped.

    Args: as dense_dispatch; factor: model.moe_capacity_factor.

    Returns:
      ([B, T, H], the number of dropped token choices, a float32 scalar).
    """
    num_experts = w["gate"].shape[0]
    slots = capacity(experts.shape[1], experts.shape[2], num_experts, factor)
    routed, position, kept = slot_positions(experts, num_experts, slots)
    slot = jax.nn.one_hot(jnp.where(kept > 0, position, -1), slots, dtype=h.dtype)  # [B, T, k, E, C], 0 if dropped
    dispatch = slot.sum(axis=2)  # [B, T, E, C]: a token's k experts are distinct
    combine = (slot * weights.astype(h.dtype)[..., None, None]).sum(axis=2)  # [B, T, E, C]
    x = exchange(jnp.einsum("btec,bth->bech", dispatch, h), BY_ROW, BY_EXPERT)  # [B, E, C, H]
    out = expert_swiglu(checkpoint_name(x, "moe_dispatched"), w, *_ON_SLOTS)  # [B, E, C, H]
    out = checkpoint_name(exchange(out, BY_EXPERT, BY_ROW), "moe_outputs")
    dropped = (routed.sum() - kept.sum()).astype(jnp.float32)
    return jnp.einsum("btec,bech->bth", combine, out), dropped


def slot_positions(experts: jax.Array, num_experts: int, slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard's priority: each token choice's place in its expert's queue within its sequence, every token's first
    choice (by position) before any second choice.

    Args:
      experts: [B, T, k] the experts each token was routed to.
      num_experts: E; slots: C, the places an expert has per sequence.

    Returns:
      int32 (routed, position, kept), each [B, T, k, E]: routed one-hot, the choice's 0-based place in the queue of
      each expert (meaningful where routed), and routed where that place is below C (the choice is kept).
    """
    batch, seq, k = experts.shape
    routed = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [B, T, k, E]
    by_choice = routed.transpose(0, 2, 1, 3).reshape(batch, k * seq, num_experts)  # first choices first
    position = (jnp.cumsum(by_choice, axis=1) - 1).reshape(batch, k, seq, num_experts).transpose(0, 2, 1, 3)
    return routed, position, routed * (position < slots)


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, M, H] at rows index [B, N] of each sequence -> [B, N, H]; index M (one past the last row) reads zeros."""
    padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.take_along_axis(padded, index[..., None], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def move_rows(x: jax.Array, index: jax.Array, back: jax.Array, group: int) -> jax.Array:
    """take_rows(x, index) whose gradient is a gather too: take_rows(cotangent, back) summed over `group` consecutive
    rows, where `back` [B, M * group] is the inverse of `index` (row m of x went to the rows back[m*group:(m+1)*group]
    of the result; N where it went nowhere). JAX's own transpose of a gather is a scatter-add into a zero buffer,
    which XLA creates with the forward pass's (one multi-output fusion of broadcasts) when the layers are not scanned,
    so every layer's [B, E x C, H] zeros were held from the forward pass to the backward (OLMoE unrolled: about 20h a
    token a layer over the closed form); a gather needs none."""
    return take_rows(x, index)


def _move_rows_fwd(x, index, back, group):
    return take_rows(x, index), (back, x.shape[1])


def _move_rows_bwd(group, residuals, cotangent):
    back, rows = residuals
    gathered = take_rows(cotangent, back)  # [B, M * group, H]
    gathered = gathered.reshape(gathered.shape[0], rows, group, gathered.shape[-1]).sum(axis=2)
    return gathered, None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def scatter_dispatch(
    h: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array], factor: float
) -> tuple[jax.Array, jax.Array]:
    """The capacity dispatch's function (the same slots, the same drops) by index instead of one-hot einsums:
    each kept token choice goes to row e x C + place of a [B, E x C, H] buffer, the experts run on their
    [B, E, C, H] slots as in capacity_dispatch (exchanged the same way under expert parallelism), and each choice
    gathers its slot's output back. GShard's one-hot einsums cost 2 x T x E x C x H FLOPs a sequence each way,
    which with many experts exceeds the experts' own matmuls (Qwen3-30B-A3B, 128 experts: C = 320 at factor
    1.25 and sequence 4096, 6.9e11 FLOPs an einsum against 3.1e11 for the experts' forward), and its [B, T, E, C]
    masks are held for the backward pass; the two gathers (`move_rows`: each slot reads its token, each choice its
    slot's output, and their gradients read back the other way) move T x k x H elements each way.

    Args: as capacity_dispatch.

    Returns:
      ([B, T, H], the number of dropped token choices, a float32 scalar).
    """
    batch, seq, k = experts.shape
    num_experts, hidden_size = w["gate"].shape[0], h.shape[-1]
    slots = capacity(seq, k, num_experts, factor)
    routed, position, kept = slot_positions(experts, num_experts, slots)
    place = (position * routed).sum(axis=-1)  # [B, T, k] the choice's place in its expert's queue
    keep = kept.sum(axis=-1) > 0  # [B, T, k]
    spill = num_experts * slots  # a dropped choice's row: reads zeros
    row = jnp.where(keep, experts * slots + place, spill).reshape(batch, seq * k)  # [B, T k]: choice t k + i's slot
    # each slot's choice (the inverse of row: a kept choice has a slot of its own), seq * k where the slot is empty
    choice = jax.vmap(lambda r: jnp.full((spill + 1,), seq * k, jnp.int32).at[r].set(
        jnp.arange(seq * k, dtype=jnp.int32))[:spill])(row)  # fmt: skip
    token = jnp.where(choice < seq * k, choice // k, seq)  # [B, E C]: the token each slot holds (seq: none)
    buffer = constrain(move_rows(h, token, row, k), BY_ROW[:3])  # [B, E C, H]: each row's slots where its tokens
    # are (else the partitioner may split the slot axis and all-reduce the gradient's sum)
    x = exchange(buffer.reshape(batch, num_experts, slots, hidden_size), BY_ROW, BY_EXPERT)
    out = expert_swiglu(checkpoint_name(x, "moe_dispatched"), w, *_ON_SLOTS)  # [B, E, C, H]
    out = constrain(exchange(out, BY_EXPERT, BY_ROW).reshape(batch, spill, hidden_size), BY_ROW[:3])
    gathered = move_rows(out, row, choice, 1).reshape(batch, seq, k, hidden_size)
    gathered = checkpoint_name(gathered, "moe_outputs")  # [B, T, k, H]: the choices' outputs, which the combine reads
    dropped = (routed.sum() - kept.sum()).astype(jnp.float32)
    return jnp.einsum("btkh,btk->bth", gathered, weights.astype(h.dtype)), dropped


def exchange(x: jax.Array, source: tuple, target: tuple) -> jax.Array:
    """`x` laid out as the logical names `source` say, then as `target` say: under expert parallelism (the mesh in
    context has an expert axis > 1) an all-to-all over it where the two differ; `x` itself otherwise."""
    if mesh_axis_size("expert") == 1:
        return x
    return constrain(constrain(x, source), target)


def ragged_dispatch(h: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """Dropless: the B x T x k token copies sorted by expert (stable), each expert's matmuls on its contiguous rows
    (`jax.lax.ragged_dot`, group sizes from the router), the outputs unsorted and summed with the weights.

    Args: as dense_dispatch.

    Returns:
      [B, T, H].
    """
    batch, seq, k = experts.shape
    num_experts, hidden_size = w["gate"].shape[0], h.shape[-1]
    flat = experts.reshape(-1)  # [N k]: token n's i-th choice at n k + i
    order = jnp.argsort(flat, stable=True)  # the copies grouped by expert
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)  # [E] rows per expert
    x = checkpoint_name(h.reshape(-1, hidden_size)[order // k], "moe_dispatched")  # [N k, H] sorted copies
    by_group = functools.partial(expert_ragged_dot, sizes=sizes)  # each expert's contiguous rows
    out = expert_swiglu(x, w, by_group, by_group)  # [N k, H]
    out = checkpoint_name(out[jnp.argsort(order)].reshape(batch, seq, k, hidden_size), "moe_outputs")  # unsorted
    return jnp.einsum("btkh,btk->bth", out, weights.astype(h.dtype))


class Experts(nn.Module):
    """The routed experts' stacked SwiGLU weights: gate, up [E, H, F] and down [E, F, H], float32, each expert
    initialised as a Dense (LeCun normal over its fan-in). Returned in the compute dtype (cast on their shard), except
    a frozen NF4 weight (QLoRA, finetune.frozen_dtype=nf4), whose view is returned as it is and dequantized inside each
    matmul that uses it (expert_einsum, expert_ragged_dot), one layer's at a time under nn.scan."""

    config: ModelConfig

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        cfg = self.config
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_width
        shapes = {"gate": (e, h, f), "up": (e, h, f), "down": (e, f, h)}
        init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        weights = {
            name: self.param(name, partitioned(init, EXPERT_NAMES[name]), shape) for name, shape in shapes.items()
        }
        return {name: w if isinstance(w, nf4.Nf4Kernel) else precision.compute_weight(cfg, w, EXPERT_NAMES[name])
                for name, w in weights.items()}  # fmt: skip


class SharedExperts(nn.Module):
    """model.num_shared_experts experts every token goes through: one SwiGLU of num_shared_experts x
    moe_hidden_size (DeepSeekMoE's shared experts concatenated; Qwen2-MoE's sigmoid gate on them is not built)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        cfg = self.config
        return swiglu(cfg, h, cfg.num_shared_experts * cfg.expert_width)  # [B, T, H]


class MoE(nn.Module):
    """Pre-RMSNorm mixture of experts in place of the SwiGLU MLP: router, routed experts (the dispatch of
    model.moe_dispatch), optional shared experts; sows its weighted auxiliary losses (module docstring)."""

    config: ModelConfig
    train: bool
    # every tensor its backward reads is tagged (jaxscale.model.stack.keeps_closed_form): the norm's output
    # (mlp_norm), the router's logits, the experts' tokens as they see them (moe_dispatched, but the dense dispatch's,
    # which are mlp_norm), gate, up and hidden, and the experts' outputs the combine reads (moe_outputs)
    names_backward_reads = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        with jax.named_scope("mlp"):
            h = whole_sequence(checkpoint_name(rms_norm(cfg, "pre_norm")(x), "mlp_norm"))  # [B, T, H]
            router = nn.Dense(cfg.num_experts, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
                              kernel_init=partitioned(nn.initializers.lecun_normal(), ("embed", "expert")),
                              name="router")  # fmt: skip
            logits = checkpoint_name(router(h.astype(jnp.float32)), "router_logits")  # [B, T, E] float32
            weights, experts = route(logits, cfg.experts_per_token, cfg.moe_routing)  # [B, T, k] each
            self._sow_losses(logits, experts)
            w = Experts(cfg, name="experts")()
            if cfg.moe_dispatch in ("capacity", "scatter"):
                by_slots = capacity_dispatch if cfg.moe_dispatch == "capacity" else scatter_dispatch
                out, dropped = by_slots(h, weights, experts, w, cfg.moe_capacity_factor)
                self.sow(METRICS, "dropped", dropped)
            elif cfg.moe_dispatch == "ragged":
                out = ragged_dispatch(h, weights, experts, w)
            else:
                out = dense_dispatch(h, weights, experts, w)
            if cfg.num_shared_experts:
                out = out + SharedExperts(cfg, name="shared")(h)
            return branch_output(cfg, constrain(out, ("batch", "seq", "embed")), self.train)  # [B, T, H]

    def _sow_losses(self, logits: jax.Array, experts: jax.Array) -> None:
        """The weighted load-balancing and z losses of this layer, each / the MoE layers (their mean over layers)."""
        cfg = self.config
        if cfg.moe_aux_loss_weight:
            groups = balance_groups(cfg.moe_balance_scope, logits.shape[0])
            loss = load_balancing_loss(logits, experts, groups, every_device=cfg.moe_balance_scope == "minibatch")
            self.sow(AUX_LOSS, "load_balance", cfg.moe_aux_loss_weight * loss / cfg.moe_layers)
        if cfg.moe_z_loss_weight:
            self.sow(AUX_LOSS, "router_z", cfg.moe_z_loss_weight * z_loss(logits) / cfg.moe_layers)


class MoELlamaBlock(ResidualBlock):
    """A Llama block whose MLP is the mixture of experts: grouped-query attention then MoE, each with its residual."""

    attn_block = LlamaAttention
    mlp_block = MoE


class MoELlama(Llama):
    """Llama with MoE blocks (the first model.first_dense_layers keep the SwiGLU MLP): what
    jaxscale.model.families.build makes when model.num_experts > 0."""

    block = MoELlamaBlock


def add_aux_losses(loss: jax.Array, sown: dict) -> jax.Array:
    """`loss` plus every leaf of the "aux_loss" collection in `sown` (the variables a `mutable` apply returned);
    `loss` itself, the same array, when nothing was sown (a dense model: its loss and gradients unchanged)."""
    leaves = jax.tree_util.tree_leaves(sown.get(AUX_LOSS, {}))
    return loss + sum(jnp.sum(leaf) for leaf in leaves) if leaves else loss

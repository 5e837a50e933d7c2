"""The named remat policies: what each saves for the backward pass, the one table the model, FLOPs and memory read.

Like `jax.checkpoint_policies`, one table of names -> policies (`POLICIES`): the model builds its jax.checkpoint
policy from an entry (`remat_policy`), and the analytic FLOP and memory models ask the same entry which tensors
it keeps (`kept`, `not_recomputed`) instead of restating it per policy.

The tags (jax.ad_checkpoint.checkpoint_name) both families put on their activations: `qkv_proj` (gpt's fused q,
k, v) or `query_proj`, `key_proj`, `value_proj` (llama's); `context` (the attention's output, before the out
projection) with the chunked and flash kernels' `attention_out` and `attention_lse` (their residuals,
docs/attention.md); `out_proj` (the out projection's output); `mlp_gate` (llama), `mlp_up` (the up projection's
output, before the activation); `mlp_hidden` (the down projection's input); `mlp_down` (the down projection's
output); `attn_norm` and `mlp_norm` (the two norms' outputs, the inputs of q, k, v and of gate and up). The analytic
models see a tag as the tensor it holds (`TAG_TENSORS`): q, k, v, logits (the T x T attention matrix), context (the
attention's output), out, gate, up, hidden, down, and the norms' outputs attn_norm and mlp_norm.

`CLOSED_FORM` is not a remat policy a user names: it is what a sub-block that no remat target covers keeps under
model.residuals=closed_form (jaxscale.model.stack.maybe_remat), the tensors its backward pass reads and nothing
else.
"""

from __future__ import annotations

import dataclasses

import jax

TAG_TENSORS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "query_proj": ("q",),
    "key_proj": ("k",),
    "value_proj": ("v",),
    "context": ("context",),
    "attention_out": ("context",),
    "attention_lse": ("context",),
    "out_proj": ("out",),
    "mlp_gate": ("gate",),
    "mlp_up": ("up",),
    "mlp_hidden": ("hidden",),
    "mlp_down": ("down",),
}
# The matmul outputs of each family's block ("logits" and "context" are the attention's two einsums, which have
# batch dimensions; the others are the weight matmuls, which have none).
FAMILY_TENSORS: dict[str, frozenset[str]] = {
    "gpt": frozenset({"q", "k", "v", "logits", "context", "out", "up", "down"}),
    "llama": frozenset({"q", "k", "v", "logits", "context", "out", "gate", "up", "down"}),
}
NORM_TENSORS = frozenset({"attn_norm", "mlp_norm"})  # the two norms' outputs: elementwise, no matmul's
_WEIGHT_DOTS = frozenset({"q", "k", "v", "out", "gate", "up", "down"})
_QKV = ("qkv_proj", "query_proj", "key_proj", "value_proj")
_CONTEXT = ("context", "attention_out", "attention_lse")
_WEIGHT_DOT_TAGS = (*_QKV, "out_proj", "mlp_gate", "mlp_up", "mlp_down")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """One named policy.

    Attributes:
      doc: what it keeps, with its source.
      names: family -> the checkpoint_name tags it saves on the device (jax.checkpoint_policies.save_only_these_names).
      builtin: the jax.checkpoint_policies attribute it is, where it is JAX's own (saving by the kind of dot).
      dots: the tensors a builtin saves by their kind of dot (every matmul output, or those without batch dims).
      offloads: the tags it moves to pinned host memory and back (save_and_offload_only_these_names).
    """

    doc: str
    names: dict[str, tuple[str, ...]] | None = None
    builtin: str | None = None
    dots: frozenset[str] = frozenset()
    offloads: tuple[str, ...] = ()


def _both(tags: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {"gpt": tags, "llama": tags}


# What a sub-block keeps for its backward pass at the closed form (model.residuals=closed_form): the tensors the
# backward reads, each once in the compute dtype (Korthikanti et al. 2022's accounting): the norm's output (its input
# is the sub-block's input, which a checkpoint keeps anyway), q, k and v, the attention kernel's output and
# log-sum-exp (flash and chunked name them), the MLP's up (and gate) projections' outputs and the down projection's
# input. The cheap elementwise work between them (the norm's float32 statistics, RoPE, GELU / silu, the casts) is
# recomputed in the backward pass, as MaxText's and Megatron's policies do; no matmul is.
CLOSED_FORM = RematPolicy(
    "keeps what the sub-block's backward pass reads: the norm's output, q, k, v, the attention output and "
    "log-sum-exp, the MLP's projections' outputs and the down projection's input; recomputes the elementwise rest",
    names={
        "gpt": ("attn_norm", "qkv_proj", "attention_out", "attention_lse", "mlp_norm", "mlp_up", "mlp_hidden"),
        "llama": (
            "attn_norm",
            "query_rotated",
            "key_rotated",
            "value_proj",
            "attention_out",
            "attention_lse",
            "mlp_norm",
            "mlp_gate",
            "mlp_up",
            "mlp_hidden",
            # a mixture of experts' MLP (jaxscale.model.moe): the router's float32 logits, the experts' tokens and the
            # outputs the combine reads (the routing itself, integer work, is recomputed)
            "router_logits",
            "moe_dispatched",
            "moe_outputs",
        ),
    },
)
OFFLOADED = "qkv_proj_offloaded"  # the policy that moves activations to pinned host memory
POLICIES: dict[str, RematPolicy] = {
    "nothing_saveable": RematPolicy("keeps nothing: recomputes the whole module (JAX)", builtin="nothing_saveable"),
    "dots_saveable": RematPolicy(
        "keeps every matmul's output, the attention's T x T logits included (JAX)",
        builtin="dots_saveable",
        dots=FAMILY_TENSORS["llama"],
    ),
    "dots_with_no_batch_dims_saveable": RematPolicy(
        "keeps the weight matmuls' outputs, not the attention einsums' (JAX; MaxText's old `minimal`)",
        builtin="dots_with_no_batch_dims_saveable",
        dots=_WEIGHT_DOTS,
    ),
    "save_qkv_proj": RematPolicy("keeps q, k and v (MaxText's `save_qkv_proj`)", names=_both(_QKV)),
    "save_out_proj": RematPolicy(
        "keeps the attention's out projection output (MaxText's `save_out_proj`)", names=_both(("out_proj",))
    ),
    "save_dot_with_context_except_mlp": RematPolicy(
        "keeps q, k, v, the attention output and the out projection's, none of the MLP's "
        "(MaxText's `save_dot_with_context_except_mlp`)",
        names=_both((*_QKV, *_CONTEXT, "out_proj")),
    ),
    "minimal_flash": RematPolicy(
        "keeps every weight matmul's output and the attention output (with flash or chunked, the kernel's "
        "output and log-sum-exp), recomputes the rest (MaxText's `minimal_flash` / `minimal_with_context`)",
        names=_both((*_WEIGHT_DOT_TAGS, *_CONTEXT)),
    ),
    "selective_op": RematPolicy(
        "keeps the outputs of every second matmul of the block in forward order (the 1st, 3rd, ...) and the "
        "attention output, never its T x T (torchtitan's selective op activation checkpointing, `_save_list`)",
        # gpt's matmuls: qkv, out, up, down; llama's: q, k, v, out, gate, up, down.
        names={
            "gpt": ("qkv_proj", "mlp_up", *_CONTEXT),
            "llama": ("query_proj", "value_proj", "mlp_gate", "mlp_down", *_CONTEXT),
        },
    ),
    OFFLOADED: RematPolicy(
        "moves q, k and v to pinned host memory and back for the backward pass (MaxText's "
        "`qkv_proj_offloaded`, jax.checkpoint_policies.save_and_offload_only_these_names)",
        offloads=_QKV,
    ),
}


# Per-activation policies: `model.remat_policy = "per_activation:qkv_proj=offload,context=device"` (pairs separated
# by `,` or `+`, the latter in a comma-separated flag such as fit's --remat) names, for each
# activation of the block, where its value waits for the backward pass: `device` (kept), `offload` (moved to pinned
# host memory and back) or `remat` (recomputed; any activation not named). MaxText's vocabulary
# (`remat_policy: custom` with `<name>: device | offload | remat`); the names group the tags above by family.
PER_ACTIVATION = "per_activation:"
ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": _QKV,
    "context": _CONTEXT,
    "out_proj": ("out_proj",),
    "mlp_gate": ("mlp_gate",),
    "mlp_up": ("mlp_up",),
    "mlp_hidden": ("mlp_hidden",),
    "mlp_down": ("mlp_down",),
}
PLACES = ("device", "offload", "remat")


def per_activation(name: str) -> RematPolicy:
    """The RematPolicy a `per_activation:` name spells.

    Raises:
      KeyError: the text after the prefix is not `activation=place` pairs of ACTIVATIONS and PLACES, each activation
        once (validation names the field and what is allowed).
    """
    pairs = [pair.split("=") for pair in name.removeprefix(PER_ACTIVATION).replace("+", ",").split(",") if pair]
    if not pairs or any(len(p) != 2 or p[0] not in ACTIVATIONS or p[1] not in PLACES for p in pairs):
        raise KeyError(name)
    if len({activation for activation, _ in pairs}) != len(pairs):
        raise KeyError(name)
    device = tuple(tag for activation, place in pairs if place == "device" for tag in ACTIVATIONS[activation])
    offload = tuple(tag for activation, place in pairs if place == "offload" for tag in ACTIVATIONS[activation])
    return RematPolicy(f"per activation: {name.removeprefix(PER_ACTIVATION)}", names=_both(device), offloads=offload)


def closed_form_units(model, context: int = 1) -> frozenset[str]:
    """The sub-blocks ("Attn", "MLP") of a layer that keep CLOSED_FORM: under model.residuals=closed_form those no
    remat target covers (neither they nor "Block" in model.remat), the attention only where its kernel names its
    residuals (flash and chunked, not on a context-parallel ring of `context` > 1 devices); a mixture of experts'
    MLP as a dense one (it tags what its backward reads: router_logits, moe_dispatched, moe_outputs). The one rule
    the model (jaxscale.model.stack.keeps_closed_form) and the memory model read.

    Args:
      model: the model config (jaxscale.config.spec.ModelConfig, or the config's `model` group).
      context: the devices of the context-parallel ring (mesh.context).
    """
    if model.residuals != "closed_form" or "Block" in model.remat:
        return frozenset()
    units = {"MLP"} - set(model.remat)
    if "Attn" not in model.remat and model.attention in ("flash", "chunked") and context == 1:
        units.add("Attn")
    return frozenset(units)


CLOSED_FORM_NAME = "closed_form"  # the name remat_policy and kept take for CLOSED_FORM (not one of POLICIES)


def lookup(name: str) -> RematPolicy:
    """POLICIES[name], CLOSED_FORM, or the per-activation policy a `per_activation:` name spells (KeyError for none)."""
    if name == CLOSED_FORM_NAME:
        return CLOSED_FORM
    return per_activation(name) if name.startswith(PER_ACTIVATION) else POLICIES[name]


def remat_policy(name: str, family: str):
    """The jax.checkpoint policy of POLICIES[name] for the model family `family`.

    Args:
      name: a key of POLICIES (an unknown name is a KeyError, caught by config validation).
      family: the model family ("gpt" or "llama").

    Returns:
      The policy object jax.checkpoint / nn.remat take.
    """
    policy = lookup(name)
    if policy.offloads:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(policy.names[family]) if policy.names else [],
            names_which_can_be_offloaded=list(policy.offloads),
            offload_src="device",
            offload_dst="pinned_host",
        )
    if policy.names is not None:
        return jax.checkpoint_policies.save_only_these_names(*policy.names[family])
    return getattr(jax.checkpoint_policies, policy.builtin)


def _tensors(tags: tuple[str, ...]) -> frozenset[str]:
    return frozenset(tensor for tag in tags for tensor in TAG_TENSORS[tag])


def kept(name: str, family: str) -> frozenset[str]:
    """The tensors of `family`'s block that POLICIES[name] keeps on the device for the backward pass.

    Args:
      name: a key of POLICIES.
      family: the model family.

    Returns:
      A subset of FAMILY_TENSORS[family] (a tag the family does not put, such as gpt's mlp_gate, keeps nothing).
    """
    policy = lookup(name)
    saved = policy.dots if policy.names is None else _tensors(policy.names[family])
    return saved & (FAMILY_TENSORS[family] | NORM_TENSORS)


def not_recomputed(name: str, family: str) -> frozenset[str]:
    """The tensors the backward pass gets back without recomputing them: those kept and those offloaded."""
    return kept(name, family) | (_tensors(lookup(name).offloads) & (FAMILY_TENSORS[family] | NORM_TENSORS))


def saves_by_dot_type(name: str) -> bool:
    """Whether the policy is one of JAX's that save matmul outputs by their kind (every dot without batch
    dimensions at least: a LoRA adapter's x @ A is kept too), not by name."""
    return bool(lookup(name).dots)

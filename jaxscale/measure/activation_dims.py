"""The sizes activation memory depends on, for one minibatch on one device: `Dims`, and a mixture of experts' `MoEDims`.

Both analytic activation counts read them: jaxscale.measure.memory (the attention, the dense MLP, the head, what a
remat policy keeps) and jaxscale.measure.moe_memory (the router and the routed experts, per dispatch). They are
derived from a run's typed view (jaxscale.config.spec.RunSpec), never from the config itself.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxscale.config import remat_policies
from jaxscale.config.spec import RunSpec, capacity

_BOOL = 1  # a dropout keep-mask element


@dataclasses.dataclass(frozen=True)
class MoEDims:
    """The mixture of experts' sizes that its activations depend on (Dims has the rest)."""

    e: int  # routed experts
    k: int  # experts per token
    f: int  # one routed expert's SwiGLU width (model.moe_hidden_size, else the MLP width)
    c: int  # capacity slots per expert per sequence (capacity dispatch)
    shared: int  # the shared experts' SwiGLU width: num_shared_experts x f (0: none)
    dispatch: str  # dense | capacity | scatter | ragged
    ep: int = 1  # expert-parallel ways (mesh.expert): the experts each device holds are e / ep

    @classmethod
    def from_spec(cls, run: RunSpec) -> MoEDims | None:
        """The run's MoE sizes; None for a dense model (model.num_experts = 0).

        Args:
          run: the run's typed view.

        Returns:
          The sizes, or None.
        """
        sizes = run.model
        if not sizes.num_experts:
            return None
        e, k = sizes.num_experts, sizes.experts_per_token
        return cls(
            e=e,
            k=k,
            f=sizes.expert_width,
            c=capacity(run.seq_len, k, e, sizes.moe_capacity_factor),
            shared=sizes.num_shared_experts * sizes.expert_width,
            dispatch=sizes.moe_dispatch,
            ep=run.mesh.expert,
        )


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes that activation memory depends on, for one minibatch on one device: Korthikanti et al.'s s, b, h,
    a and t."""

    b: int  # sequences per minibatch on one device (the minibatch split over mesh.data x mesh.fsdp x mesh.expert)
    s: int  # sequence length
    h: int  # hidden size
    a: int  # attention heads (query heads)
    k: int  # width of the keys and of the values: K/V heads x head_dim (h without grouped-query attention)
    f: int  # MLP hidden width
    v: int  # vocabulary
    p: int  # bytes per activation element (compute dtype)
    q: int  # bytes per attention-logit element (softmax dtype)
    mask: int  # bytes per dropout-mask element: 1, or 0 without dropout
    kernel_casts: bool  # compute dtype differs from the weights' (model.param_dtype): matmuls read cast copies
    attention: str  # reference | xla | cudnn | chunked | flash
    family: str  # gpt | llama
    t: int = 1  # tensor-parallel degree (mesh.tensor): heads, K/V heads, MLP width and vocabulary split t ways
    sp: int = 1  # ways the residual stream's positions are split (t under sequence parallelism, else 1)
    c: int = 0  # positions per chunk of the output head and loss (train.loss_chunk_len); 0: the whole sequence
    moe: MoEDims | None = None  # a mixture of experts' sizes: its layers' MLP is layer_memory.moe_mlp_residuals
    # the sub-blocks that keep the closed form (remat_policies.closed_form_units: model.residuals=closed_form)
    closed: frozenset[str] = frozenset()

    @property
    def fused_attention(self) -> bool:
        """A kernel that keeps no T x T matrix (cuDNN's, the Pallas flash kernel, the chunked custom VJP): it
        keeps q, k, v, its output and a float32 log-sum-exp per row for the backward pass."""
        return self.attention in ("cudnn", "chunked", "flash")

    @classmethod
    def from_spec(cls, run: RunSpec) -> Dims:
        """The sizes of one minibatch on one device of `run`.

        Args:
          run: the run's typed view.

        Returns:
          The sizes, with the mixture of experts' (MoEDims.from_spec) when the model has experts.
        """
        m, mesh = run.model, run.mesh
        p = jnp.dtype(m.dtype).itemsize
        return cls(
            b=run.minibatch_per_device,
            s=run.seq_len // mesh.context,  # context parallelism: each device holds s / context positions
            h=m.hidden_size,
            a=m.num_heads,
            k=m.kv_width,
            f=m.mlp_width,
            v=m.vocab_size,
            p=p,
            q=jnp.dtype(m.softmax_dtype).itemsize,
            mask=_BOOL if m.dropout_rate > 0 else 0,
            kernel_casts=jnp.dtype(m.dtype) != jnp.dtype(m.param_dtype),
            attention=m.attention,
            family=m.family,
            t=mesh.tensor,
            sp=mesh.tensor if run.sequence_parallel else 1,
            c=run.loss_chunk_len,
            moe=MoEDims.from_spec(run),
            closed=remat_policies.closed_form_units(m, mesh.context),
        )

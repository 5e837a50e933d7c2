"""The model families by name, their output heads, and the logical axis names their parameters carry."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxscale.config.spec import ModelConfig
from jaxscale.model.gpt import GPT
from jaxscale.model.llama import Llama
from jaxscale.model.moe import MoELlama
from jaxscale.model.stack import head_logits

FAMILIES: dict[str, type[nn.Module]] = {"gpt": GPT, "llama": Llama}


def build(cfg: ModelConfig, train: bool = False) -> nn.Module:
    """The module of cfg.family (llama with model.num_experts > 0: jaxscale.model.moe's MoELlama); an unknown family
    is a KeyError (config validation names the allowed ones)."""
    module = FAMILIES[cfg.family]
    return (MoELlama if cfg.num_experts else module)(cfg, train=train)


def head_fn(cfg: ModelConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """(params, x [..., T, H] final normalized activations) -> [..., T, V] float32 logits: cfg.family's output
    head outside the model (its bias as the family has it), for a loss computed over chunks of tokens."""
    return functools.partial(head_logits, cfg, use_bias=FAMILIES[cfg.family].head_bias)


def logical_axes(cfg: ModelConfig) -> dict:
    """The params tree with, at each leaf, a PartitionSpec of the leaf's logical axis names.

    Shapes only (jax.eval_shape): nothing is allocated. `nn.logical_to_mesh_sharding(logical_axes(cfg),
    mesh, rules)` turns it into shardings once a mesh and a rules table exist.
    """
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    boxed = jax.eval_shape(build(cfg).init, jax.random.PRNGKey(0), tokens)["params"]
    return nn.get_partition_spec(boxed)

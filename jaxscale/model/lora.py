"""LoRA: a projection plus a trainable low-rank update, y = x W + (alpha / r) x A B (Hu et al. 2021, arXiv 2106.09685).

A [in..., r] starts as PEFT's (Kaiming-uniform with a = sqrt(5): uniform within 1/sqrt(fan_in)) and B [r, out...]
at zero, so an untrained adapter adds nothing: the model with adapters is the base model until B moves. The
adapters are float32 parameters like every trained one, named `lora_a` / `lora_b` beside the projection's
`kernel`; their rank axis has no logical name (never split), the others take the kernel's, so a mesh splits an
adapter as it splits its projection. Both matmuls run in the compute dtype through the same
jaxscale.model.precision dot as the kernel. `merge` folds trained adapters into the kernels (W + (alpha/r) A B):
the same function with no adapters left.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxscale.config import finetune
from jaxscale.config.spec import ModelConfig
from jaxscale.model import precision
from jaxscale.model.axes import partitioned

# PEFT's init of A: torch's kaiming_uniform_(a=sqrt(5)), gain^2 = 2 / (1 + 5), bound sqrt(3 gain^2 / fan_in).
_A_SCALE = 1.0 / 3.0


def scale(cfg: ModelConfig) -> float:
    """alpha / r: what the adapter's product is multiplied by."""
    return cfg.lora_alpha / cfg.lora_rank


def adapted(cfg: ModelConfig, name: str) -> bool:
    """Whether the projection called `name` carries an adapter under cfg.lora_rank and cfg.lora_targets."""
    return cfg.lora_rank > 0 and name in finetune.lora_projections(cfg.family, cfg.lora_targets)


def adapter_axes(kernel_axes: tuple[str, ...], contracted: int) -> tuple[tuple, tuple]:
    """Logical names of A [in..., r] and B [r, out...] for a kernel named `kernel_axes` (its first
    `contracted` dims are the input's)."""
    return (*kernel_axes[:contracted], None), (None, *kernel_axes[contracted:])


class LoraDenseGeneral(nn.DenseGeneral):
    """nn.DenseGeneral plus its adapter: the kernel's output + scale · (x A) B, in the compute dtype."""

    config: ModelConfig | None = None
    kernel_axes: tuple[str, ...] = ()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        cfg = self.config
        y = super().__call__(inputs)  # [..., out...]
        axis = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        contracted = tuple(a % inputs.ndim for a in axis)
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        in_shape = tuple(inputs.shape[a] for a in contracted)
        a_names, b_names = adapter_axes(self.kernel_axes, len(in_shape))
        a_init = nn.initializers.variance_scaling(
            _A_SCALE, "fan_in", "uniform", in_axis=tuple(range(len(in_shape))), out_axis=-1
        )
        a = self.param("lora_a", partitioned(a_init, a_names), (*in_shape, cfg.lora_rank))
        b = self.param("lora_b", partitioned(nn.initializers.zeros_init(), b_names), (cfg.lora_rank, *features))
        a, b = nn.meta.unbox(a), nn.meta.unbox(b)
        dims_a = ((contracted, tuple(range(len(in_shape)))), ((), ()))
        h = precision.weight_dot_general(cfg, a_names)(inputs.astype(cfg.dtype), a, dims_a)  # [..., r]
        dims_b = (((h.ndim - 1,), (0,)), ((), ()))
        update = precision.weight_dot_general(cfg, b_names)(h, b, dims_b)  # [..., out...]
        return y + (scale(cfg) * update).astype(y.dtype)


def lora_dense(cfg: ModelConfig, kernel_axes: tuple[str, ...], **fields: Any) -> LoraDenseGeneral:
    """A LoraDenseGeneral with the fields jaxscale.model.stack.dense gives a projection."""
    return LoraDenseGeneral(config=cfg, kernel_axes=kernel_axes, **fields)


def merge(params: dict, cfg: ModelConfig) -> dict:
    """The params with every adapter folded into its kernel, W + (alpha / r) A B, and lora_a / lora_b removed:
    the params of the same model without adapters (scanned stacks merge layer by layer)."""

    def fold(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "lora_a" in node:
            a, b, kernel = node["lora_a"], node["lora_b"], node["kernel"]
            lead = a.ndim + b.ndim - 2 - kernel.ndim  # 1 with a leading "layers" axis (scan), else 0
            a2 = a.reshape(*a.shape[:lead], math.prod(a.shape[lead:-1]), a.shape[-1])  # [(L,) in, r]
            b2 = b.reshape(*b.shape[:lead], b.shape[lead], math.prod(b.shape[lead + 1 :]))  # [(L,) r, out]
            delta = jnp.matmul(a2.astype(jnp.float32), b2.astype(jnp.float32)).reshape(kernel.shape)
            rest = {k: v for k, v in node.items() if k not in finetune.LORA_PARAMS}
            rest["kernel"] = (kernel.astype(jnp.float32) + scale(cfg) * delta).astype(kernel.dtype)
            return rest
        return {k: fold(v) for k, v in node.items()}

    return fold(params)

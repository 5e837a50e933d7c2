"""Flax modules only: the model families the lab trains (no I/O, no measurement)."""

from jaxscale.config.spec import ModelConfig
from jaxscale.model.families import FAMILIES, build, head_fn, logical_axes
from jaxscale.model.gpt import GPT
from jaxscale.model.llama import Llama
from jaxscale.model.moe import AUX_LOSS, add_aux_losses
from jaxscale.model.stack import count_params, unstack_scanned_params

__all__ = [
    "AUX_LOSS",
    "FAMILIES",
    "GPT",
    "Llama",
    "ModelConfig",
    "add_aux_losses",
    "build",
    "count_params",
    "head_fn",
    "logical_axes",
    "unstack_scanned_params",
]

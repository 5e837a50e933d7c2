"""Flax modules only: the models the lab trains (no I/O, no measurement)."""

from jaxscale.model.gpt import GPT, ModelConfig, count_params, unstack_scanned_params

__all__ = ["GPT", "ModelConfig", "count_params", "unstack_scanned_params"]

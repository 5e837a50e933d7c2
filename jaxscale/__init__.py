"""jaxscale: measure which precision, remat, scan, accumulation and batch size trains a GPT fastest."""

from jaxscale.config import ConfigError, base_config, validate
from jaxscale.model import GPT, ModelConfig, count_params, unstack_scanned_params
from jaxscale.train import TrainState, accumulate_gradients, make_init_fn, make_train_step

__all__ = [
    "GPT",
    "ConfigError",
    "ModelConfig",
    "TrainState",
    "accumulate_gradients",
    "base_config",
    "count_params",
    "make_init_fn",
    "make_train_step",
    "unstack_scanned_params",
    "validate",
]

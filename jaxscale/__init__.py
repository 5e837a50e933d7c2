"""jaxscale: measure which precision, remat, scan, accumulation and batch size trains a transformer fastest."""

from jaxscale import _env

_env.quiet_native_logs()  # before JAX is imported

from jaxscale.config import ConfigError, base_config, validate  # noqa: E402
from jaxscale.model import GPT, Llama, ModelConfig, count_params, unstack_scanned_params  # noqa: E402
from jaxscale.train import TrainState, accumulate_gradients, make_init_fn, make_train_step  # noqa: E402

__all__ = [
    "GPT",
    "ConfigError",
    "Llama",
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

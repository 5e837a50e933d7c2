"""Reference table row 2: bfloat16 compute, layers scanned, no remat."""

from jaxscale.config import base_config


def get_config(preset=None):
    """Preset after the colon: seed (reference scale), cpu (~1 s/step on 2 cores), tiny (tests)."""
    config = base_config(preset, name="bf16")
    config.model.scan_layers = True
    # no remat as the reference notebook runs it: each layer keeps what JAX's autodiff saves (model.residuals;
    # closed_form, the lab's default, keeps only what the backward pass reads: docs/measurements.md)
    config.model.residuals = "autodiff"
    # and each minibatch's whole gradient made, then added (train.grad_accumulation; in_backward, the lab's default
    # for scanned layers, adds the layers' gradients into the accumulator inside the backward pass)
    config.train.grad_accumulation = "after_backward"
    return config

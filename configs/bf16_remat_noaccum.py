"""Reference table row 6: bfloat16, scanned, remat MLP+Attn, one minibatch (no gradient accumulation)."""

from jaxscale.config import base_config


def get_config(preset=None):
    """Preset after the colon: seed (reference scale), cpu (~1 s/step on 2 cores), tiny (tests)."""
    config = base_config(preset, name="bf16_remat_noaccum")
    config.model.scan_layers = True
    config.model.remat = ("MLP", "Attn")
    config.train.num_minibatches = 1
    return config

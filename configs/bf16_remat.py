"""Reference table row 4 and the recommended variant: bfloat16, layers scanned, remat on MLP and Attn."""

from jaxscale.config import base_config


def get_config(preset=None):
    """Preset after the colon: seed (reference scale), cpu (~1 s/step on 2 cores), tiny (tests)."""
    config = base_config(preset, name="bf16_remat")
    config.model.scan_layers = True
    config.model.remat = ("MLP", "Attn")
    return config

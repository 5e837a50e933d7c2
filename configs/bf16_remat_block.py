"""Reference table row 5: bfloat16, layers scanned, remat on the whole Block."""

from jaxscale.config import base_config


def get_config(preset=None):
    """Preset after the colon: seed (reference scale), cpu (~1 s/step on 2 cores), tiny (tests)."""
    config = base_config(preset, name="bf16_remat_block")
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    return config

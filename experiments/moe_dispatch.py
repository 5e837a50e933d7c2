"""Which MoE dispatch is fastest on one GPU: dense (every expert on every token), capacity (GShard's one-hot einsums),
scatter (capacity's slots by index, the lab's default) and ragged (dropless: tokens sorted by expert,
jax.lax.ragged_dot), the same model and batch.

    python -m jaxscale.sweep --config experiments/moe_dispatch.py:olmoe-1b-7b --on_this_device   # on a GPU
    python -m jaxscale.sweep --config experiments/moe_dispatch.py:tiny-moe                      # this CPU

At olmoe-1b-7b the model is OLMoE's layer (64 experts, 8 a token, experts 1024 wide) with 4 layers instead of 16, so
that the dense dispatch (8x the routed experts' FLOPs) fits one GPU; 8 sequences of 2048, bf16, scanned layers,
remat of the block, the Pallas flash kernel. Measured, not predicted: the predictor does not yet price ragged_dot.
"""

from jaxscale.config import base_config

BASELINE = "ragged"


def get_config(preset=None):
    config = base_config(preset, name="moe_dispatch")
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    config.train.num_minibatches = 1
    if config.preset == "olmoe-1b-7b":
        config.model.num_layers = 4
        config.model.attention = "flash"
        config.data.seq_len, config.data.batch_size = 2048, 8
    return config


def get_variants(config):
    """The four dispatches; capacity and scatter at factor 2 (the same slots; drops counted in the row's metrics where
    any). scatter was added after the H200 measured the other three: its H200 row is a plan until a GPU runs it."""
    return [
        {"name": "ragged", "model.moe_dispatch": "ragged"},
        {"name": "capacity", "model.moe_dispatch": "capacity", "model.moe_capacity_factor": 2.0},
        {"name": "dense", "model.moe_dispatch": "dense"},
        {"name": "scatter", "model.moe_dispatch": "scatter", "model.moe_capacity_factor": 2.0},
    ]

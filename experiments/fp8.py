"""FP8 against bf16 on one GPU: the same model, layout and batch with model.fp8 none and dynamic, each predicted before
it is measured.

    python -m jaxscale.sweep --config experiments/fp8.py:llama3.2-1b --plan --target h200     # no GPU needed
    python -m jaxscale.sweep --config experiments/fp8.py:llama3.2-1b --on_this_device         # on the GPU

Presets: seed (the reference GPT, 155M parameters: GEMMs of 1024-wide activations, where FP8's casts and scales
weigh most) and llama3.2-1b (GEMMs of 2048 x 8192), at sequence 2048 with 16 sequences a step. bf16 compute, scanned
layers, remat of MLP and Attn, the Pallas flash kernel, one minibatch; fp8: every attention and MLP projection an FP8
GEMM with dynamic tensorwise scaling, the head in bf16 (jaxscale.model.fp8). The plans' predictions for an H200 were
committed before the GPU rows (docs/fp8.md).
"""

from jaxscale.config import base_config

BASELINE = "bf16"


def get_config(preset=None):
    config = base_config(preset, name="fp8")
    config.model.scan_layers = True
    config.model.remat = ("MLP", "Attn")
    config.model.attention = "flash"
    config.data.seq_len = 2048
    config.model.max_seq_len = max(config.model.max_seq_len, 2048)
    config.data.batch_size = 16
    config.train.num_minibatches = 1
    return config


def get_variants(config):
    """bf16 and FP8 (dynamic tensorwise scaling) of the same step."""
    return [{"name": "bf16", "model.fp8": "none"}, {"name": "fp8", "model.fp8": "dynamic"}]

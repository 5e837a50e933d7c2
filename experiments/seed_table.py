"""The seed notebook's table as one sweep: precision, layer scan, remat, accumulation and batch size.

    python -m jaxscale.sweep --config experiments/seed_table.py:cpu     # all 7 variants on a 2-core CPU
    python -m jaxscale.sweep --config experiments/seed_table.py:seed    # the reference scale (a GPU)
    python -m jaxscale.sweep --config experiments/seed_table.py:seed --plan --target a5000   # no GPU needed

Every variant is compared with BASELINE, the notebook's first row (float32, scanned, no remat).
"""

from jaxscale.config import base_config

BASELINE = "fp32_scan"

# The peak memory the notebook measured for each row on its RTX A5000, at the reference scale (:seed)
# only. GiB: the notebook read them from TensorBoard's memory viewer, which prints binary units (it calls
# a [12, 16, 512, 4096] bfloat16 array "768MB", exactly 768 MiB), so its "14.6GB" is 14.6 GiB. Batch 256
# was only given as "15GB usage". The sweep joins these into its rows as notebook_peak_bytes, with
# planned_over_notebook = compiled_peak_bytes / notebook_peak_bytes.
NOTEBOOK_PEAK_GIB = {
    "seed": {
        "fp32_scan": 20.6,  # with XLA's automatic-rematerialization warnings
        "bf16_scan": 14.6,
        "bf16_noscan": 8.8,
        "bf16_scan_remat_mlp_attn": 3.9,
        "bf16_scan_remat_block": 3.8,
        "bf16_remat_1minibatch": 6.2,
        "bf16_remat_batch256": 15.0,  # "15GB usage", rounded
    }
}

# The step time the notebook measured for each row on its A5000, at :seed (seconds; read from its
# TensorBoard traces; batch 256 was not timed). The sweep joins these as notebook_step_s, with
# predicted_over_notebook = predicted_step_s / notebook_step_s (see docs/predict.md), only into rows for
# NOTEBOOK_DEVICE (a `--plan --target a5000` plan, or a run on an RTX A5000): another GPU's times differ.
NOTEBOOK_DEVICE = "a5000"
NOTEBOOK_STEP_S = {
    "seed": {
        "fp32_scan": 2.1,
        "bf16_scan": 1.1,
        "bf16_noscan": 0.73,
        "bf16_scan_remat_mlp_attn": 0.91,
        "bf16_scan_remat_block": 0.96,
        "bf16_remat_1minibatch": 0.86,
    }
}


def get_config(preset=None):
    """The base every variant starts from: the reference model (bf16, layers scanned, no remat).

    Presets: seed (the notebook's scale), cpu (every variant in minutes on 2 cores), tiny (tests).
    """
    config = base_config(preset, name="seed_table")
    config.model.scan_layers = True
    # The notebook's program: without remat each layer keeps what JAX's autodiff saves, not the lab's default
    # closed form (model.residuals; docs/measurements.md), so the planned peaks stay comparable with its table.
    config.model.residuals = "autodiff"
    # and each minibatch's whole gradient made, then added (train.grad_accumulation), as JAX's autodiff does
    config.train.grad_accumulation = "after_backward"
    if config.preset == "cpu":
        config.train.steps = 6  # 7 variants, batch-4x among them, within 10 minutes on 2 shared cores
        config.profile.steps = 1
    return config


def get_variants(config):
    """The notebook's seven rows as dotted overrides of `config` (batch 4x is batch 256 at :seed)."""
    bf16 = {"model.dtype": "bfloat16"}
    remat = {**bf16, "model.scan_layers": True, "model.remat": ("MLP", "Attn")}
    big_batch = 4 * config.data.batch_size
    return [
        {"name": "fp32_scan", "model.dtype": "float32", "model.scan_layers": True, "model.remat": ()},
        {"name": "bf16_scan", **bf16, "model.scan_layers": True, "model.remat": ()},
        {"name": "bf16_noscan", **bf16, "model.scan_layers": False, "model.remat": ()},
        {"name": "bf16_scan_remat_mlp_attn", **remat},
        {"name": "bf16_scan_remat_block", **bf16, "model.scan_layers": True, "model.remat": ("Block",)},
        {"name": "bf16_remat_1minibatch", **remat, "train.num_minibatches": 1},
        # The notebook scaled the batch after dropping accumulation: remat MLP+Attn, one minibatch.
        {"name": f"bf16_remat_batch{big_batch}", **remat, "train.num_minibatches": 1, "data.batch_size": big_batch},
    ]

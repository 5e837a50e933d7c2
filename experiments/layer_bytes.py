"""What one layer keeps for its backward pass, per family, scanned and unrolled, beside the closed form
(docs/measurements.md, "What a layer keeps"; issue 41's item 1).

    python -m jaxscale.sweep --config experiments/layer_bytes.py:llama3.1-8b --plan --target h100 --gemm cublas
    python -m jaxscale.sweep --config experiments/layer_bytes.py:gpt2 --plan --target h100 --gemm cublas
    python -m jaxscale.sweep --config experiments/layer_bytes.py:olmoe-1b-7b --plan --target h100 --gemm cublas

Each way a layer can keep its activations (`KEEPS`: no remat with autodiff's residuals or the closed form
(model.residuals), remat of MLP and Attn, and Block remat under three named policies) is planned, scanned and
unrolled, at two sequence lengths and two layer counts (`PROBE`): a plan's temporary bytes are
L·s·kept + s·working + terms of neither (the weights' gradients and casts), so the per-token slope at L layers is
L·kept + working, and the slopes' difference over the layers' is `kept`, per token per layer (the docs table,
jaxscale.report.measurements_tables.layer_bytes_table). Varying only the layer count would put each layer's weight
gradients and casts in the difference; varying only the sequence, the one layer's working set divided by L.

Presets: llama3.1-8b and olmoe-1b-7b as they are; gpt2 at a 7B shape (hidden 4096, 32 heads of 128, vocabulary
50368, tied, no dropout: the GPT family at Llama 3.1 8B's width). One sequence, one minibatch, the Pallas flash
kernel, bf16, a chunked loss (1,024 positions), and SGD: its update is elementwise in place, so the plan's peak is
at the start of the backward pass at every probe size (Adam's update holds float32 temporaries of the largest
weights, which outweigh a remat policy's few activations at these sizes and would put a probe's peak elsewhere).
"""

from jaxscale.config import base_config

BASELINE = "scan_autodiff_L8_16k"

# How a layer keeps its activations: (name, model overrides).
KEEPS = (
    ("autodiff", {"model.remat": (), "model.residuals": "autodiff"}),
    ("closed_form", {"model.remat": (), "model.residuals": "closed_form"}),
    ("mlp_attn", {"model.remat": ("MLP", "Attn"), "model.remat_policy": "nothing_saveable"}),
    ("block_nothing", {"model.remat": ("Block",), "model.remat_policy": "nothing_saveable"}),
    ("block_minimal_flash", {"model.remat": ("Block",), "model.remat_policy": "minimal_flash"}),
    ("block_save_dot_except_mlp",
     {"model.remat": ("Block",), "model.remat_policy": "save_dot_with_context_except_mlp"}),
)
PROBE = {"layers": (4, 8), "seqs": (8192, 16384)}


def get_config(preset=None):
    config = base_config(preset, name="layer_bytes")
    if config.preset == "gpt2":  # the GPT family at a 7B shape
        config.model.update(hidden_size=4096, head_dim=128, vocab_size=50368, tie_embeddings=True)
    config.model.update(attention="flash", dropout_rate=0.0, max_seq_len=max(PROBE["seqs"]))
    config.data.batch_size, config.data.seq_len = 1, max(PROBE["seqs"])
    config.train.update(num_minibatches=1, loss_chunk_len=1024)
    config.optimizer.name = "sgd"  # an update with no temporaries: the peak is the backward pass's at every size
    return config


def get_variants(config):
    """`<scan|unrolled>_<keep>_L<layers>_<seq/1024>k` for each of KEEPS, scanned and not, at PROBE's four sizes."""
    return [
        {"name": f"{'scan' if scan else 'unrolled'}_{keep}_L{layers}_{seq // 1024}k", "model.scan_layers": scan,
         "model.num_layers": layers, "data.seq_len": seq, **overrides}
        for scan in (True, False)
        for keep, overrides in KEEPS
        for layers in PROBE["layers"]
        for seq in PROBE["seqs"]
    ]  # fmt: skip

"""Sequence length against memory and time, per attention kernel: quadratic against linear (docs/attention.md).

    python -m jaxscale.sweep --config experiments/seq_len.py:cpu                    # measured on this CPU
    python -m jaxscale.sweep --config experiments/seq_len.py:llama3.2-1b --plan --target h100   # planned
    python -m jaxscale.report experiments/results/seq_len_cpu

One sequence per step (one minibatch), the Llama family (RoPE: no position table grows with the sequence),
bf16, scanned layers, remat of the whole Block (nothing saved), Adam. Only the sequence length and the
attention kernel change:

- `reference`: the notebook's einsum, a [B, heads, T, T] float32 softmax per layer;
- `xla`: jax.nn.dot_product_attention(implementation="xla"), the same matrices in XLA's own formulation;
- `chunked`: keys in blocks with an online softmax, only the output and a log-sum-exp per row kept (every
  backend);
- `flash`: the Pallas flash-attention kernel (Triton on a GPU target; interpret mode on CPU, for tests only,
  so it is not in the CPU sweep).

At `:cpu` widths (4 layers, hidden 256, 4 heads of 64) the run is measured for reference and chunked up to
4,096 tokens; at `:llama3.2-1b` (16 layers, hidden 2048, 32 heads of 64, 8 K/V heads) every kernel is
planned for an H100 from 1,024 to 32,768 tokens, with its predicted step time beside the plan.
"""

from jaxscale.config import base_config

BASELINE = "reference_1k"

# (kernels, sequence lengths) per preset: the CPU measures, a GPU target plans.
CPU_KERNELS, CPU_SEQS = ("reference", "chunked"), (512, 1024, 2048, 4096)
GPU_KERNELS, GPU_SEQS = ("reference", "xla", "chunked", "flash"), (1024, 2048, 4096, 8192, 16384, 32768)


def _on_cpu(config) -> bool:
    return config.preset in ("cpu", "tiny")


def get_config(preset=None):
    """bf16, scanned, remat Block, one sequence in one minibatch; the llama family at :cpu and :tiny widths."""
    config = base_config(preset, name="seq_len")
    config.model.family = "llama"
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    config.data.batch_size = 1
    config.train.num_minibatches = 1
    if _on_cpu(config):
        config.model.update(dropout_rate=0.0, max_seq_len=max(CPU_SEQS))
        config.train.update(steps=3, warmup_steps=1)
        config.profile.steps = 1
    else:
        config.model.max_seq_len = max(config.model.max_seq_len, max(GPU_SEQS))
    return config


def get_variants(config):
    """kernel x sequence length, named `<kernel>_<T/1024>k` (`_0.5k` for 512)."""
    kernels, seqs = (CPU_KERNELS, CPU_SEQS) if _on_cpu(config) else (GPU_KERNELS, GPU_SEQS)
    return [
        {"name": f"{kernel}_{seq / 1024:g}k", "model.attention": kernel, "data.seq_len": seq}
        for seq in seqs
        for kernel in kernels
    ]

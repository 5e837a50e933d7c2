"""The recommended variant (bf16_remat: bfloat16, layers scanned, remat on MLP and Attn) with FP8 matmuls: every
attention and MLP projection an FP8 GEMM with dynamic (current) tensorwise scaling, the output head in bfloat16
(torchtitan's Float8 default; jaxscale.model.fp8, docs/fp8.md). Needs FP8 tensor cores on a GPU (compute capability
8.9+: Ada, Hopper, Blackwell); on a CPU it computes the same function in bfloat16 on FP8-rounded values."""

from jaxscale.config import base_config


def get_config(preset=None):
    """Preset after the colon: seed (reference scale), cpu (~1 s/step on 2 cores), tiny (tests), or a named model."""
    config = base_config(preset, name="fp8")
    config.model.scan_layers = True
    config.model.remat = ("MLP", "Attn")
    config.model.fp8 = "dynamic"
    return config

"""Long context on 8 GPUs: Llama 3.1 8B at 32k, 64k and 128k tokens a sequence, FSDP x context parallelism as
torchtitan's Table 2 lays it out (FSDP 8 x CP 1, FSDP 4 x CP 2, FSDP 2 x CP 4, FSDP 1 x CP 8; local batch 1, full
activation checkpointing).

    python -m jaxscale.sweep --config experiments/long_context.py:llama3.1-8b --plan --target h100 --devices 8
    python -m jaxscale.report experiments/results/long_context_llama3.1-8b_plan_h100_x8

Every layout at every sequence length: which fit an 80 GB H100 (the plan's peak per GPU against XLA's limit and
JAX's pool), and the predicted tokens/s per GPU, beside torchtitan's measured figures (docs/mesh.md). One
sequence per data-parallel rank (fsdp of them a step), bf16, scanned layers, Block remat saving nothing (full
checkpointing); the Pallas flash kernel, as a ring of flash blocks under context parallelism. Their
runs used Float8 matmuls and torch.compile, which this plan does not model.
"""

from jaxscale.config import base_config

BASELINE = "fsdp8_cp1_32k"
LAYOUTS = {"fsdp8_cp1": (8, 1), "fsdp4_cp2": (4, 2), "fsdp2_cp4": (2, 4), "fsdp1_cp8": (1, 8)}  # (fsdp, context)
SEQ_LENS = {"32k": 32768, "64k": 65536, "128k": 131072}
# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Table 2 (FSDP + CP + torch.compile + Float8, 96 GB
# H100s at 500 W): (layout, sequence) -> (tokens/s per GPU, memory GiB), as published.
TORCHTITAN_TABLE_2 = {
    ("fsdp8_cp1", 32768): (3890, 83.9),
    ("fsdp4_cp2", 65536): (2540, 84.2),
    ("fsdp2_cp4", 131072): (1071, 84.0),
    ("fsdp1_cp8", 262144): (548, 84.5),  # beyond model.max_seq_len=131072 here: not planned
}


def get_config(preset=None):
    config = base_config(preset, name="long_context")
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    config.model.remat_policy = "nothing_saveable"
    config.model.attention = "flash"
    config.train.num_minibatches = 1
    return config


def get_variants(config):
    """Every layout at every sequence length; one sequence per fsdp rank, so fsdp sequences a step."""
    variants = []
    for layout, (fsdp, context) in LAYOUTS.items():
        for seq_name, seq_len in SEQ_LENS.items():
            variants.append({
                "name": f"{layout}_{seq_name}",
                "mesh.fsdp": fsdp, "mesh.context": context,
                "data.seq_len": seq_len, "data.batch_size": fsdp,
                })  # fmt: skip
    return variants

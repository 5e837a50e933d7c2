"""One model on 8 devices, laid out six ways: data parallel, FSDP (ZeRO-3), tensor parallel and mixes of them.

    python -m jaxscale.sweep --config experiments/mesh.py:cpu --host_devices 8      # 8 simulated CPU devices
    python -m jaxscale.sweep --config experiments/mesh.py:seed --plan --target a5000 --devices 8   # 8 A5000s
    python -m jaxscale.report experiments/results/mesh_cpu

Every variant is the main example (bf16, scanned layers, remat of MLP and Attn) with the same global batch;
only `mesh.data x mesh.fsdp x mesh.tensor` changes. BASELINE is the single-device program (1x1x1, on the
first device; with --devices it is planned for one GPU). The table shows, per variant, the step time, the
peak memory per device (compiled plan, and the analytic model beside it) and the bytes each device's
collectives move per step. On simulated CPU devices all eight share this machine's cores, so their step
time shows the partitioned program's overhead, not a speed-up (docs/mesh.md).
"""

from jaxscale.config import base_config

BASELINE = "one_device"

MESHES = {
    "one_device": (1, 1, 1),
    "dp8": (8, 1, 1),  # data parallel: batch split, state replicated, gradients all-reduced
    "fsdp8": (1, 8, 1),  # ZeRO-3: state split 8 ways, weights all-gathered, gradients reduce-scattered
    "dp2_tp4": (2, 1, 4),  # Megatron tensor parallel over 4 devices, two data-parallel replicas
    "fsdp4_tp2": (1, 4, 2),
    "dp2_fsdp2_tp2": (2, 2, 2),
}


def get_config(preset=None):
    """The main example (configs/bf16_remat.py) with 2 minibatches at :cpu and :tiny (16 sequences), so a
    minibatch of 8 splits over up to 8 devices; both have 4 heads, so tensor parallelism goes up to 4."""
    config = base_config(preset, name="mesh")
    config.model.scan_layers = True
    config.model.remat = ("MLP", "Attn")
    if config.preset == "tiny":
        config.data.batch_size = 16
    if config.preset in ("cpu", "tiny"):
        config.train.num_minibatches = 2
        config.train.update(steps=5, warmup_steps=1)
        config.profile.steps = 1
    return config


def get_variants(config):
    """One variant per mesh in MESHES."""
    return [
        {"name": name, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}
        for name, (data, fsdp, tensor) in MESHES.items()
    ]

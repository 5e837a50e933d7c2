"""Which layout and dispatch trains a mixture of experts fastest on 8 GPUs within their memory: FSDP, expert
parallelism (mesh.expert, tokens exchanged by all-to-all), tensor parallelism and their products, each with the
capacity dispatch's slots filled two ways (GShard's one-hot einsums, `capacity`; a scatter and gather by index,
`scatter`), and the dense and ragged dispatches beside the plain FSDP layout.

    python -m jaxscale.sweep --config experiments/moe_layouts.py:mixtral-8x7b --plan --target h100 --devices 8
    python -m jaxscale.sweep --config experiments/moe_layouts.py:qwen3-30b-a3b --plan --target h100 --devices 8
    python -m jaxscale.sweep --config experiments/moe_layouts.py:tiny-moe --host_devices 8   # 8 simulated CPU devices

Every variant trains the same batch: one sequence of 4096 per GPU a step (8 in all), bf16, scanned layers, Block
remat (nothing saved), the Pallas flash kernel, the output head and loss in chunks of 1024 positions (Qwen3's
151,936-token vocabulary), the capacity dispatch at factor 1.25 (GShard's; tokens past it are dropped and counted
when the step runs). The optimizer is Adafactor (optax's defaults): Adam's float32 state does not fit 8 H100s with
either model in any layout (16 bytes a parameter: 93 GB a GPU for Mixtral before activations, 61 GB for Qwen3),
which the `adam*` variants show at the fastest Adafactor layout, with Adam's state on the host
(optimizer.offload_state), with its first moment in bf16, and with both moments in 8 bits (optimizer.state_dtype=int8,
split like the parameters). At tiny-moe (4 experts) the layouts the 8 simulated
CPU devices allow, 5 steps.
"""

from jaxscale.config import base_config

BASELINE = "fsdp8"  # ZeRO-3 over every GPU, capacity dispatch: the layout the other rows are compared with

# name: (data, fsdp, tensor, expert)
LAYOUTS = {
    "fsdp8": (1, 8, 1, 1),
    "fsdp4_ep2": (1, 4, 1, 2),
    "fsdp2_ep4": (1, 2, 1, 4),
    "ep8": (1, 1, 1, 8),  # experts split 8 ways; attention, embeddings and head split over expert too (as FSDP)
    "fsdp4_tp2": (1, 4, 2, 1),
    "fsdp2_tp2_ep2": (1, 2, 2, 2),
}
SMALL = ("tiny-moe",)
DEVICES = 8


def get_config(preset=None):
    config = base_config(preset, name="moe_layouts")
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    config.model.moe_dispatch = "capacity"
    config.model.moe_capacity_factor = 1.25
    config.optimizer.name = "adafactor"
    config.data.batch_size = DEVICES
    config.train.num_minibatches = 1
    if config.preset in SMALL:  # flash runs interpreted on CPU: the plain-JAX chunked kernel there
        config.model.attention = "chunked"
        config.train.update(steps=5, warmup_steps=1)
        config.profile.steps = 1
    else:
        config.model.attention = "flash"
        config.data.seq_len = 4096
        config.train.loss_chunk_len = 1024
    return config


def _mesh(layout):
    data, fsdp, tensor, expert = layout
    return {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "mesh.expert": expert}


def get_variants(config):
    """The capacity dispatch (GShard's one-hot einsums) and the scatter dispatch (the same slots by index) on every
    layout the model allows (mesh.expert divides the experts, mesh.tensor the K/V heads); the dense and ragged
    dispatches on FSDP alone (on an expert mesh they gather the experts' weights instead of exchanging tokens: not
    expert-parallel compute); Adam four ways on the layout named by ADAM_LAYOUT (the fastest Adafactor layout of the
    committed plans)."""
    m = config.model
    small = config.preset in SMALL
    variants = []
    for name, layout in LAYOUTS.items():
        _, _, tensor, expert = layout
        if m.num_experts % expert or m.num_kv_heads % tensor or (small and (expert > 2 or tensor > 1)):
            continue
        variants.append({"name": name, **_mesh(layout)})
        variants.append({"name": f"{name}_scatter", **_mesh(layout), "model.moe_dispatch": "scatter"})
    for dispatch in ("dense", "ragged"):
        variants.append({"name": f"fsdp8_{dispatch}", **_mesh(LAYOUTS["fsdp8"]), "model.moe_dispatch": dispatch})
    best = ADAM_LAYOUT.get(config.preset, "fsdp8")
    adam = {**_mesh(LAYOUTS[best]), "model.moe_dispatch": "scatter", "optimizer.name": "adam"}
    variants += [
        {"name": f"{best}_scatter_adam", **adam},
        {"name": f"{best}_scatter_adam_offload_state", **adam, "optimizer.offload_state": True},
        {"name": f"{best}_scatter_adam_bf16_mu", **adam, "optimizer.state_dtype": "bfloat16"},
        {"name": f"{best}_scatter_adam_int8", **adam, "optimizer.state_dtype": "int8"},
    ]
    return variants


# The layout Adam's variants use, per preset: the fastest Adafactor layout that fits in the committed plans (their
# capacity rows: mixtral-8x7b's ep8 is the one layout that fits, 57.3 GiB, and the fastest).
ADAM_LAYOUT = {"mixtral-8x7b": "ep8", "qwen3-30b-a3b": "ep8"}

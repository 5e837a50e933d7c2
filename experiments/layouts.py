"""Every layout of the efficiency lecture's memory calculator, compiled: one model on N devices, laid out as data
parallel (ZeRO-0), ZeRO-1, ZeRO-2, FSDP (ZeRO-3), tensor parallel with and without sequence parallelism, context
parallel, and their sensible products.

    python -m jaxscale.sweep --config experiments/layouts.py:cpu-llama --host_devices 8      # 8 simulated CPU devices
    python -m jaxscale.sweep --config experiments/layouts.py:llama3.1-8b --plan --target h100 --devices 8
    python -m jaxscale.sweep --config experiments/layouts_x64.py:llama3.1-8b --plan --target h100 --devices 64
    python -m jaxscale.report experiments/results/layouts_llama3.1-8b_plan_h100_x8

Every variant trains the same global batch (two sequences per GPU a step, torchtitan's local batch) with the
same kernel: bf16, scanned layers, Block remat (nothing saved) and the Pallas flash attention (context
parallelism runs it as a ring of flash blocks, jaxscale.model.ring_attention; at the CPU presets the chunked
kernel, as flash runs interpreted there).
Each layout runs twice: with a minibatch of one sequence per device that splits the batch (data x fsdp), so
the accumulation count is the batch / (data x fsdp), as tensor- and context-parallel devices share their
sequences; and (`_whole`) with the whole batch in one minibatch, which gathers the weights and reduces the
gradients once a step instead of once a minibatch but keeps more activations. ZeRO-2, which reduces every
minibatch's gradients by default, runs a third time (`_step`) accumulating them on each device and reducing once a
step (mesh.reduce_gradients=step: a whole float32 accumulator per device). The table
shows, per variant, the plan's peak per GPU beside the analytic model, the collectives' bytes, and the predicted
tokens/s per GPU; docs/mesh.md has the answer.
experiments/layouts_x64.py is the same sweep for 64 GPUs (8 hosts of 8).
"""

from jaxscale.config import base_config

BASELINE = "fsdp"  # ZeRO-3 over every device: the layout the other rows are compared with

# name: (data, fsdp, tensor, context, ZeRO stage of fsdp, sequence parallel)
LAYOUTS_X8 = {
    "dp": (8, 1, 1, 1, 3, False),  # ZeRO-0: everything replicated, gradients all-reduced
    "zero1": (1, 8, 1, 1, 1, False),  # Adam's state split; parameters and gradients whole
    "zero2": (1, 8, 1, 1, 2, False),  # and the gradients reduce-scattered
    "fsdp": (1, 8, 1, 1, 3, False),  # ZeRO-3: parameters split and all-gathered before use
    "fsdp4_tp2": (1, 4, 2, 1, 3, False),
    "fsdp4_tp2_sp": (1, 4, 2, 1, 3, True),
    "fsdp2_tp4_sp": (1, 2, 4, 1, 3, True),
    "tp8": (1, 1, 8, 1, 3, False),
    "tp8_sp": (1, 1, 8, 1, 3, True),
    "fsdp4_cp2": (1, 4, 1, 2, 3, False),
    "fsdp2_cp4": (1, 2, 1, 4, 3, False),
    "cp8": (1, 1, 1, 8, 3, False),  # the model state still split 8 ways: context devices shard it too
    "fsdp2_tp2_sp_cp2": (1, 2, 2, 2, 3, True),
}
# At the CPU preset (4 query heads over 2 K/V heads: tensor up to 2) on 8 simulated devices.
LAYOUTS_CPU = {name: layout for name, layout in LAYOUTS_X8.items() if layout[2] <= 2}


DEVICES = 8  # the GPUs the plans are for (the CPU presets: 8 simulated devices)


def config_for(preset, devices: int):
    """bf16, scanned layers, Block remat, flash attention; two sequences per device in a step. At the Llama 3.1 8B
    the sequence is 8192; at cpu-llama (8 simulated devices) 256, 5 steps."""
    config = base_config(preset, name="layouts")
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    # The Pallas flash kernel on GPUs; on CPU it runs interpreted (slow), so the plain-JAX chunked one there.
    config.model.attention = "chunked" if config.preset in ("cpu-llama", "tiny-llama") else "flash"
    config.data.batch_size = 2 * devices
    if config.preset == "llama3.1-8b":
        config.data.seq_len = 8192
    if config.preset in ("cpu-llama", "tiny-llama"):
        config.train.update(steps=5, warmup_steps=1)
        config.profile.steps = 1
    return config


def variants_for(config, layouts: dict):
    """Two variants per layout: `<name>`, whose minibatch is one sequence per device that splits the batch
    (data x fsdp), and `<name>_whole`, the whole batch in one minibatch (fewer weight gathers and gradient
    reductions, more activations), where the two differ."""
    variants = []
    for name, (data, fsdp, tensor, context, stage, sp) in layouts.items():
        mesh = {
            "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "mesh.context": context,
            "mesh.zero_stage": stage, "mesh.sequence_parallel": sp,
        }  # fmt: skip
        minibatches = config.data.batch_size // (data * fsdp)
        variants.append({"name": name, **mesh, "train.num_minibatches": minibatches})
        if minibatches > 1:
            variants.append({"name": f"{name}_whole", **mesh, "train.num_minibatches": 1})
        if minibatches > 1 and stage == 2:  # ZeRO-2 reduces every minibatch by default; once a step as llm.c does
            variants.append({"name": f"{name}_step", **mesh, "train.num_minibatches": minibatches,
                             "mesh.reduce_gradients": "step"})  # fmt: skip
    return variants


def get_config(preset=None):
    return config_for(preset, DEVICES)


def get_variants(config):
    small = config.preset in ("cpu-llama", "tiny-llama")
    return variants_for(config, LAYOUTS_CPU if small else LAYOUTS_X8)

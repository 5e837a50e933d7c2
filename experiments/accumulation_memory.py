"""One gradient, not two: what accumulating minibatches costs in a step's memory, with each minibatch's whole gradient
made and then added (train.grad_accumulation=after_backward) and with the layers' and the chunked head's gradients
added into the accumulator inside the backward pass (in_backward; jaxscale.train.backward_accumulation), on one GPU
and laid out four ways over eight (docs/measurements.md, "One gradient, not two"; issue 41's item 2).

    python -m jaxscale.sweep --config experiments/accumulation_memory.py:llama3.1-8b --plan --target h100 \\
        --gemm cublas --devices 8

Llama 3.1 8B as it is (32 layers), bf16, no remat with the closed form, the Pallas flash kernel, a chunked loss (1,024
positions), Adam, one sequence of 4,096 positions per device per minibatch. For each layout, three plans: one
minibatch (`mb1`: the step's gradient is the backward pass's output, which the update reads), and four minibatches
accumulated after (`after4`) and inside (`in4`) the backward pass. The table (measurements_tables.accumulation_table)
gives each plan's temporaries and what accumulating adds to one minibatch's, beside the accumulator's bytes.
"""

from jaxscale.config import base_config

BASELINE = "one_mb1"

LAYOUTS = {  # name: (mesh.data, mesh.fsdp, mesh.zero_stage)
    "one": (1, 1, 3),
    "dp8": (8, 1, 3),  # data parallel: the accumulator whole on each device, reduced once a step
    "zero1": (1, 8, 1),  # the optimizer state split; the accumulator whole on each device, reduce-scattered once
    "zero2": (1, 8, 2),  # the gradients split too: each minibatch's reduce-scattered, the accumulator split
    "fsdp8": (1, 8, 3),  # ZeRO-3: the parameters split too
}
MODES = (("mb1", 1, "after_backward"), ("after4", 4, "after_backward"), ("in4", 4, "in_backward"))


def get_config(preset=None):
    config = base_config(preset, name="accumulation_memory")
    config.model.update(scan_layers=True, remat=(), residuals="closed_form", attention="flash", dropout_rate=0.0,
                        max_seq_len=4096)  # fmt: skip
    config.data.update(batch_size=1, seq_len=4096)
    config.train.update(num_minibatches=1, loss_chunk_len=1024)
    config.optimizer.name = "adam"
    return config


def get_variants(config):
    """`<layout>_<mode>` for each of LAYOUTS and MODES: one sequence per device per minibatch."""
    return [
        {"name": f"{layout}_{mode}", "mesh.data": data, "mesh.fsdp": fsdp, "mesh.zero_stage": stage,
         "data.batch_size": minibatches * data * fsdp, "train.num_minibatches": minibatches,
         "train.grad_accumulation": accumulation}
        for layout, (data, fsdp, stage) in LAYOUTS.items()
        for mode, minibatches, accumulation in MODES
    ]  # fmt: skip

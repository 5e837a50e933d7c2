"""Pipeline parallelism, compiled and planned deviceless (jaxscale.model.pipeline): GPipe and circular schedules in one
jitted program, their memory per stage and their bubble, beside the layouts without a pipeline.

    python -m jaxscale.sweep --config experiments/pipeline.py:llama3.1-8b --plan --target h100 --devices 8
    python -m jaxscale.sweep --config experiments/pipeline.py:llama3.1-70b --plan --target h100 --devices 64
    python -m jaxscale.sweep --config experiments/pipeline.py:llama3.1-405b --plan --target h100 --devices 512

Every variant: bf16, scanned layers, Block remat (each layer keeps its input), the Pallas flash attention, sequence
8192, the loss in chunks of 1024 positions, one sequence a microbatch per data-parallel group.
- llama3.1-8b on 8 H100s, 4 stages x tensor 2: GPipe with 1, 2, 4, 8 and 16 microbatches in flight (one minibatch a
  step, the batch growing with them), to show what GPipe in one program keeps (every in-flight microbatch's
  residuals, so the plan grows with m) against the bubble (p - 1)/(m + p - 1) it buys down; circular with 2 and 4
  visits; and no_pipeline, FSDP 4 x tensor 2 on the batch of m = 8.
- llama3.1-70b on 64 H100s (8 hosts of 8): Megatron-Bridge's layout (tensor 4 x pipeline 8 x data 2 with its
  distributed optimizer, ZeRO-1 over the 2; 128 sequences a step), GPipe and circular with 5 visits (its virtual
  pipeline 5: 2 layers a visit), 8 microbatches in flight (8 minibatches accumulated; 16 without data parallelism);
  tensor 8 x pipeline 8; and no_pipeline, FSDP 8 x tensor 8.
- llama3.1-405b on 512 H100s: its 126 layers split evenly into 2 stages only among the divisors of 512 (torchtitan's
  pipeline 8 splits them unevenly, which this schedule does not): FSDP 32 x tensor 8 x pipeline 2, and no_pipeline,
  FSDP 64 x tensor 8.
BASELINE, each preset's no_pipeline: the same GPUs and batch without a pipeline.
"""

from jaxscale.config import base_config

SEQ_LEN = 8192
BASELINE = "no_pipeline"


def get_config(preset=None):
    config = base_config(preset, name="pipeline")
    config.model.scan_layers = True
    config.model.remat = ("Block",)
    config.model.attention = "flash"
    config.data.seq_len = SEQ_LEN
    config.data.batch_size = 8
    config.train.num_minibatches = 1
    # the loss a chunk of 1024 positions at a time: the head runs on every stage for every row (outside the pipeline,
    # docs/mesh.md), and whole float32 logits of 8 sequences would be most of a stage's memory
    config.train.loss_chunk_len = 1024
    return config


def _pipeline(name, stage, microbatches, repeats=1, data=1, fsdp=1, tensor=1, minibatches=1, zero_stage=3):
    """A variant: mesh data x fsdp x tensor x stage, `microbatches` of one sequence per data x fsdp group in flight,
    `minibatches` of them accumulated a step."""
    return {
        "name": name, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "mesh.stage": stage,
        "mesh.zero_stage": zero_stage,
        "mesh.pipeline_microbatches": microbatches, "mesh.pipeline_repeats": repeats,
        "train.num_minibatches": minibatches, "data.batch_size": microbatches * minibatches * data * fsdp,
    }  # fmt: skip


def get_variants(config):
    if config.preset == "llama3.1-8b":
        gpipe = [_pipeline(f"pp4_tp2_m{m}", 4, m, tensor=2) for m in (1, 2, 4, 8, 16)]
        circular = [_pipeline(f"pp4v{v}_tp2_m8", 4, 8, v, tensor=2) for v in (2, 4)]
        plain = {"name": BASELINE, "mesh.fsdp": 4, "mesh.tensor": 2, "data.batch_size": 8}  # the batch of m = 8
        return [plain, *gpipe, *circular]
    if config.preset == "llama3.1-70b":
        return [
            # Megatron's distributed optimizer: the Adam state split over the 2 data-parallel groups (ZeRO-1)
            _pipeline("pp8_tp4_zero1x2_m8", 8, 8, fsdp=2, tensor=4, minibatches=8, zero_stage=1),
            _pipeline("pp8v5_tp4_zero1x2_m8", 8, 8, 5, fsdp=2, tensor=4, minibatches=8, zero_stage=1),
            _pipeline("pp8v5_tp8_m8", 8, 8, 5, tensor=8, minibatches=16),
            {"name": BASELINE, "mesh.fsdp": 8, "mesh.tensor": 8, "train.num_minibatches": 16,
             "data.batch_size": 128},  # FSDP 8 x tensor 8, the same 128 sequences a step; fmt: skip
        ]
    if config.preset == "llama3.1-405b":
        return [
            _pipeline("pp2_tp8_fsdp32_m2", 2, 2, fsdp=32, tensor=8, minibatches=1),
            {"name": BASELINE, "mesh.fsdp": 64, "mesh.tensor": 8, "data.batch_size": 64},  # FSDP 64 x tensor 8
        ]
    raise ValueError(f"experiments/pipeline.py: no variants for {config.preset}; use llama3.1-8b, -70b or -405b")

"""Typed views of a run config: the model, the device mesh and the whole run (RunSpec), with every derived size.

A `ConfigDict` holds what the user set; what follows from it (query and K/V heads, the MLP width, the mesh's
device count, the devices a batch is split over, sequences per device) is derived here and nowhere else, so
validation, the model, the analytic memory model and the planners read the same numbers. `RunSpec` gathers what
the analytic models read of a run (the model, the mesh and its layout facts, the batch, the optimizer, what trains)
in one frozen view, built once from the config and passed down instead of the config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import ml_collections

from jaxscale.config.finetune import FinetuneSpec


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The `model` group of the run config as a frozen (hashable: Flax module attributes must be) dataclass.

    The fields and their meaning are those of jaxscale.config.defaults.base_config.
    """

    family: str = "gpt"
    vocab_size: int = 2048
    hidden_size: int = 1024
    head_dim: int = 128
    num_layers: int = 12
    mlp_expansion: int = 4
    mlp_hidden_size: int = 0
    num_kv_heads: int = 0
    max_seq_len: int = 512
    dropout_rate: float = 0.1
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    softmax_dtype: str = "float32"
    reduce_dtype: str = "float32"
    causal: bool = True
    remat: tuple[str, ...] = ()
    remat_policy: str = "nothing_saveable"
    residuals: str = "closed_form"
    scan_layers: bool = False
    attention: str = "reference"
    attention_block_q: int = 0
    attention_block_k: int = 0
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6
    tie_embeddings: bool = False
    num_attention_heads: int = 0
    qk_norm: str = "none"
    num_experts: int = 0
    experts_per_token: int = 2
    moe_hidden_size: int = 0
    num_shared_experts: int = 0
    moe_routing: str = "topk_softmax"
    moe_dispatch: str = "scatter"
    moe_capacity_factor: float = 1.25
    moe_aux_loss_weight: float = 0.01
    moe_balance_scope: str = "minibatch"
    moe_z_loss_weight: float = 0.0
    first_dense_layers: int = 0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("attention",)
    fp8: str = "none"
    fp8_targets: tuple[str, ...] = ("attention", "mlp")
    fp8_amax_history: int = 1024
    # the pipeline's (microbatches, repeats, gather_once), from the mesh group (step_model; jaxscale.model.pipeline):
    # not a field of the `model` group
    pipeline: tuple[int, int, bool] = dataclasses.field(default=(0, 1, False), metadata={"from_mesh": True})

    @property
    def num_heads(self) -> int:
        """Query heads: num_attention_heads, or hidden_size // head_dim when it is 0."""
        return self.num_attention_heads or self.hidden_size // self.head_dim

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention's output before its projection): heads x head_dim
        (hidden_size unless num_attention_heads says otherwise, as in Qwen3)."""
        return self.num_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or one per query head when it is 0 (multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): K/V heads x head_dim (hidden_size without grouped-query)."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: mlp_hidden_size, or mlp_expansion * hidden_size when it is 0."""
        return self.mlp_hidden_size or self.mlp_expansion * self.hidden_size

    @property
    def expert_width(self) -> int:
        """One routed expert's SwiGLU width: moe_hidden_size, or mlp_width when it is 0."""
        return self.moe_hidden_size or self.mlp_width

    @property
    def moe_layers(self) -> int:
        """Blocks whose feed-forward is the mixture of experts: all but the first_dense_layers (0 when dense)."""
        return self.num_layers - self.first_dense_layers if self.num_experts else 0

    @property
    def projection_sizes(self) -> dict[str, tuple[int, int]]:
        """Each projection of the family (jaxscale.config.finetune.PROJECTIONS' names): (input width, output width)
        of its matmul (a kernel [in..., out...])."""
        h, f, heads = self.hidden_size, self.mlp_width, self.num_heads * self.head_dim
        if self.family == "gpt":
            return {"qkv": (h, 3 * heads), "out": (heads, h), "up": (h, f), "down": (f, h)}
        return {"q": (h, heads), "k": (h, self.kv_width), "v": (h, self.kv_width), "out": (heads, h),
                "gate": (h, f), "up": (h, f), "down": (f, h)}  # fmt: skip

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelConfig:
        """Reads every field from a config's `model` group (a missing field is a KeyError)."""
        return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("from_mesh")})

    @classmethod
    def of(cls, model: ModelConfig | ml_collections.ConfigDict) -> ModelConfig:
        """`model` itself when it is a ModelConfig already (a RunSpec's), else read from the `model` group.

        Args:
          model: a ModelConfig, or a config's `model` group.

        Returns:
          The typed view.
        """
        return model if isinstance(model, ModelConfig) else cls.from_config(model)


class MeshShape(NamedTuple):
    """The device mesh's sizes, data x fsdp x tensor x context x expert (jaxscale.train.sharding lays the step out
    over it).

    The fields are in the order the mesh is written (`text`: committed rows and the docs name meshes so, and the
    context and expert axes came last); the device array's order, MESH_AXES, is derived from it below, tensor
    fastest."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1
    expert: int = 1
    stage: int = 1

    @property
    def devices(self) -> int:
        """Devices the mesh uses: data x fsdp x tensor x context x expert (1 for the single-device program)."""
        return math.prod(self)

    @property
    def batch_split(self) -> int:
        """Devices the batch is split over: data x fsdp x expert (expert-parallel devices are data parallel outside
        the experts; tensor- and context-parallel devices share sequences)."""
        return self.data * self.fsdp * self.expert

    @property
    def _written(self) -> int:
        """How many sizes `text` writes: 3, 4 when context splits, 5 when expert does, 6 when stage does."""
        return 6 if self.stage > 1 else 5 if self.expert > 1 else 4 if self.context > 1 else 3

    @property
    def text(self) -> str:
        """`data x fsdp x tensor`, e.g. "2x2x2", with `x context` appended when it splits ("1x2x1x4"), and
        `x context x expert` when expert does ("2x1x1x1x4")."""
        return "x".join(str(n) for n in self[: self._written])

    @property
    def axes_text(self) -> str:
        """The names of the sizes in `text`: "data x fsdp x tensor" (x context (x expert))."""
        return " x ".join(MeshShape._fields[: self._written])

    @property
    def physical(self) -> tuple[int, ...]:
        """The sizes in MESH_AXES's order, the shape of the device array."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)


# The device array's axes, outermost first: MeshShape's with stage moved outermost and tensor innermost, (stage, data,
# fsdp, context, expert, tensor). Consecutive devices (one host's, one NVLink domain's) then form the tensor-parallel
# groups, whose collectives run inside every layer, and next the expert-parallel ones (an all-to-all each way in every
# MoE layer); the pipeline's stages, which pass one microbatch's activations a hop, are the farthest apart (across
# hosts, as Megatron and torchtitan place them); the written order (MeshShape, `text`) stays the rows' and the docs'.
MESH_AXES = ("stage", *(axis for axis in MeshShape._fields if axis not in ("tensor", "stage")), "tensor")


def mesh_shape(config: ml_collections.ConfigDict) -> MeshShape:
    """The config's mesh (the `mesh` group validation requires)."""
    return MeshShape(*(int(config.mesh[axis]) for axis in MeshShape._fields))


def mesh_text(config: ml_collections.ConfigDict) -> str:
    """The mesh as `data x fsdp x tensor` (x context when it splits), e.g. "2x2x2"."""
    return mesh_shape(config).text


def mesh_axes_text(text: str) -> str:
    """The names of the sizes in a mesh's text ("2x2x2": "data x fsdp x tensor"; four sizes: x context; five:
    x context x expert; six: x stage)."""
    return " x ".join(MeshShape._fields[: len(text.split("x"))])


def layout_text(config: ml_collections.ConfigDict) -> str:
    """The config's layout in a few words, each axis that splits: "dp2 zero1x4 tp2+sp cp2 ep2" (fsdp8 for ZeRO-3
    over 8 devices), "single" on one device."""
    mesh, words = mesh_shape(config), []
    if mesh.data > 1:
        words.append(f"dp{mesh.data}")
    if mesh.fsdp > 1:
        stage = zero_stage(config)
        words.append(f"fsdp{mesh.fsdp}" if stage == 3 else f"zero{stage}x{mesh.fsdp}")
    if mesh.tensor > 1:
        words.append(f"tp{mesh.tensor}" + ("+sp" if sequence_parallel(config) else ""))
    if mesh.context > 1:
        words.append(f"cp{mesh.context}")
    if mesh.expert > 1:
        words.append(f"ep{mesh.expert}")
    if mesh.stage > 1:  # pp4 (GPipe), pp4v2 (circular, each stage visited twice)
        repeats = int(config.mesh.pipeline_repeats)
        words.append(f"pp{mesh.stage}" + (f"v{repeats}" if repeats > 1 else ""))
    return " ".join(words) or "single"


def zero_stage(config: ml_collections.ConfigDict) -> int:
    """What the fsdp axis shards (ZeRO's stages, Rajbhandari et al. 2020): 1 the optimizer state, 2 and the
    gradients, 3 and the parameters (FSDP)."""
    return int(config.mesh.zero_stage)


def accumulates_locally(config: ml_collections.ConfigDict) -> bool:
    """Whether the step accumulates gradients on each device over its minibatches and reduces them once a step
    (mesh.reduce_gradients "step"; "auto" chooses it where the gradients are whole anyway: data parallelism and
    ZeRO-1, without context parallelism), rather than reducing every minibatch's ("minibatch"; "auto" for ZeRO-2,
    whose point is split gradients, and ZeRO-3, torchtitan's FSDP2 default). Only where several minibatches split
    over devices. The one rule the layout (jaxscale.train.sharding.local_accumulation) and the analytic memory
    model read. Under expert parallelism (mesh.expert > 1) "auto" is "minibatch": a group of a device's own rows
    would need every expert; so it is with the ragged dispatch, whose jax.lax.ragged_dot jax.vmap cannot batch
    ("step" is refused for both, jaxscale.config.validation)."""
    mesh, stage = mesh_shape(config), zero_stage(config)
    mode = config.mesh.reduce_gradients
    if mode == "auto":
        ragged = bool(config.model.num_experts) and config.model.moe_dispatch == "ragged"
        once = mesh.context == 1 and mesh.expert == 1 and not ragged and (stage == 1 or mesh.fsdp == 1)
        mode = "step" if once else "minibatch"
    return config.train.num_minibatches > 1 and mesh.batch_split > 1 and mode == "step"


def why_not_in_backward_accumulation(config: ml_collections.ConfigDict) -> str | None:
    """Why the step cannot add each layer's gradient into the accumulator inside the backward pass
    (jaxscale.train.backward_accumulation) for `config`, one clause naming the field; None where it can: the
    layers are one nn.scan stack, several minibatches are accumulated (train.accumulate=scan), every parameter
    trains, and no layer sows state the step reads back (delayed FP8's scaling; a mixture of experts' router losses,
    a scalar sum, go through the stack's output)."""
    m, t = config.model, config.train
    reasons = (
        (t.num_minibatches <= 1, "train.num_minibatches is 1 (nothing is accumulated)"),
        (not m.scan_layers, "model.scan_layers is False (the layers are not one nn.scan stack)"),
        (t.accumulate != "scan", f"train.accumulate is {t.accumulate} (the reference loop adds whole gradients)"),
        (m.fp8 == "delayed", "model.fp8 is delayed (its scaling state is sown per layer)"),
        (config.mesh.stage > 1, "mesh.stage > 1 (the pipeline's loop makes the layers' gradients)"),
        (FinetuneSpec.from_config(config).mode != "all", "finetune.train leaves parameters frozen"),
    )
    return next((why for cond, why in reasons if cond), None)


def accumulates_in_backward(config: ml_collections.ConfigDict) -> bool:
    """Whether the step adds each scanned layer's gradient into the minibatches' accumulator inside the backward
    pass (train.grad_accumulation "in_backward", or "auto" where why_not_in_backward_accumulation finds no reason
    against): the one rule the step and the analytic memory model read."""
    mode = config.train.grad_accumulation
    return mode != "after_backward" and why_not_in_backward_accumulation(config) is None


def sequence_parallel(config: ml_collections.ConfigDict) -> bool:
    """Megatron sequence parallelism: with mesh.tensor > 1, the residual stream split along its sequence too."""
    return bool(config.mesh.sequence_parallel) and mesh_shape(config).tensor > 1


def capacity(seq_len: int, k: int, num_experts: int, factor: float) -> int:
    """A mixture of experts' slots per expert per sequence: ceil(factor x seq_len x k / num_experts), at least 1
    (GShard's capacity; the capacity and scatter dispatches of jaxscale.model.moe, and the memory model's count)."""
    return max(1, math.ceil(factor * seq_len * k / num_experts))


def step_model(config: ml_collections.ConfigDict) -> ModelConfig:
    """The model as the train step builds it: `model.reduce_dtype` is the dtype weight gradients are summed over
    devices in, so it applies where the tokens are split over devices (mesh data x fsdp x expert x context > 1); on one
    device (or tensor parallelism alone) nothing is summed over devices and the step is Flax's default program
    ("compute"), the one the notebook's table was measured with."""
    model = ModelConfig.from_config(config.model)
    mesh = mesh_shape(config)
    if mesh.batch_split * mesh.context == 1:
        model = dataclasses.replace(model, reduce_dtype="compute")
    if mesh.stage > 1:
        pipeline = (config.mesh.pipeline_microbatches, config.mesh.pipeline_repeats, config.mesh.pipeline_gather_once)
        model = dataclasses.replace(model, pipeline=pipeline)
    return model


def tokens_per_step(config: ml_collections.ConfigDict) -> int:
    """Tokens one optimizer step trains on: data.batch_size sequences x data.seq_len positions (every minibatch,
    all devices together)."""
    return config.data.batch_size * config.data.seq_len


def pipeline_microbatches(config: ml_collections.ConfigDict) -> int:
    """A pipeline's microbatches a minibatch: mesh.pipeline_microbatches, or mesh.stage when 0; 1 without a
    pipeline (mesh.stage 1)."""
    stages = config.mesh.stage
    return (config.mesh.pipeline_microbatches or stages) if stages > 1 else 1


def minibatch_per_device(config: ml_collections.ConfigDict) -> int:
    """Sequences one device holds per minibatch: data.batch_size / train.num_minibatches / (data x fsdp x expert)."""
    return config.data.batch_size // config.train.num_minibatches // mesh_shape(config).batch_split


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One typed view of a run: everything the analytic models (jaxscale.measure.memory, its activation sizes and
    its parameter tables) read of a config, derived once by the rules above and in jaxscale.config.finetune.

    Built once per estimate (`from_config`) and passed down, so no helper below asks the ConfigDict again. The
    layout tables (jaxscale.config.layout_rules.table) follow from zero_stage and sequence_parallel."""

    model: ModelConfig
    mesh: MeshShape
    zero_stage: int  # mesh.zero_stage (zero_stage)
    seq_len: int  # data.seq_len
    batch_size: int  # data.batch_size: sequences per optimizer step, every minibatch and device together
    num_minibatches: int  # train.num_minibatches
    accumulate: str  # train.accumulate: scan | loop
    accumulates_in_backward: bool  # each layer's gradient added into the accumulator in the backward pass
    loss_chunk_len: int  # train.loss_chunk_len (0: the whole sequence)
    minibatch_per_device: int  # sequences one device holds per minibatch (minibatch_per_device)
    sequence_parallel: bool  # the residual stream split along its sequence too (sequence_parallel)
    accumulates_locally: bool  # gradients accumulated on each device, reduced once a step (accumulates_locally)
    optimizer: str  # optimizer.name
    state_dtype: str  # optimizer.state_dtype: float32 | bfloat16 | int8
    offload_state: bool  # optimizer.offload_state
    offload_params: bool  # train.offload_params
    bf16_rounding: str  # optimizer.bf16_rounding where model.param_dtype is bfloat16, "" for float32 weights
    in_backward: bool  # optimizer.in_backward: each layer updated inside the backward pass (no whole gradient)
    tokens_per_step: int  # tokens one optimizer step trains on (tokens_per_step)
    pipeline_microbatches: int  # mesh.pipeline_microbatches resolved (0: mesh.stage), 1 without a pipeline
    pipeline_repeats: int  # mesh.pipeline_repeats (visits of each stage), 1 without a pipeline
    finetune: FinetuneSpec  # what trains, what the backward pass goes through, how the frozen rest is stored

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> RunSpec:
        """Reads a run config once (a missing field is an error): every derived field by its rule above.

        Args:
          config: the run config (the groups model, mesh, data, train, optimizer and finetune).

        Returns:
          The run's view.
        """
        stages = config.mesh.stage
        return cls(
            model=ModelConfig.from_config(config.model),
            mesh=mesh_shape(config),
            zero_stage=zero_stage(config),
            seq_len=config.data.seq_len,
            batch_size=config.data.batch_size,
            num_minibatches=config.train.num_minibatches,
            accumulate=config.train.accumulate,
            accumulates_in_backward=accumulates_in_backward(config),
            loss_chunk_len=config.train.loss_chunk_len,
            minibatch_per_device=minibatch_per_device(config),
            sequence_parallel=sequence_parallel(config),
            accumulates_locally=accumulates_locally(config),
            optimizer=config.optimizer.name,
            state_dtype=config.optimizer.state_dtype,
            offload_state=config.optimizer.offload_state,
            offload_params=config.train.offload_params,
            bf16_rounding=config.optimizer.bf16_rounding if config.model.param_dtype == "bfloat16" else "",
            in_backward=config.optimizer.in_backward,
            tokens_per_step=tokens_per_step(config),
            pipeline_microbatches=pipeline_microbatches(config),
            pipeline_repeats=config.mesh.pipeline_repeats if stages > 1 else 1,
            finetune=FinetuneSpec.from_config(config),
        )

    @classmethod
    def of(cls, config: RunSpec | ml_collections.ConfigDict) -> RunSpec:
        """`config` itself when it is a RunSpec already (a caller that built the view passes it down), else
        from_config: for public entry points that take either.

        Args:
          config: a RunSpec, or the run config.

        Returns:
          The run's view.
        """
        return config if isinstance(config, RunSpec) else cls.from_config(config)

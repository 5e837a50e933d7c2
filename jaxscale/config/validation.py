"""Validation of a run config: each field the lab cannot run is one line naming it and what is allowed."""

from __future__ import annotations

import math

import jax
import ml_collections

from jaxscale.config import finetune, kernel_blocks, remat_policies
from jaxscale.config.defaults import (
    ACCUMULATE_METHODS,
    ATTENTION_IMPLS,
    BF16_ROUNDINGS,
    DATA_SOURCES,
    DTYPES,
    FAMILIES,
    FP8_MODES,
    FROZEN_DTYPES,
    GRAD_ACCUMULATIONS,
    MOE_BALANCE_SCOPES,
    MOE_DISPATCHES,
    MOE_ROUTINGS,
    OPTIMIZERS,
    PARAM_DTYPES,
    QK_NORMS,
    REDUCE_DTYPES,
    REMAT_POLICIES,
    REMAT_TARGETS,
    RESIDUALS,
    STATE_DTYPES,
    ConfigError,
)
from jaxscale.config.spec import ModelConfig, mesh_shape, mesh_text, why_not_in_backward_accumulation


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {message}")


def _positive(config: ml_collections.ConfigDict, *fields: str) -> None:
    for field in fields:
        group, key = field.split(".")
        value = config[group][key]
        _check(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}")


def _one_of(value: object, allowed: tuple, field: str) -> None:
    _check(value in allowed, field, f"unknown {value!r}; allowed: {', '.join(map(str, allowed))}")


def _validate_family(m: ml_collections.ConfigDict) -> None:
    """The fields of the model family: grouped-query heads, MLP width, RoPE and norm settings."""
    _one_of(m.family, FAMILIES, "model.family")
    for field in ("num_kv_heads", "mlp_hidden_size", "num_attention_heads"):
        value = m[field]
        _check(isinstance(value, int) and value >= 0, f"model.{field}", f"must be an integer >= 0, got {value!r}")
    sizes = ModelConfig.from_config(m)
    num_heads, kv_heads = sizes.num_heads, sizes.kv_heads
    if m.family == "gpt":
        _check(
            kv_heads == num_heads,
            "model.num_kv_heads",
            f"{m.num_kv_heads}: gpt's fused QKV projection has one K/V head per query head ({num_heads}, or 0); "
            "grouped-query attention needs model.family=llama",
        )
    _check(
        num_heads % kv_heads == 0,
        "model.num_kv_heads",
        f"{m.num_kv_heads} does not divide the {num_heads} query heads (hidden_size / head_dim); allowed: "
        + ", ".join(str(n) for n in range(1, num_heads + 1) if num_heads % n == 0),
    )
    if m.family == "llama":
        _check(
            m.head_dim % 2 == 0, "model.head_dim", f"{m.head_dim}: rotary embeddings rotate pairs, so it must be even"
        )
    _check(m.rope_theta > 0, "model.rope_theta", f"must be > 0, got {m.rope_theta}")
    _check(m.norm_epsilon > 0, "model.norm_epsilon", f"must be > 0, got {m.norm_epsilon}")
    _check(
        isinstance(m.tie_embeddings, bool), "model.tie_embeddings", f"must be True or False, got {m.tie_embeddings!r}"
    )
    _one_of(m.qk_norm, QK_NORMS, "model.qk_norm")
    for field, default in (("num_attention_heads", 0), ("qk_norm", "none")):
        _check(m.family == "llama" or m[field] == default, f"model.{field}",
               f"{m[field]!r} is built for model.family=llama only; allowed for gpt: {default!r}")  # fmt: skip


def _flash_blocks(m: ml_collections.ConfigDict, seq_len: int) -> None:
    """model.attention_block_q / _k of flash: powers of two dividing data.seq_len whose tiles fit the shared
    memory of an H100 (kernel_blocks.forward_shared_memory); a block left 0 takes the default."""
    itemsize = 4 if m.dtype == "float32" else 2
    powers = [1 << i for i in range(seq_len.bit_length()) if seq_len % (1 << i) == 0]
    default = kernel_blocks.default_block(m.head_dim, seq_len, itemsize)
    for field in ("attention_block_q", "attention_block_k"):
        block = m[field]
        allowed = ", ".join(map(str, powers))
        _check(block == 0 or block in powers, f"model.{field}", f"{block} must be a power of two dividing "
               f"data.seq_len={seq_len} (Triton tiles); allowed: 0 (default) or {allowed}")  # fmt: skip
    block_q, block_k = m.attention_block_q or default, m.attention_block_k or default
    need, limit = (
        kernel_blocks.forward_shared_memory(block_q, block_k, m.head_dim, itemsize),
        kernel_blocks.SHARED_MEMORY_BYTES,
    )
    _check(need <= limit, "model.attention_block_q" if m.attention_block_q else "model.attention_block_k",
           f"blocks of {block_q} queries and {block_k} keys at model.head_dim={m.head_dim} ({m.dtype}) need "
           f"{need:,} bytes of shared memory in the flash forward kernel, over an H100's {limit:,}; "
           f"use smaller blocks, or 0 for the default ({default})")  # fmt: skip


def _validate_attention(m: ml_collections.ConfigDict, seq_len: int) -> None:
    """The kernel and its block sizes: chunked's key block divides data.seq_len; flash's see _flash_blocks."""
    _one_of(m.attention, ATTENTION_IMPLS, "model.attention")
    for field in ("attention_block_q", "attention_block_k"):
        _non_negative_int(m[field], f"model.{field}")
    if m.attention == "chunked" and m.attention_block_k:
        _check(seq_len % m.attention_block_k == 0, "model.attention_block_k",
               f"{m.attention_block_k} does not divide data.seq_len={seq_len}; allowed: 0 (default) or "
               f"{_divisors(seq_len)}")  # fmt: skip
    if m.attention == "flash":
        _flash_blocks(m, seq_len)


def check_backend(config: ml_collections.ConfigDict, gpu_target: bool = False) -> None:
    """Raises ConfigError when this backend cannot compile what the config asks for: cuDNN attention needs a CUDA
    GPU backend, or a plan for a GPU target (`gpu_target`: --plan --target, compiled by XLA's GPU compiler with
    cuDNN's libraries from the gpu-plan-cudnn extra, docs/attention.md). A valid config (validate) can still be
    one this machine cannot run."""
    if config.model.attention == "cudnn" and not gpu_target:
        _check(
            jax.default_backend() == "gpu",
            "model.attention",
            f"'cudnn' needs a CUDA GPU backend, or a plan for a GPU target (--plan --target); this backend is "
            f"{jax.default_backend()}; allowed here: reference, xla, chunked, flash (interpret mode)",
        )


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first field that the lab cannot run."""
    _positive(config, "model.vocab_size", "model.hidden_size", "model.head_dim", "model.num_layers")
    _positive(config, "model.mlp_expansion", "model.max_seq_len", "data.batch_size", "data.seq_len")
    _positive(config, "train.num_minibatches", "train.steps")
    m, d, t, o = config.model, config.data, config.train, config.optimizer
    _check(
        m.hidden_size % m.head_dim == 0,
        "model.hidden_size",
        f"{m.hidden_size} is not divisible by model.head_dim={m.head_dim}",
    )
    _check(d.seq_len <= m.max_seq_len, "data.seq_len", f"{d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    _check(
        d.batch_size % t.num_minibatches == 0,
        "data.batch_size",
        f"{d.batch_size} is not divisible by train.num_minibatches={t.num_minibatches}",
    )
    _validate_family(m)
    _one_of(m.dtype, DTYPES, "model.dtype")
    _one_of(m.softmax_dtype, DTYPES, "model.softmax_dtype")
    _one_of(m.reduce_dtype, REDUCE_DTYPES, "model.reduce_dtype")
    _check(isinstance(m.remat, tuple), "model.remat", f"must be a tuple of names from {REMAT_TARGETS}")
    for target in m.remat:
        _one_of(target, REMAT_TARGETS, "model.remat")
    if isinstance(m.remat_policy, str) and m.remat_policy.startswith(remat_policies.PER_ACTIVATION):
        try:
            remat_policies.per_activation(m.remat_policy)
        except KeyError:
            raise ConfigError(
                f"model.remat_policy: {m.remat_policy!r}: per_activation: takes activation=place pairs, each "
                f"activation once; activations: {', '.join(remat_policies.ACTIVATIONS)}; places: "
                f"{', '.join(remat_policies.PLACES)}"
            ) from None
    else:
        _one_of(m.remat_policy, REMAT_POLICIES, "model.remat_policy")
    _one_of(m.residuals, RESIDUALS, "model.residuals")
    _validate_attention(m, d.seq_len)
    _check(0.0 <= m.dropout_rate < 1.0, "model.dropout_rate", f"must be in [0, 1), got {m.dropout_rate}")
    _one_of(t.accumulate, ACCUMULATE_METHODS, "train.accumulate")
    _one_of(t.grad_accumulation, GRAD_ACCUMULATIONS, "train.grad_accumulation")
    # one minibatch accumulates nothing, so in_backward asks nothing of it there
    asked = t.grad_accumulation == "in_backward" and t.num_minibatches > 1
    refusal = why_not_in_backward_accumulation(config) if asked else None
    _check(refusal is None, "train.grad_accumulation", f"in_backward: {refusal}; allowed here: auto, after_backward")
    _validate_loss_chunk(t.loss_chunk_len, d.seq_len)
    _validate_data_and_eval(d, t)
    _check(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _check(config.profile.steps >= 0, "profile.steps", f"must be >= 0, got {config.profile.steps}")
    _validate_mesh(config)
    _one_of(o.name, OPTIMIZERS, "optimizer.name")
    _check(o.learning_rate > 0, "optimizer.learning_rate", f"must be > 0, got {o.learning_rate}")
    _check(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(o.transition_steps > 0, "optimizer.transition_steps", f"must be > 0, got {o.transition_steps}")
    _check(o.grad_clip_norm >= 0, "optimizer.grad_clip_norm", f"must be >= 0, got {o.grad_clip_norm}")
    _one_of(o.state_dtype, STATE_DTYPES, "optimizer.state_dtype")
    _one_of(config.model.param_dtype, PARAM_DTYPES, "model.param_dtype")
    _one_of(o.bf16_rounding, BF16_ROUNDINGS, "optimizer.bf16_rounding")
    _check(o.state_dtype != "int8" or o.name in ("adam", "adamw"), "optimizer.state_dtype",
           f"int8 (block-wise quantized Adam moments) needs optimizer.name adam or adamw, got {o.name}; "
           f"allowed with {o.name}: float32" + (", bfloat16" if o.name == "sgd" else ""))  # fmt: skip
    _check(o.state_dtype == "float32" or o.name != "adafactor", "optimizer.state_dtype",
           f"{o.state_dtype} changes nothing for adafactor (no first moment; its factored second moments stay "
           "float32); use float32, or adam / adamw / sgd")  # fmt: skip
    _validate_lora(m)
    _validate_moe(config)
    _validate_fp8(m, config.train.loss_chunk_len)
    _validate_finetune(config)
    _validate_offload(config)
    _validate_in_backward(config)
    _validate_pipeline(config)


def _validate_pipeline(config: ml_collections.ConfigDict) -> None:
    """mesh.stage > 1 (jaxscale.model.pipeline): the scanned stack split evenly into stages (and, circular, into
    repeats), microbatches that split each device's rows, and what the pipelined stack does not carry refused."""
    mesh, m, t = config.mesh, config.model, config.train
    _non_negative_int(mesh.pipeline_microbatches, "mesh.pipeline_microbatches")
    _check(isinstance(mesh.pipeline_repeats, int) and mesh.pipeline_repeats >= 1, "mesh.pipeline_repeats",
           f"must be an integer >= 1 (1: GPipe), got {mesh.pipeline_repeats!r}")  # fmt: skip
    _check(isinstance(mesh.pipeline_gather_once, bool), "mesh.pipeline_gather_once",
           f"must be True or False, got {mesh.pipeline_gather_once!r}")  # fmt: skip
    stages = mesh.stage
    if stages == 1:
        return
    why = f"mesh.stage={stages} pipelines nn.scan's stacked layers, so"
    _check(m.scan_layers, "model.scan_layers", f"{why} they must be one stack: set it True (or mesh.stage=1)")
    visits = stages * mesh.pipeline_repeats
    _check(m.num_layers % visits == 0, "model.num_layers", f"{m.num_layers} does not split into mesh.stage x "
           f"mesh.pipeline_repeats = {visits} equal groups of layers; stage x repeats may be: "
           f"{_divisors(m.num_layers)}")  # fmt: skip
    micro = mesh.pipeline_microbatches or stages
    _check(mesh.pipeline_repeats == 1 or micro >= stages, "mesh.pipeline_microbatches",
           f"{micro}: the circular schedule (mesh.pipeline_repeats={mesh.pipeline_repeats}) needs at least mesh.stage="
           f"{stages} microbatches (a microbatch's next visit of stage 0 waits for its last stage); allowed: >= "
           f"{stages}")  # fmt: skip
    rows = config.data.batch_size // t.num_minibatches
    split = mesh_shape(config).batch_split
    allowed = ", ".join(str(d) for d in range(1, rows + 1) if rows % (d * split) == 0)
    _check(rows % (micro * split) == 0, "mesh.pipeline_microbatches", f"{micro} microbatches of the minibatch's {rows} "
           f"sequences, each split over data x fsdp x expert = {split} devices: {micro} x {split} must divide {rows}; "
           f"microbatches may be: {allowed}")  # fmt: skip
    _check(m.dropout_rate == 0, "model.dropout_rate", f"{m.dropout_rate}: {why} its layers run without dropout "
           "keys (not built); allowed: 0")  # fmt: skip
    _check(not m.num_experts, "model.num_experts", f"{m.num_experts}: {why} a mixture of experts' sown router losses "
           "are not carried out of the pipeline's loop (not built); allowed: 0")  # fmt: skip
    _check(m.fp8 != "delayed", "model.fp8", f"delayed: {why} the scaling state its layers return is not carried "
           "(not built); allowed: none, dynamic")  # fmt: skip
    _check(mesh.context == 1, "mesh.context", f"{mesh.context}: {why} the ring attention's shard_map would run "
           "inside the stages' vmap (not built); allowed: 1")  # fmt: skip
    _check(not config.optimizer.in_backward, "optimizer.in_backward", f"True: {why} the layers' gradients are made "
           "by the pipeline's loop, not the fused step; allowed: False")  # fmt: skip


def _validate_in_backward(config: ml_collections.ConfigDict) -> None:
    """optimizer.in_backward (jaxscale.train.fused_step): a boolean; the step it builds needs nn.scan's stacked layers,
    one minibatch, one device, every parameter trained and an optimizer that updates each parameter on its own."""
    o, m, t = config.optimizer, config.model, config.train
    _check(isinstance(o.in_backward, bool), "optimizer.in_backward", f"must be True or False, got {o.in_backward!r}")
    if not o.in_backward:
        return
    why = "optimizer.in_backward=True updates each layer as its gradient is made, so"
    _check(m.scan_layers, "model.scan_layers", f"{why} the layers must be one nn.scan stack: set it True")
    _check(t.num_minibatches == 1, "train.num_minibatches", f"{t.num_minibatches}: {why} no whole gradient exists to "
           "accumulate over minibatches; allowed: 1 (or optimizer.in_backward=False)")  # fmt: skip
    _check(o.grad_clip_norm == 0, "optimizer.grad_clip_norm", f"{o.grad_clip_norm}: {why} the global norm of the "
           "whole gradient is never known; allowed: 0 (or optimizer.in_backward=False)")  # fmt: skip
    _check(o.name in ("adam", "adamw", "sgd"), "optimizer.name", f"{o.name}: {why} the optimizer must update each "
           "parameter from its own gradient alone (adafactor scales by a stacked leaf's RMS); allowed: adam, adamw, "
           "sgd")  # fmt: skip
    _check(not m.num_experts, "model.num_experts", f"{m.num_experts}: {why} a mixture of experts' router losses are "
           "not carried through the hand-written backward pass; allowed: 0")  # fmt: skip
    _check(m.fp8 != "delayed", "model.fp8", f"delayed: {why} the scaling state the backward pass returns is not "
           "carried; allowed: none, dynamic")  # fmt: skip
    _check(finetune.trains_everything(config), "finetune.train", f"{why} it trains every parameter (full "
           "fine-tuning); LoRA and frozen blocks are not built with it")  # fmt: skip
    for field in ("data", "fsdp", "tensor", "context", "expert", "stage"):
        size = config.mesh[field]
        _check(size == 1, f"mesh.{field}", f"{size}: {why} it is built for one device; allowed: 1")
    _check(not t.offload_params, "train.offload_params", f"{why} the parameters stay on the device (the optimizer "
           "state may live on the host: optimizer.offload_state, paged a layer at a time); allowed: False")  # fmt: skip
    _check(not (o.offload_state and o.state_dtype == "int8"), "optimizer.state_dtype", f"int8: {why} a state on the "
           "host (optimizer.offload_state) is paged a layer at a time, and the 8-bit update is not built for host "
           "pages (XLA's GPU host offloader rejects its loop); allowed: float32, bfloat16")  # fmt: skip


def _validate_offload(config: ml_collections.ConfigDict) -> None:
    """optimizer.offload_state and train.offload_params (jaxscale.train.offload): booleans."""
    for field, value in (("optimizer.offload_state", config.optimizer.offload_state),
                         ("train.offload_params", config.train.offload_params)):  # fmt: skip
        _check(isinstance(value, bool), field, f"must be True or False, got {value!r}")


def _validate_lora(m: ml_collections.ConfigDict) -> None:
    """model.lora_rank, _alpha, _targets: known projections of the family, a rank below each one's widths."""
    _non_negative_int(m.lora_rank, "model.lora_rank")
    if not m.lora_rank:
        return
    _check(m.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {m.lora_alpha}")
    allowed = ", ".join((*finetune.TARGET_GROUPS, *finetune.family_projections(m.family)))
    _check(isinstance(m.lora_targets, tuple) and len(m.lora_targets) > 0, "model.lora_targets",
           f"must be a non-empty tuple of {allowed}, got {m.lora_targets!r}")  # fmt: skip
    try:
        chosen = finetune.lora_projections(m.family, m.lora_targets)
    except KeyError as unknown:
        raise ConfigError(f"model.lora_targets: unknown {unknown.args[0]!r} for model.family={m.family}; "
                          f"allowed: {allowed}") from None  # fmt: skip
    sizes = ModelConfig.from_config(m).projection_sizes
    narrowest = min(chosen, key=lambda name: min(sizes[name]))
    width = min(sizes[narrowest])
    shape = " x ".join(map(str, sizes[narrowest]))
    _check(m.lora_rank <= width, "model.lora_rank", f"{m.lora_rank} exceeds the {narrowest} projection's {shape} "
           f"(a rank is at most its smaller width); allowed: 1 to {width}")  # fmt: skip


def _validate_fp8(m: ml_collections.ConfigDict, loss_chunk_len: int) -> None:
    """model.fp8, model.fp8_targets and model.fp8_amax_history: a known mode; known projections of the family, or
    the untied head (not with delayed scaling under the chunked loss); a history of at least one step."""
    _one_of(m.fp8, FP8_MODES, "model.fp8")
    _check(isinstance(m.fp8_amax_history, int) and m.fp8_amax_history >= 1, "model.fp8_amax_history",
           f"must be a whole number of steps >= 1 (Flax's default 1024), got {m.fp8_amax_history!r}")  # fmt: skip
    allowed = ", ".join((*finetune.TARGET_GROUPS, finetune.HEAD, *finetune.family_projections(m.family)))
    _check(isinstance(m.fp8_targets, tuple) and len(m.fp8_targets) > 0, "model.fp8_targets",
           f"must be a non-empty tuple of {allowed}, got {m.fp8_targets!r}")  # fmt: skip
    try:
        finetune.fp8_projections(m.family, m.fp8_targets)
    except KeyError as unknown:
        raise ConfigError(f"model.fp8_targets: unknown {unknown.args[0]!r} for model.family={m.family}; "
                          f"allowed: {allowed}") from None  # fmt: skip
    tied = "head: the output head is the token embedding here (model.tie_embeddings); FP8 covers an untied head only"
    _check(finetune.HEAD not in m.fp8_targets or not m.tie_embeddings, "model.fp8_targets", tied)
    # the chunked loss applies the head once per chunk: each application would return its own new scaling state
    chunked = ("head with model.fp8=delayed needs the whole-logits loss (train.loss_chunk_len=0): the chunked loss "
               "applies the head once per chunk and delayed scaling keeps one amax history per tensor; use "
               "model.fp8=dynamic")  # fmt: skip
    _check(m.fp8 != "delayed" or finetune.HEAD not in m.fp8_targets or not loss_chunk_len, "model.fp8_targets", chunked)


def _validate_moe(config: ml_collections.ConfigDict) -> None:
    """The mixture of experts (jaxscale.model.moe): llama only, k of E experts, a known routing and dispatch, dense
    first layers only unscanned, no LoRA on the experts, expert widths the tensor axis divides."""
    m = config.model
    for field in ("num_experts", "experts_per_token", "moe_hidden_size", "num_shared_experts", "first_dense_layers"):
        _non_negative_int(m[field], f"model.{field}")
    if not m.num_experts:
        _check(m.first_dense_layers == 0, "model.first_dense_layers",
               f"{m.first_dense_layers} dense layers before the MoE ones, and model.num_experts=0 (every layer is "
               "dense); set model.num_experts > 0, or 0")  # fmt: skip
        return
    _check(m.family == "llama", "model.num_experts", f"{m.num_experts}: the mixture of experts is built for "
           f"model.family=llama (SwiGLU experts); allowed for {m.family}: 0")  # fmt: skip
    _check(1 <= m.experts_per_token <= m.num_experts, "model.experts_per_token",
           f"{m.experts_per_token}: allowed 1 to model.num_experts={m.num_experts}")  # fmt: skip
    _one_of(m.moe_routing, MOE_ROUTINGS, "model.moe_routing")
    _one_of(m.moe_dispatch, MOE_DISPATCHES, "model.moe_dispatch")
    _one_of(m.moe_balance_scope, MOE_BALANCE_SCOPES, "model.moe_balance_scope")
    _check(m.moe_capacity_factor > 0, "model.moe_capacity_factor", f"must be > 0, got {m.moe_capacity_factor}")
    for field in ("moe_aux_loss_weight", "moe_z_loss_weight"):
        _check(m[field] >= 0, f"model.{field}", f"must be >= 0, got {m[field]}")
    _check(m.first_dense_layers < m.num_layers, "model.first_dense_layers",
           f"{m.first_dense_layers}: allowed 0 to model.num_layers - 1 = {m.num_layers - 1}")  # fmt: skip
    _check(not (m.first_dense_layers and m.scan_layers), "model.first_dense_layers", f"{m.first_dense_layers} "
           "dense layers before the MoE ones need unrolled layers (nn.scan stacks one kind of block); set "
           "model.scan_layers=False, or 0")  # fmt: skip
    mlp_adapters = set(finetune.lora_projections(m.family, tuple(m.lora_targets))) & {"gate", "up", "down"}
    _check(not (m.lora_rank and mlp_adapters), "model.lora_targets", f"{sorted(mlp_adapters)}: the experts' "
           "stacked weights carry no LoRA adapters; with model.num_experts > 0 allowed: attention, q, k, v, "
           "out")  # fmt: skip
    sizes, tensor = ModelConfig.from_config(m), config.mesh.tensor
    _check(sizes.expert_width % tensor == 0, "mesh.tensor", f"{tensor} does not divide the experts' width "
           f"{sizes.expert_width} (model.moe_hidden_size); tensor may be: {_divisors(sizes.expert_width)}")  # fmt: skip


def _validate_finetune(config: ml_collections.ConfigDict) -> None:
    """Which parameters train (jaxscale.config.finetune) and the dtype the frozen ones are kept in."""
    f, m = config.finetune, config.model
    _one_of(f.train, finetune.TRAIN_CHOICES, "finetune.train")
    _one_of(f.frozen_dtype, FROZEN_DTYPES, "finetune.frozen_dtype")
    if f.frozen_dtype == finetune.NF4:  # QLoRA: the 4-bit base under trained adapters (jaxscale.model.nf4)
        mode = finetune.train_mode(config)
        _check(mode == "adapters", "finetune.frozen_dtype", f"nf4 is QLoRA's base, frozen in 4 bits under trained LoRA "
               f"adapters: it needs finetune.train=adapters (or auto with model.lora_rank > 0), not {mode}; or "
               "frozen_dtype=bfloat16")  # fmt: skip
        _check(m.fp8 == "none", "finetune.frozen_dtype", f"nf4 kernels are dequantized to model.dtype for their "
               f"matmul, which model.fp8={m.fp8} would run in FP8; use one of the two (model.fp8=none)")  # fmt: skip
    _check(isinstance(f.head, bool), "finetune.head", f"must be True or False, got {f.head!r}")
    _non_negative_int(f.last_blocks, "finetune.last_blocks")
    if f.train == "adapters":  # as given: "auto" resolves to adapters only where there are some
        _check(m.lora_rank > 0, "finetune.train", "'adapters' trains the LoRA adapters, and there are none: set "
               "model.lora_rank > 0 (e.g. 16), or finetune.train=all or last_blocks")  # fmt: skip
    if f.train == "last_blocks":
        _check(f.last_blocks <= m.num_layers and (f.last_blocks >= 1 or f.head), "finetune.last_blocks",
               f"{f.last_blocks}: train=last_blocks needs 1 to model.num_layers={m.num_layers} blocks (0 with "
               "finetune.head=True: the head alone)")  # fmt: skip
        _check(not m.scan_layers, "model.scan_layers", "True stacks every block in one array per parameter, so "
               "finetune.train=last_blocks cannot freeze some of them; set model.scan_layers=False, or "
               "finetune.train=adapters")  # fmt: skip


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _validate_mesh(config: ml_collections.ConfigDict) -> None:
    """Each mesh axis divides what it splits (JAX shards only evenly): see jaxscale.config.layout_rules.RULES."""
    _positive(config, "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.context", "mesh.expert", "mesh.stage")
    m, sizes, mesh = config.model, ModelConfig.from_config(config.model), mesh_shape(config)
    (data, fsdp, tensor, context, expert, _), minibatch = mesh, config.data.batch_size // config.train.num_minibatches
    _one_of(config.mesh.zero_stage, (1, 2, 3), "mesh.zero_stage")
    _zero_stage_splits(config.mesh.zero_stage, fsdp, context, expert)
    _one_of(config.mesh.reduce_gradients, ("auto", "step", "minibatch"), "mesh.reduce_gradients")
    _check(config.mesh.reduce_gradients != "step" or config.mesh.zero_stage < 3 or fsdp == 1,
           "mesh.reduce_gradients", "step accumulates a whole gradient on each device, which ZeRO-3 over "
           f"mesh.fsdp={fsdp} does not hold (its parameters are split); use minibatch or auto, or "
           "mesh.zero_stage 1 or 2")  # fmt: skip
    _check(config.mesh.reduce_gradients != "step" or context == 1, "mesh.reduce_gradients",
           f"step is not built for context parallelism (mesh.context={context}: the ring attention's shard_map is "
           "not taken per group of rows); use minibatch or auto")  # fmt: skip
    _check(config.mesh.reduce_gradients != "step" or expert == 1, "mesh.reduce_gradients",
           f"step is not built for expert parallelism (mesh.expert={expert}: a device's group of rows would need "
           "every expert); use minibatch or auto")  # fmt: skip
    ragged = bool(m.num_experts) and m.moe_dispatch == "ragged"
    _check(config.mesh.reduce_gradients != "step" or not ragged, "mesh.reduce_gradients",
           "step takes each device's gradient under jax.vmap, which cannot batch the ragged dispatch's "
           "jax.lax.ragged_dot (JAX raises NotImplementedError); use minibatch or auto, or model.moe_dispatch "
           "scatter, capacity or dense")  # fmt: skip
    _check(isinstance(config.mesh.sequence_parallel, bool), "mesh.sequence_parallel",
           f"must be True or False, got {config.mesh.sequence_parallel!r}")  # fmt: skip
    _check(not config.mesh.sequence_parallel or tensor > 1, "mesh.sequence_parallel",
           "splits the residual stream over the tensor axis: set mesh.tensor > 1, or False")  # fmt: skip
    _validate_context(config, context)
    # outside a pipeline's loop the positions are split over its stages too (jaxscale.config.layout_rules)
    seq_split = context * (tensor if config.mesh.sequence_parallel else 1) * config.mesh.stage
    _check(
        config.data.seq_len % seq_split == 0,
        "data.seq_len",
        f"{config.data.seq_len} is not divisible by the {seq_split} devices its sequence is split over (mesh.context"
        f"{' x mesh.tensor with sequence parallelism' if config.mesh.sequence_parallel else ''}"
        f"{' x mesh.stage outside the pipeline' if config.mesh.stage > 1 else ''})",
    )
    _check(
        minibatch % (data * fsdp) == 0,
        "mesh",
        f"data x fsdp = {data}x{fsdp} = {data * fsdp} does not divide the minibatch of {minibatch} sequences "
        f"(data.batch_size / train.num_minibatches); data x fsdp may be: {_divisors(minibatch)}",
    )
    _validate_expert(config, expert, minibatch // (data * fsdp))
    state = fsdp * context * expert  # the state axes (jaxscale.config.layout_rules.STATE_AXES)
    _check(
        m.hidden_size % state == 0,
        "mesh.fsdp",
        f"{fsdp} x mesh.context={context}{f' x mesh.expert={expert}' if expert > 1 else ''} does not divide "
        f"model.hidden_size={m.hidden_size} (the model state is split along its embed axis over "
        f"{'the three' if expert > 1 else 'both'}); fsdp x context{' x expert' if expert > 1 else ''} may be: "
        f"{_divisors(m.hidden_size)}",
    )
    splits = {
        "attention heads (model.hidden_size / model.head_dim)": sizes.num_heads,
        "the MLP width (model.mlp_hidden_size, or model.mlp_expansion x model.hidden_size)": sizes.mlp_width,
        "model.vocab_size": m.vocab_size,
    }
    if sizes.kv_heads != sizes.num_heads:  # grouped-query attention: K/V heads split too
        splits["K/V heads (model.num_kv_heads)"] = sizes.kv_heads
    for what, size in splits.items():
        _check(
            size % tensor == 0,
            "mesh.tensor",
            f"{tensor} does not divide the {size} {what}; tensor may be a common divisor of heads, MLP width "
            f"and vocabulary: {_divisors(math.gcd(*splits.values()))}",
        )


def _validate_expert(config: ml_collections.ConfigDict, expert: int, rows: int) -> None:
    """Expert parallelism (jaxscale.model.moe): mesh.expert splits the routed experts, and the batch with data x
    fsdp, so it divides model.num_experts and the `rows` each data x fsdp group holds of a minibatch."""
    if expert == 1:
        return
    experts = config.model.num_experts
    _check(experts > 0, "mesh.expert", f"{expert} splits a mixture of experts' experts, and model.num_experts=0 "
           "(a dense model); set model.num_experts > 0, or 1")  # fmt: skip
    _check(experts % expert == 0, "mesh.expert", f"{expert} does not divide model.num_experts={experts}; "
           f"allowed: {_divisors(experts)}")  # fmt: skip
    allowed = ", ".join(str(n) for n in range(1, rows + 1) if rows % n == 0 and experts % n == 0)
    _check(rows % expert == 0, "mesh.expert", f"{expert} does not divide the {rows} sequences of a minibatch per "
           "data x fsdp group (data.batch_size / train.num_minibatches / (mesh.data x mesh.fsdp)); allowed: "
           f"{allowed}")  # fmt: skip


def _zero_stage_splits(stage: int, fsdp: int, context: int, expert: int) -> None:
    """ZeRO stages 1 and 2 split the optimizer state (and the gradients) over the state axes fsdp x context x expert,
    keeping the parameters whole (jaxscale.config.layout_rules.rules); with all three 1 nothing is split and the run
    is plain data parallelism."""
    what = "the optimizer state" + (" and the gradients" if stage == 2 else "")
    _check(stage == 3 or fsdp * context * expert > 1, "mesh.zero_stage",
           f"{stage} shards {what} over mesh.fsdp (x mesh.context x mesh.expert), and mesh.fsdp=1 (context 1, "
           "expert 1) splits nothing: it would be plain data parallelism; set mesh.fsdp > 1, or leave "
           "mesh.zero_stage at 3 (the default)")  # fmt: skip


def _validate_context(config: ml_collections.ConfigDict, context: int) -> None:
    """Context parallelism runs attention as a ring of chunked or flash blocks over a load-balanced sequence:
    2 x context chunks, each a whole number of the kernel's blocks (jaxscale.model.ring_attention)."""
    if context == 1:
        return
    m, seq = config.model, config.data.seq_len
    _check(m.attention in ("chunked", "flash"), "model.attention",
           f"mesh.context={context} runs attention as a ring of chunked or flash blocks; set model.attention="
           f"chunked or flash (it is {m.attention!r})")  # fmt: skip
    _check(seq % (2 * context) == 0, "mesh.context",
           f"{context}: data.seq_len={seq} must split into 2 x context chunks (the causal load balance); "
           f"allowed: {', '.join(str(n) for n in range(1, seq // 2 + 1) if seq % (2 * n) == 0)}")  # fmt: skip
    chunk = seq // (2 * context)
    for field in ("attention_block_k", "attention_block_q") if m.attention == "flash" else ("attention_block_k",):
        block = m[field]
        _check(not block or chunk % block == 0, f"model.{field}",
               f"{block} does not divide the ring's chunk of {chunk} positions (data.seq_len / (2 x "
               f"mesh.context)); allowed: 0 (default) or {_divisors(chunk)}")  # fmt: skip


def check_mesh_devices(
    config: ml_collections.ConfigDict, devices: int, where: str = "this process", hint: str = ""
) -> None:
    """Raises ConfigError unless the mesh uses every one of `devices` devices (1x1x1 always runs on one).

    Args:
      config: a validated config.
      devices: the device count the step would run or be planned on.
      where: what has the devices, for the message ("this run (cpu)", "target h100 (--devices)").
      hint: appended to the message (how to get other devices).
    """
    product = mesh_shape(config).devices
    if product == 1 or product == devices:
        return
    fix = f"choose sizes whose product is {devices} (e.g. --config.mesh.data={devices}), or 1x1x1 for one device"
    if devices == 1:
        fix = "use 1x1x1"
    raise ConfigError(
        f"mesh: {mesh_shape(config).axes_text} = {mesh_text(config)} = {product} devices, but {where} has {devices}; "
        f"{fix}{hint}"
    )


def _validate_loss_chunk(chunk_len: object, seq_len: int) -> None:
    """train.loss_chunk_len: 0 (the whole logits at once) or a divisor of the sequence."""
    _non_negative_int(chunk_len, "train.loss_chunk_len")
    _check(
        chunk_len == 0 or seq_len % chunk_len == 0,
        "train.loss_chunk_len",
        f"{chunk_len} does not divide data.seq_len={seq_len}; allowed: 0 (no chunks) or one of {_divisors(seq_len)}",
    )


def _non_negative_int(value: object, field: str) -> None:
    _check(isinstance(value, int) and value >= 0, field, f"must be an integer >= 0, got {value!r}")


def _validate_data_and_eval(d: ml_collections.ConfigDict, t: ml_collections.ConfigDict) -> None:
    """The data source, its pipeline knobs, validation and checkpoint fields (the files are checked later)."""
    _one_of(d.source, DATA_SOURCES, "data.source")
    if d.source == "text":
        _check(bool(d.path), "data.path", "required with data.source=text: a directory written by "
               "python -m jaxscale.data prepare --text FILES --out DIR")  # fmt: skip
    _non_negative_int(d.workers, "data.workers")
    _non_negative_int(d.prefetch, "data.prefetch")
    _check(d.host_delay_s >= 0, "data.host_delay_s", f"must be >= 0 seconds, got {d.host_delay_s}")
    _non_negative_int(t.eval_every, "train.eval_every")
    _check(t.eval_every == 0 or d.source == "text", "train.eval_every",
           f"validation needs a held-out split: set data.source=text (it is {d.source!r}), or 0")  # fmt: skip
    _check(isinstance(t.eval_batches, int) and t.eval_batches > 0, "train.eval_batches",
           f"must be a positive integer, got {t.eval_batches!r}")  # fmt: skip
    _non_negative_int(t.checkpoint_every, "train.checkpoint_every")
    _check(isinstance(t.checkpoint_keep, int) and t.checkpoint_keep > 0, "train.checkpoint_keep",
           f"must be a positive integer, got {t.checkpoint_keep!r}")  # fmt: skip

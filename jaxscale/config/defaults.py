"""The run configuration's fields with their defaults and meaning, the size presets, and config files."""

from __future__ import annotations

import functools
import importlib.util
import io
import os
import pathlib
import re
import tokenize
import types

import jax
import ml_collections

from jaxscale.config import model_presets, remat_policies

# Sizes per preset. Everything not listed here is the same at every scale (see base_config).
PRESETS: dict[str, dict[str, dict[str, object]]] = {
    # The reference experiment (the UvA notebook on one 24 GB A5000): 155,877,376 parameters.
    "seed": {
        "model": dict(num_layers=12, hidden_size=1024, head_dim=128, vocab_size=2048, max_seq_len=512),
        "data": dict(batch_size=64, seq_len=512),
        "train": dict(num_minibatches=4, steps=10, warmup_steps=2),
        "profile": dict(steps=3),
    },
    # About a second per step on 2 CPU cores (bf16, scan, remat MLP+Attn).
    "cpu": {
        "model": dict(num_layers=4, hidden_size=256, head_dim=64, vocab_size=2048, max_seq_len=256),
        "data": dict(batch_size=16, seq_len=256),
        "train": dict(num_minibatches=4, steps=10, warmup_steps=2),
        "profile": dict(steps=2),
    },
    # For tests: compiles in seconds, a step takes milliseconds.
    "tiny": {
        "model": dict(num_layers=2, hidden_size=64, head_dim=16, vocab_size=128, max_seq_len=32),
        "data": dict(batch_size=8, seq_len=32),
        "train": dict(num_minibatches=2, steps=3, warmup_steps=1),
        "profile": dict(steps=1),
    },
}

FAMILIES = ("gpt", "llama")
DTYPES = ("bfloat16", "float32", "float16")
REDUCE_DTYPES = ("float32", "compute")  # model.reduce_dtype
REMAT_TARGETS = ("MLP", "Attn", "Block")
REMAT_POLICIES = tuple(remat_policies.POLICIES)  # what each keeps, with its source: remat_policies.py, docs/fit.md
RESIDUALS = ("closed_form", "autodiff")  # model.residuals: what a sub-block no remat covers keeps (model/stack.py)
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "chunked", "flash")
ACCUMULATE_METHODS = ("scan", "loop")
# train.grad_accumulation: where a minibatch's gradient joins the accumulator (jaxscale.train.backward_accumulation)
GRAD_ACCUMULATIONS = ("auto", "in_backward", "after_backward")
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")
STATE_DTYPES = ("float32", "bfloat16", "int8")  # optimizer.state_dtype (int8: jaxscale/train/quantized_state.py)
FROZEN_DTYPES = ("float32", "bfloat16", "nf4")  # finetune.frozen_dtype (nf4: jaxscale/model/nf4.py, QLoRA)
# optimizer.state_dtype=int8 (adam, adamw): each moment of a tensor of at least INT8_MIN_SIZE elements is stored as
# one uint8 code per element and one float32 absmax per block of INT8_BLOCK_SIZE elements (Dettmers et al. 2022,
# arXiv 2110.02861, section 2.1: blocks of 2048); smaller tensors keep float32 moments (bitsandbytes' min_8bit_size,
# 4096). Read by the optimizer (jaxscale.train.quantized_state) and the analytic memory model.
INT8_BLOCK_SIZE = 2048
INT8_MIN_SIZE = 4096
FP8_MODES = ("none", "dynamic", "delayed")  # model.fp8 (jaxscale.model.fp8)
DATA_SOURCES = ("synthetic", "text")
QK_NORMS = ("none", "head", "full")  # model.qk_norm
MOE_ROUTINGS = ("topk_softmax", "softmax_topk", "softmax_topk_norm")  # model.moe_routing (jaxscale.model.moe)
MOE_DISPATCHES = ("ragged", "capacity", "scatter", "dense")  # model.moe_dispatch (jaxscale.model.moe)
MOE_BALANCE_SCOPES = ("minibatch", "device", "sequence")  # model.moe_balance_scope (jaxscale.model.moe)
PARAM_DTYPES = ("float32", "bfloat16")  # model.param_dtype: the trained weights' storage
BF16_ROUNDINGS = ("nearest", "stochastic", "kahan", "master")  # optimizer.bf16_rounding (jaxscale.train.bf16_weights)


def all_presets() -> dict[str, dict[str, dict[str, object]]]:
    """The size presets above and the named real models of jaxscale.config.model_presets, by name."""
    return {**PRESETS, **model_presets.MODEL_PRESETS}


class ConfigError(ValueError):
    """A config field holds a value the lab cannot run; the message names the field and what is allowed."""


class UsageError(Exception):
    """Bad input from the command line or a file standing for it (a flag, a dotted override); printed as one line,
    exit code 2 (jaxscale.cli, which re-exports it, prints it)."""


def default_preset() -> str:
    """The preset used when none is given: the reference scale on an accelerator, `cpu` otherwise."""
    return "cpu" if jax.default_backend() == "cpu" else "seed"


def base_config(preset: str | None, name: str) -> ml_collections.ConfigDict:
    """The reference configuration (bf16, no scan, no remat) at the size of `preset`.

    Args:
      preset: one of PRESETS, or None to pick by backend (see `default_preset`).
      name: the variant's name; it prefixes run names and traces.

    Returns:
      An unlocked ConfigDict; config files change the fields of their variant and return it.
    """
    preset_source = "given"
    if preset is None or preset == "":
        preset, preset_source = default_preset(), f"auto ({jax.default_backend()} backend)"
    if preset not in all_presets():
        raise ConfigError(f"preset: unknown {preset!r}; allowed: {', '.join(all_presets())}")
    c = ml_collections.ConfigDict()
    c.name = name  # variant name, used in run names and trace directories
    c.preset = preset  # size preset (seed, cpu, tiny) or a named real model (config/model_presets.py)
    c.preset_source = preset_source  # "given" or how the preset was picked automatically

    c.model = ml_collections.ConfigDict()
    c.model.family = "gpt"  # gpt (LayerNorm, GELU MLP, learned positions) or llama (RMSNorm, SwiGLU, RoPE, GQA)
    c.model.vocab_size = 2048  # tokens in the vocabulary (also the number of output classes)
    c.model.hidden_size = 1024  # width of the residual stream
    c.model.head_dim = 128  # width of one attention head; num_heads = hidden_size // head_dim
    c.model.num_layers = 12  # transformer blocks
    c.model.mlp_expansion = 4  # MLP hidden width = mlp_expansion * hidden_size, unless mlp_hidden_size is set
    c.model.mlp_hidden_size = 0  # MLP hidden width in units (llama's intermediate_size); 0: mlp_expansion * hidden
    c.model.num_kv_heads = 0  # key/value heads of grouped-query attention (llama); 0: one per query head (MHA)
    c.model.rope_theta = 10000.0  # base of the rotary position embedding's frequencies (llama)
    c.model.norm_epsilon = 1e-6  # epsilon of LayerNorm (gpt) or RMSNorm (llama)
    c.model.tie_embeddings = False  # output head = token embedding transposed, no bias (GPT-2, Llama 3.2)
    c.model.num_attention_heads = 0  # query heads (llama); 0: hidden_size // head_dim (Qwen3 has more, e.g. 32 x 128)
    c.model.qk_norm = "none"  # llama: RMSNorm of q and k before RoPE: none, head (per head: Qwen3), full (OLMoE)
    # Mixture of experts (llama; jaxscale/model/moe.py, docs/models.md): the SwiGLU MLP replaced by routed experts.
    c.model.num_experts = 0  # routed experts per MoE layer; 0: the dense SwiGLU MLP
    c.model.experts_per_token = 2  # experts each token is routed to (top-k)
    c.model.moe_hidden_size = 0  # each expert's SwiGLU width (moe_intermediate_size); 0: the dense MLP's width
    c.model.num_shared_experts = 0  # experts every token also goes through (one SwiGLU n x moe_hidden_size wide)
    c.model.moe_routing = "topk_softmax"  # topk_softmax (Mixtral), softmax_topk (OLMoE), softmax_topk_norm (Qwen3)
    c.model.moe_dispatch = "scatter"  # scatter (slots by index; fastest fitting plan), capacity, ragged, dense
    c.model.moe_capacity_factor = 1.25  # capacity: slots per expert = ceil(factor x seq_len x k / num_experts)
    c.model.moe_aux_loss_weight = 0.01  # weight of the load-balancing loss num_experts x sum_e f_e x P_e (Switch)
    c.model.moe_balance_scope = "minibatch"  # load balance's f, P over: minibatch (all devices), device, sequence
    c.model.moe_z_loss_weight = 0.0  # weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE)
    c.model.first_dense_layers = 0  # the first N blocks keep the dense MLP (DeepSeek); needs scan_layers=False
    c.model.max_seq_len = 512  # rows of the learned positional embedding
    c.model.dropout_rate = 0.1  # dropout after embeddings, attention output and MLP output
    c.model.dtype = "bfloat16"  # compute dtype of activations and matmuls
    c.model.param_dtype = "float32"  # trained weights stored in: float32, or bfloat16 (the update: bf16_rounding)
    c.model.reduce_dtype = "float32"  # weight gradients summed over a mesh's devices in float32 or the compute dtype
    c.model.fp8 = "none"  # FP8 matmuls (docs/fp8.md): none, dynamic (torchtitan's tensorwise) or delayed (Flax's op)
    c.model.fp8_targets = ("attention", "mlp")  # projections in FP8: attention, mlp, all, head, or names (q, up, ...)
    c.model.fp8_amax_history = 1024  # model.fp8=delayed: steps of amax each tensor's scale is taken from (Flax's, TE's)
    c.model.softmax_dtype = "float32"  # dtype of attention logits and softmax (cast back afterwards)
    c.model.causal = True  # causal attention mask (next-token prediction needs it)
    c.model.remat = ()  # modules wrapped in nn.remat: any subset of ("MLP", "Attn", "Block")
    c.model.remat_policy = "nothing_saveable"  # kept by remat: one of REMAT_POLICIES, or per_activation:name=place,...
    c.model.residuals = "closed_form"  # sub-blocks no remat covers keep: closed_form (what backward reads), autodiff
    c.model.scan_layers = False  # stack the blocks with nn.scan (one compiled body) or unroll them
    c.model.attention = "reference"  # reference (einsum), xla or cudnn (jax.nn), chunked or flash (docs/attention.md)
    c.model.attention_block_q = 0  # flash: queries per block of the forward kernel, a power of two; 0: by head_dim
    c.model.attention_block_k = 0  # flash, chunked: keys per block (flash: a power of two); 0: by head_dim / seq_len
    c.model.lora_rank = 0  # rank of the LoRA adapters on model.lora_targets (0: no adapters; docs/finetune.md)
    c.model.lora_alpha = 16.0  # LoRA's scale: an adapter adds (lora_alpha / lora_rank) * x @ A @ B
    c.model.lora_targets = ("attention",)  # projections with adapters: attention, mlp, all, or names (q, v, up, ...)

    c.data = ml_collections.ConfigDict()
    c.data.batch_size = 64  # sequences per optimizer step (split into train.num_minibatches)
    c.data.seq_len = 512  # tokens per sequence, at most model.max_seq_len
    c.data.seed = 0  # seed of the random-token batch (synthetic) or of the window order (text)
    c.data.source = "synthetic"  # synthetic: one random batch kept on device (the reference); text: token files
    c.data.path = ""  # data.source=text: a directory written by `python -m jaxscale.data prepare` (docs/data.md)
    c.data.workers = 0  # text: grain worker processes preparing batches (0: prepared in this process)
    c.data.prefetch = 2  # text: batches prepared and placed on device ahead of the step (0: when it asks)
    c.data.host_delay_s = 0.0  # text: seconds of sleep per batch on the host, a slow pipeline on purpose

    c.train = ml_collections.ConfigDict()
    c.train.num_minibatches = 4  # gradient accumulation: minibatches per step (1 = none)
    c.train.accumulate = "scan"  # accumulation form: scan (lax.scan) or loop (unrolled Python loop)
    # in_backward: each scanned layer's gradient added into the accumulator inside the backward pass (one gradient
    # held, not two); after_backward: each minibatch's whole gradient, then added
    c.train.grad_accumulation = "auto"  # in_backward (where it applies: docs/measurements.md) or after_backward
    c.train.loss_chunk_len = 0  # positions per chunk of the output head + loss (no [B, T, V] logits); 0: whole
    c.train.steps = 10  # timed steps (median and p90 are taken over these)
    c.train.warmup_steps = 2  # untimed steps run before timing, after the ahead-of-time compile
    c.train.seed = 42  # seed of parameter init and dropout
    c.train.eval_every = 0  # validation loss on the held-out split every N steps and at the end (0: never; text)
    c.train.eval_batches = 4  # batches of data.batch_size sequences per validation (fixed windows)
    c.train.checkpoint_every = 0  # orbax checkpoint every N steps under <run dir>/checkpoints; resumes (0: none)
    c.train.checkpoint_keep = 2  # checkpoints kept on disk (the newest)
    # Host offload (jaxscale/train/offload.py, docs/finetune.md): the trained parameters live in pinned host memory
    c.train.offload_params = False  # trained params on the host between steps, brought whole to the device per step

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adam"  # one of OPTIMIZERS
    c.optimizer.learning_rate = 1e-3  # peak learning rate, reached after warmup_steps
    c.optimizer.warmup_steps = 10  # linear warm-up from 0 to the peak
    c.optimizer.transition_steps = 1  # steps per exponential decay period after warm-up
    c.optimizer.decay_rate = 0.99  # multiplicative decay per period
    c.optimizer.b1 = 0.9  # Adam first-moment decay (momentum for sgd)
    c.optimizer.b2 = 0.999  # Adam second-moment decay
    c.optimizer.weight_decay = 0.0  # decoupled weight decay (adamw only)
    c.optimizer.grad_clip_norm = 0.0  # clip gradients to this global norm; 0 disables clipping
    # int8 (adam/adamw only): both moments block-wise quantized to 8 bits (jaxscale/train/quantized_state.py)
    c.optimizer.state_dtype = "float32"  # dtype the optimizer's moments are stored in: float32, bfloat16 or int8
    c.optimizer.bf16_rounding = "stochastic"  # update to bf16 weights (model.param_dtype): nearest, stochastic, kahan,
    # master (a float32 copy, split like the optimizer state)
    c.optimizer.offload_state = False  # optimizer state in pinned host memory, on the device only for the update
    c.optimizer.in_backward = False  # update each scanned layer as its gradient is made: no whole gradient (fused_step)

    # Fine-tuning (jaxscale.config.finetune, docs/finetune.md): which parameters train; the rest stay frozen.
    c.finetune = ml_collections.ConfigDict()
    # finetune.train: "auto" trains LoRA's adapters alone when model.lora_rank > 0 (the base frozen, as PEFT and
    # torchtune do), else every parameter; "all" trains every parameter, adapters included, whatever the rank.
    c.finetune.train = "auto"  # auto (adapters if model.lora_rank > 0, else all); all; adapters; last_blocks
    c.finetune.last_blocks = 0  # train=last_blocks: the top blocks that train (0 with head: the head alone; unrolled)
    c.finetune.head = False  # train=adapters or last_blocks: the output head and final norm train too
    # nf4 (QLoRA, with trained LoRA adapters): the frozen projection kernels and stacked experts in 4-bit NormalFloat
    # with double-quantized absmax, dequantized to model.dtype at their matmul; the other frozen parameters bfloat16
    c.finetune.frozen_dtype = "bfloat16"  # frozen parameters are stored in this dtype: float32, bfloat16 or nf4
    c.finetune.init_from = ""  # a run directory whose latest checkpoint's parameters start this run ("": random)

    c.profile = ml_collections.ConfigDict()
    c.profile.steps = 3  # steps captured with jax.profiler after the timed ones (0 = no trace)

    # The device mesh (jaxscale.train.sharding, docs/mesh.md): data x fsdp x tensor x context x expert x stage must
    # equal the number of devices (or --devices of a planned target). All 1 is the single-device program, on the first
    # device.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data parallel: the batch split over this axis, parameters replicated
    c.mesh.fsdp = 1  # sharded data parallel (ZeRO, mesh.zero_stage): the batch split, model state sharded
    c.mesh.tensor = 1  # Megatron tensor parallel: attention heads, MLP width and vocabulary split
    c.mesh.context = 1  # context parallel: every activation's sequence split, attention as a ring
    c.mesh.expert = 1  # expert parallel (MoE): routed experts split, tokens by all-to-all, other state sharded (FSDP)
    c.mesh.zero_stage = 3  # what fsdp (x context x expert) shards: 1 optimizer state, 2 and grads, 3 and params (FSDP)
    # With several minibatches, when gradients are summed over the devices that split the batch: "step" accumulates
    # each device's own and reduces once a step (DDP's no_sync, llm.c, Megatron's distributed optimizer; a whole
    # float32 accumulator per device), "minibatch" reduces every minibatch's (DeepSpeed ZeRO-2, FSDP2).
    c.mesh.reduce_gradients = "auto"  # gradients summed once a step or every minibatch; auto: step for DP and ZeRO-1
    c.mesh.sequence_parallel = False  # with mesh.tensor: norms and residuals split along the sequence too
    # Pipeline parallelism (jaxscale.model.pipeline): the scanned layers split into mesh.stage stages, each minibatch
    # streamed through them as pipeline_microbatches microbatches (0: as many as stages); pipeline_repeats 1 is GPipe,
    # v > 1 circular (each stage holds v groups of layers and every microbatch visits it v times: bubble / v)
    c.mesh.stage = 1  # pipeline stages: the layer stack split over this axis, microbatches streamed through it
    c.mesh.pipeline_microbatches = 0  # microbatches in flight per minibatch (0: mesh.stage)
    c.mesh.pipeline_repeats = 1  # 1: GPipe; v > 1: circular (interleaved) with v visits of each stage
    # with FSDP (ZeRO-3) inside a pipeline: gather each stage's weights once a pass over the minibatch, and
    # reduce-scatter their gradients once, instead of in every iteration (MaxText's pipeline_fsdp_ag_once); the
    # stage's weights are then held whole (over fsdp) for the pass
    c.mesh.pipeline_gather_once = False  # FSDP in a pipeline: weights gathered once a pass, not every iteration

    for group, values in all_presets()[preset].items():
        c[group].update(values)
    return c


def import_file(path: str | os.PathLike) -> types.ModuleType:
    """Imports a Python file (a config or sweep file) as a module of its own, not on sys.path."""
    path = pathlib.Path(path)
    spec = importlib.util.spec_from_file_location(f"_jaxscale_file_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config_file(path: str | os.PathLike, preset: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(preset)` of a config file, or `get_config()` (the backend's default preset) for None."""
    module = import_file(path)
    return module.get_config(preset) if preset else module.get_config()


@functools.cache
def field_comments() -> dict[str, str]:
    """'group.field' -> the comment on that field's line in base_config (this file's source), e.g.
    'model.hidden_size' -> 'width of the residual stream'."""
    source = pathlib.Path(__file__).read_text()
    lines = source.splitlines()
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        assigned = re.match(r"\s*c\.([\w.]+)\s*=", lines[token.start[0] - 1])
        if assigned:
            comments[assigned.group(1)] = token.string.lstrip("#").strip()
    return comments


def describe(config: ml_collections.ConfigDict) -> str:
    """Every field of a config as `group.field = value  # what it means`, one per line, in config order.

    A field whose value differs from base_config at the same preset (set by the config file, a sweep
    variant or a --config.* override) ends with `[base: <value>]`.
    """
    comments = field_comments()
    base = flatten(base_config(config.preset, config.name), prefix="")
    rows = []
    for field, value in flatten(config, prefix="").items():
        shown = tuple(value) if isinstance(value, list) else value
        changed = field in base and base[field] != value
        note = f"  [base: {tuple(base[field]) if isinstance(base[field], list) else base[field]!r}]" if changed else ""
        rows.append((f"{field} = {shown!r}", f"# {comments.get(field, '(no description)')}{note}"))
    width = max(len(left) for left, _ in rows)
    return "\n".join(f"{left.ljust(width)}  {right}" for left, right in rows)


def flatten(config: ml_collections.ConfigDict, prefix: str = "config.") -> dict[str, object]:
    """Flat `config.group.field -> value` dict for a result row (tuples become lists in JSON)."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat

"""Shared run configuration: the reference defaults, the size presets and validation of every field."""

from __future__ import annotations

import functools
import importlib.util
import io
import math
import os
import pathlib
import re
import tokenize
import types

import jax
import ml_collections

from jaxscale import model_presets

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
REMAT_TARGETS = ("MLP", "Attn", "Block")
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_qkv_proj")
ATTENTION_IMPLS = ("reference", "xla", "cudnn", "chunked", "flash")
ACCUMULATE_METHODS = ("scan", "loop")
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")
DATA_SOURCES = ("synthetic", "text")


def all_presets() -> dict[str, dict[str, dict[str, object]]]:
    """The size presets above and the named real models of jaxscale.model_presets, by name."""
    return {**PRESETS, **model_presets.MODEL_PRESETS}


class ConfigError(ValueError):
    """A config field holds a value the lab cannot run; the message names the field and what is allowed."""


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
    c.preset = preset  # size preset (seed, cpu, tiny) or a named model (jaxscale.model_presets: gpt2, llama3.1-8b, ...)
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
    c.model.max_seq_len = 512  # rows of the learned positional embedding
    c.model.dropout_rate = 0.1  # dropout after embeddings, attention output and MLP output
    c.model.dtype = "bfloat16"  # compute dtype of activations and matmuls; params are always float32
    c.model.softmax_dtype = "float32"  # dtype of attention logits and softmax (cast back afterwards)
    c.model.causal = True  # causal attention mask (next-token prediction needs it)
    c.model.remat = ()  # modules wrapped in nn.remat: any subset of ("MLP", "Attn", "Block")
    c.model.remat_policy = "nothing_saveable"  # what remat keeps: one of REMAT_POLICIES
    c.model.scan_layers = False  # stack the blocks with nn.scan (one compiled body) or unroll them
    c.model.attention = "reference"  # reference (einsum), xla or cudnn (jax.nn), chunked or flash (docs/attention.md)
    c.model.attention_block_q = 0  # flash: queries per block of the forward kernel, a power of two; 0: by head_dim
    c.model.attention_block_k = 0  # flash, chunked: keys per block (flash: a power of two); 0: by head_dim / seq_len

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
    c.train.steps = 10  # timed steps (median and p90 are taken over these)
    c.train.warmup_steps = 2  # untimed steps run before timing, after the ahead-of-time compile
    c.train.seed = 42  # seed of parameter init and dropout
    c.train.eval_every = 0  # validation loss on the held-out split every N steps and at the end (0: never; text)
    c.train.eval_batches = 4  # batches of data.batch_size sequences per validation (fixed windows)
    c.train.checkpoint_every = 0  # orbax checkpoint every N steps under <run dir>/checkpoints; resumes (0: none)
    c.train.checkpoint_keep = 2  # checkpoints kept on disk (the newest)

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

    c.profile = ml_collections.ConfigDict()
    c.profile.steps = 3  # steps captured with jax.profiler after the timed ones (0 = no trace)

    # The device mesh (jaxscale.train.sharding, docs/mesh.md): data x fsdp x tensor must equal the number of
    # devices (or --devices of a planned target). 1 x 1 x 1 is the single-device program, on the first device.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data parallel: the batch split over this axis, parameters replicated
    c.mesh.fsdp = 1  # FSDP (ZeRO-3): parameters, gradients and optimizer state sharded, the batch split too
    c.mesh.tensor = 1  # Megatron tensor parallel: attention heads, MLP width and vocabulary split

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


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {message}")


def _positive(config: ml_collections.ConfigDict, *fields: str) -> None:
    for field in fields:
        group, key = field.split(".")
        value = config[group][key]
        _check(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}")


def _one_of(value: object, allowed: tuple[str, ...], field: str) -> None:
    _check(value in allowed, field, f"unknown {value!r}; allowed: {', '.join(allowed)}")


def _validate_family(m: ml_collections.ConfigDict) -> None:
    """The fields of the model family: grouped-query heads, MLP width, RoPE and norm settings."""
    _one_of(m.family, FAMILIES, "model.family")
    for field in ("num_kv_heads", "mlp_hidden_size"):
        value = m[field]
        _check(isinstance(value, int) and value >= 0, f"model.{field}", f"must be an integer >= 0, got {value!r}")
    num_heads = m.hidden_size // m.head_dim
    kv_heads = m.num_kv_heads or num_heads
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


# The flash forward kernel's shared memory, (block_q + 4 block_k) x head_dim padded to a power of two x bytes,
# must fit an H100's 232,448 bytes; a block left 0 takes the default. Both rules are those of
# jaxscale.model.flash_attention (forward_shared_memory, default_block; tests/model/test_attention.py keeps
# the two in step).
FLASH_SHARED_MEMORY = 232448


def _flash_blocks(m: ml_collections.ConfigDict, seq_len: int) -> None:
    """model.attention_block_q / _k of flash: powers of two dividing data.seq_len whose tiles fit."""
    head_bytes = (1 << (m.head_dim - 1).bit_length()) * (4 if m.dtype == "float32" else 2)
    powers = [1 << i for i in range(seq_len.bit_length()) if seq_len % (1 << i) == 0]
    default = max(p for p in powers if p <= max(1, min(128, 32768 // head_bytes)))
    for field in ("attention_block_q", "attention_block_k"):
        block = m[field]
        allowed = ", ".join(map(str, powers))
        _check(block == 0 or block in powers, f"model.{field}", f"{block} must be a power of two dividing "
               f"data.seq_len={seq_len} (Triton tiles); allowed: 0 (default) or {allowed}")  # fmt: skip
    block_q, block_k = m.attention_block_q or default, m.attention_block_k or default
    need = (block_q + 4 * block_k) * head_bytes
    _check(need <= FLASH_SHARED_MEMORY, "model.attention_block_q" if m.attention_block_q else "model.attention_block_k",
           f"blocks of {block_q} queries and {block_k} keys at model.head_dim={m.head_dim} ({m.dtype}) need "
           f"{need:,} bytes of shared memory in the flash forward kernel, over an H100's {FLASH_SHARED_MEMORY:,}; "
           f"use smaller blocks, or 0 for the default ({default})")  # fmt: skip


def _validate_attention(m: ml_collections.ConfigDict, seq_len: int) -> None:
    """The kernel and its block sizes: chunked's key block divides data.seq_len; flash's see _flash_blocks."""
    _one_of(m.attention, ATTENTION_IMPLS, "model.attention")
    if m.attention == "cudnn":
        _check(
            jax.default_backend() == "gpu",
            "model.attention",
            f"'cudnn' needs a CUDA GPU backend, this one is {jax.default_backend()}; allowed here: "
            "reference, xla, chunked, flash (interpret mode)",
        )
    for field in ("attention_block_q", "attention_block_k"):
        _non_negative_int(m[field], f"model.{field}")
    if m.attention == "chunked" and m.attention_block_k:
        _check(seq_len % m.attention_block_k == 0, "model.attention_block_k",
               f"{m.attention_block_k} does not divide data.seq_len={seq_len}; allowed: 0 (default) or "
               f"{_divisors(seq_len)}")  # fmt: skip
    if m.attention == "flash":
        _flash_blocks(m, seq_len)


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
    _check(isinstance(m.remat, tuple), "model.remat", f"must be a tuple of names from {REMAT_TARGETS}")
    for target in m.remat:
        _one_of(target, REMAT_TARGETS, "model.remat")
    _one_of(m.remat_policy, REMAT_POLICIES, "model.remat_policy")
    _validate_attention(m, d.seq_len)
    _check(0.0 <= m.dropout_rate < 1.0, "model.dropout_rate", f"must be in [0, 1), got {m.dropout_rate}")
    _one_of(t.accumulate, ACCUMULATE_METHODS, "train.accumulate")
    _validate_data_and_eval(d, t)
    _check(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _check(config.profile.steps >= 0, "profile.steps", f"must be >= 0, got {config.profile.steps}")
    _validate_mesh(config)
    _one_of(o.name, OPTIMIZERS, "optimizer.name")
    _check(o.learning_rate > 0, "optimizer.learning_rate", f"must be > 0, got {o.learning_rate}")
    _check(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(o.transition_steps > 0, "optimizer.transition_steps", f"must be > 0, got {o.transition_steps}")
    _check(o.grad_clip_norm >= 0, "optimizer.grad_clip_norm", f"must be >= 0, got {o.grad_clip_norm}")


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


MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of the config's mesh; (1, 1, 1) for a config from before the mesh group."""
    mesh = config.get("mesh")
    return (1, 1, 1) if mesh is None else tuple(int(mesh[axis]) for axis in MESH_AXES)


def mesh_text(config: ml_collections.ConfigDict) -> str:
    """The mesh as `data x fsdp x tensor`, e.g. "2x2x2"."""
    return "x".join(str(n) for n in mesh_shape(config))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _validate_mesh(config: ml_collections.ConfigDict) -> None:
    """Each mesh axis divides what it splits (JAX shards only evenly): see jaxscale.train.sharding.RULES."""
    _positive(config, "mesh.data", "mesh.fsdp", "mesh.tensor")
    m, (data, fsdp, tensor) = config.model, mesh_shape(config)
    minibatch = config.data.batch_size // config.train.num_minibatches
    _check(
        minibatch % (data * fsdp) == 0,
        "mesh",
        f"data x fsdp = {data}x{fsdp} = {data * fsdp} does not divide the minibatch of {minibatch} sequences "
        f"(data.batch_size / train.num_minibatches); data x fsdp may be: {_divisors(minibatch)}",
    )
    _check(
        m.hidden_size % fsdp == 0,
        "mesh.fsdp",
        f"{fsdp} does not divide model.hidden_size={m.hidden_size} (FSDP splits the embed axis); allowed: "
        f"{_divisors(m.hidden_size)}",
    )
    heads = m.hidden_size // m.head_dim
    splits = {
        "attention heads (model.hidden_size / model.head_dim)": heads,
        "the MLP width (model.mlp_hidden_size, or model.mlp_expansion x model.hidden_size)": (
            m.mlp_hidden_size or m.mlp_expansion * m.hidden_size
        ),
        "model.vocab_size": m.vocab_size,
    }
    if (m.num_kv_heads or heads) != heads:  # grouped-query attention: K/V heads split too
        splits["K/V heads (model.num_kv_heads)"] = m.num_kv_heads
    for what, size in splits.items():
        _check(
            size % tensor == 0,
            "mesh.tensor",
            f"{tensor} does not divide the {size} {what}; tensor may be a common divisor of heads, MLP width "
            f"and vocabulary: {_divisors(math.gcd(*splits.values()))}",
        )


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
    shape = mesh_shape(config)
    product = math.prod(shape)
    if product == 1 or product == devices:
        return
    fix = f"choose sizes whose product is {devices} (e.g. --config.mesh.data={devices}), or 1x1x1 for one device"
    if devices == 1:
        fix = "use 1x1x1"
    raise ConfigError(
        f"mesh: data x fsdp x tensor = {mesh_text(config)} = {product} devices, but {where} has {devices}; {fix}{hint}"
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


def flatten(config: ml_collections.ConfigDict, prefix: str = "config.") -> dict[str, object]:
    """Flat `config.group.field -> value` dict for a result row (tuples become lists in JSON)."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat

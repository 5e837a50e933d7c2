"""Parameters of each model family from the config alone: shapes, exact count, Adafactor's state, shape warnings.

Analytic (no model is built): `param_shapes` mirrors jaxscale.model's parameter tree (names and shapes; the
test suite checks them leaf by leaf against the initialised model), so the FLOP and memory models can count
per matrix. The tables take the model's typed view (jaxscale.config.spec.ModelConfig, a RunSpec's `model`) or a
config's `model` group, read once at the top.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import ml_collections
import numpy as np

from jaxscale.config import finetune, layout_rules
from jaxscale.config.spec import ModelConfig

TILE = 64  # tensor-core friendly multiple for matmul dimensions (bf16 MMA tiles; cuBLAS/Triton pad otherwise)
ADAFACTOR_MIN_DIM_TO_FACTOR = 128  # optax.adafactor's default min_dim_size_to_factor


def _layer_params(model: ModelConfig, moe: bool = True) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """One block's parameters: path -> (shape, logical axis names), as the family's modules create them: a mixture
    of experts' block when model.num_experts > 0 (`moe=False`: its first dense layers' block)."""
    h, hd, f, heads, kv_heads = model.hidden_size, model.head_dim, model.mlp_width, model.num_heads, model.kv_heads
    embed, mlp = ("embed",), ("mlp",)
    if model.family == "gpt":
        return _with_adapters(model, {
            "attn/pre_norm/scale": ((h,), embed), "attn/pre_norm/bias": ((h,), embed),
            "attn/qkv/kernel": ((h, heads, 3 * hd), ("embed", "heads", "qkv")),
            "attn/qkv/bias": ((heads, 3 * hd), ("heads", "qkv")),
            "attn/out/kernel": ((heads, hd, h), ("heads", "head_dim", "embed")), "attn/out/bias": ((h,), embed),
            "mlp/pre_norm/scale": ((h,), embed), "mlp/pre_norm/bias": ((h,), embed),
            "mlp/up/kernel": ((h, f), ("embed", "mlp")), "mlp/up/bias": ((f,), mlp),
            "mlp/down/kernel": ((f, h), ("mlp", "embed")), "mlp/down/bias": ((h,), embed),
        })  # fmt: skip
    return _with_adapters(model, {
        "attn/pre_norm/scale": ((h,), embed),
        "attn/q/kernel": ((h, heads, hd), ("embed", "heads", "head_dim")),
        "attn/k/kernel": ((h, kv_heads, hd), ("embed", "kv_heads", "head_dim")),
        "attn/v/kernel": ((h, kv_heads, hd), ("embed", "kv_heads", "head_dim")),
        **_qk_norms(model.qk_norm, heads, kv_heads, hd),
        "attn/out/kernel": ((heads, hd, h), ("heads", "head_dim", "embed")),
        "mlp/pre_norm/scale": ((h,), embed),
        **(_moe_params(model) if moe and model.num_experts else _swiglu_params("mlp", h, f)),
    })  # fmt: skip


def _swiglu_params(prefix: str, h: int, f: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """A SwiGLU's gate, up [H, F] and down [F, H] kernels under `prefix` (jaxscale.model.llama.swiglu)."""
    return {f"{prefix}/gate/kernel": ((h, f), ("embed", "mlp")), f"{prefix}/up/kernel": ((h, f), ("embed", "mlp")),
            f"{prefix}/down/kernel": ((f, h), ("mlp", "embed"))}  # fmt: skip


def _qk_norms(qk_norm: str, heads: int, kv_heads: int, hd: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """model.qk_norm's scales (jaxscale.model.llama.qk_norm): per head [head_dim], or whole [heads, head_dim]."""
    if qk_norm == "head":
        return {"attn/q_norm/scale": ((hd,), ("head_dim",)), "attn/k_norm/scale": ((hd,), ("head_dim",))}
    if qk_norm == "full":
        return {"attn/q_norm/scale": ((heads, hd), ("heads", "head_dim")),
                "attn/k_norm/scale": ((kv_heads, hd), ("kv_heads", "head_dim"))}  # fmt: skip
    return {}


def _moe_params(sizes: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """A mixture of experts' MLP (jaxscale.model.moe): router [H, E], stacked experts [E, H, F] and [E, F, H], and
    the shared experts' SwiGLU (num_shared_experts x F wide)."""
    h, e, f = sizes.hidden_size, sizes.num_experts, sizes.expert_width
    table = {
        "mlp/router/kernel": ((h, e), ("embed", "expert")),
        "mlp/experts/gate": ((e, h, f), ("expert", "embed", "mlp")),
        "mlp/experts/up": ((e, h, f), ("expert", "embed", "mlp")),
        "mlp/experts/down": ((e, f, h), ("expert", "mlp", "embed")),
    }
    if sizes.num_shared_experts:
        table.update(_swiglu_params("mlp/shared", h, sizes.num_shared_experts * f))
    return table


def _with_adapters(
    model: ModelConfig, layer: dict[str, tuple[tuple[int, ...], tuple]]
) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """One block's parameters with a LoRA adapter beside each targeted kernel (model.lora_rank > 0): `lora_a`
    [in..., r] and `lora_b` [r, out...], named like the kernel's dims, the rank axis unnamed (None). The out
    projection contracts two dims (heads, head_dim), every other kernel one (finetune.input_dims)."""
    if not model.lora_rank:
        return layer
    r, out = model.lora_rank, dict(layer)
    for name in finetune.lora_projections(model.family, tuple(model.lora_targets)):
        key = next(k for k in layer if k.endswith(f"/{name}/kernel"))
        (shape, names), contracted = layer[key], finetune.input_dims(name)
        base = key.rsplit("/", 1)[0]
        out[f"{base}/lora_a"] = ((*shape[:contracted], r), (*names[:contracted], None))
        out[f"{base}/lora_b"] = ((r, *shape[contracted:]), (None, *names[contracted:]))
    return out


def param_table(
    model: ModelConfig | ml_collections.ConfigDict,
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every parameter's path ("transformer/block_0/attn/q/kernel") -> (shape, logical axis names), as the
    model creates it (jaxscale.model's names: vocab, embed, pos, heads, kv_heads, head_dim, qkv, mlp, layers).

    With scan_layers the layer parameters are stacked: "transformer/blocks/..." with a leading num_layers
    axis named "layers".
    """
    model = ModelConfig.of(model)
    h, v = model.hidden_size, model.vocab_size
    table = {"embed/embedding": ((v, h), ("vocab", "embed"))}
    if model.family == "gpt":
        table["pos_emb"] = ((model.max_seq_len, h), ("pos", "embed"))
        table["post_norm/bias"] = ((h,), ("embed",))
    table["post_norm/scale"] = ((h,), ("embed",))
    if not model.tie_embeddings:
        table["output/kernel"] = ((h, v), ("embed", "vocab"))
        if model.family == "gpt":
            table["output/bias"] = ((v,), ("vocab",))
    layer = _layer_params(model)
    if model.scan_layers:
        stacked = {k: ((model.num_layers, *s), ("layers", *n)) for k, (s, n) in layer.items()}
        table.update({f"transformer/blocks/{k}": value for k, value in stacked.items()})
    else:
        dense_layer = _layer_params(model, moe=False)  # model.first_dense_layers (unrolled only)
        for i in range(model.num_layers):
            block = dense_layer if i < model.first_dense_layers else layer
            table.update({f"transformer/block_{i}/{k}": value for k, value in block.items()})
    return table


def param_shapes(model: ModelConfig | ml_collections.ConfigDict) -> dict[str, tuple[int, ...]]:
    """Every parameter's path and shape, as the model creates it (param_table without the names)."""
    return {path: shape for path, (shape, _) in param_table(model).items()}


def layer_param_table(
    model: ModelConfig | ml_collections.ConfigDict,
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """One block's parameters (not stacked): path within the block -> (shape, logical axis names)."""
    return _layer_params(ModelConfig.of(model))


def shard_shape(
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    sizes: Mapping[str, int] | None = None,
    table: tuple = layout_rules.RULES,
) -> tuple[int, ...]:
    """The shape one device holds of a parameter named `names`: each dimension divided by the sizes of the mesh axes
    `table` splits it over (layout_rules.split_axes, the layout's own resolution: under the default table a
    non-expert parameter's embed axis by fsdp x context x expert, a stacked expert weight's by fsdp x context and its
    expert axis by expert, heads, K/V heads, MLP width and vocabulary by tensor).

    Args:
      shape: the parameter's shape.
      names: its logical axis names (None: unnamed).
      sizes: mesh axis name -> its size (jaxscale.config.spec.MeshShape's fields; a missing axis is 1).
      table: the layout's rules table (layout_rules.RULES, or a config's: layout_rules.table).

    Returns:
      The shape of one device's shard.
    """
    sizes = sizes or {}
    axes = layout_rules.split_axes(names, table)
    return tuple(dim // math.prod(sizes.get(axis, 1) for axis in split) for dim, split in zip(shape, axes, strict=True))


def param_count(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """Exact parameter count, from the config alone (H hidden, F MLP width, K = K/V width, V vocab, S positions).

    gpt, per layer: two LayerNorms 2·2H, fused QKV H·3H + 3H, attention output H·H + H, MLP up H·F + F and
    down F·H + H; plus token embedding V·H, positional embedding S·H, final LayerNorm 2H, and, untied, the
    output head H·V + V.
    llama, per layer: two RMSNorm scales 2H, q H·Q, k and v 2·H·K, output Q·H (Q = heads x head_dim, H unless
    model.num_attention_heads), the q and k norms (model.qk_norm: 2·head_dim per head, Q + K whole), gate, up and
    down 3·H·F; plus token embedding V·H, final RMSNorm H and, untied, the output head H·V (no biases anywhere).
    A mixture of experts' layer has, in place of the 3·H·F, a router H·E, E experts 3·H·F_e and the shared
    experts 3·H·(S·F_e) (F_e = model.moe_hidden_size, S = model.num_shared_experts); the first
    model.first_dense_layers keep 3·H·F. With LoRA, each layer adds `adapter_params`.
    """
    model = ModelConfig.of(model)  # read once: adapter_params gets the typed view
    h, f, v, kv, q = model.hidden_size, model.mlp_width, model.vocab_size, model.kv_width, model.q_width
    if model.family == "gpt":
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        top = v * h + model.max_seq_len * h + 2 * h + (0 if model.tie_embeddings else h * v + v)
        return model.num_layers * (per_layer + adapter_params(model)) + top
    qk_norms = {"none": 0, "head": 2 * model.head_dim, "full": q + kv}[model.qk_norm]
    attention = 2 * h + h * q + 2 * h * kv + q * h + qk_norms + adapter_params(model)
    routed = 3 * h * model.expert_width * model.num_experts
    moe = h * model.num_experts + routed + 3 * h * model.num_shared_experts * model.expert_width
    top = v * h + h + (0 if model.tie_embeddings else h * v)
    dense_layers = model.num_layers - model.moe_layers
    return model.num_layers * attention + dense_layers * 3 * h * f + model.moe_layers * moe + top


def inactive_expert_params(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """Parameters of the routed experts a token does not go through: (E - k) experts of 3·H·F_e in each MoE layer
    (0 for a dense model). param_count minus these, minus embedding_only_params, is the active parameter count
    (`active_param_count`)."""
    model = ModelConfig.of(model)
    per_expert = 3 * model.hidden_size * model.expert_width
    return model.moe_layers * (model.num_experts - model.experts_per_token) * per_expert


def active_param_count(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """The parameters one token's forward pass multiplies by (the 6N rule's N): every parameter but the gather-only
    embeddings and the routed experts it is not sent to (k of E per MoE layer; the router, attention, norms, shared
    experts and head all count). A dense model's is its non-embedding count."""
    model = ModelConfig.of(model)
    return param_count(model) - embedding_only_params(model) - inactive_expert_params(model)


def adapter_params(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """LoRA parameters of one block: r · (in + out) per targeted projection of in x out (its A and B)."""
    if not model.lora_rank:
        return 0
    sizes = ModelConfig.of(model).projection_sizes
    chosen = finetune.lora_projections(model.family, tuple(model.lora_targets))
    return sum(model.lora_rank * (sizes[name][0] + sizes[name][1]) for name in chosen)


def embedding_only_params(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """Parameters used only by gathers, not by matmuls: the positional table (gpt) and, untied, the token embedding.

    Tied, the token embedding is also the output head's matrix, so it takes part in a matmul and counts in N.
    """
    positions = model.max_seq_len * model.hidden_size if model.family == "gpt" else 0
    return positions + (0 if model.tie_embeddings else model.vocab_size * model.hidden_size)


def removed_axis(reduced_shape: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """The first axis of `shape` whose removal leaves `reduced_shape` (a factored statistic's axis), or None."""
    for axis in range(len(shape)):
        if tuple(reduced_shape) == tuple(shape[:axis]) + tuple(shape[axis + 1 :]):
            return axis
    return None


def _adafactor_leaves(shape: tuple[int, ...], names: tuple[str, ...]) -> list[tuple[tuple[int, ...], tuple]]:
    """(shape, names) of optax.adafactor's state leaves for one parameter: factored (its two largest dims, by
    optax's own np.argsort, both >= 128) a row and a column statistic, each with one of those axes removed,
    and a 1-element placeholder; otherwise the full second moment and two placeholders (names () replicated)."""
    placeholder = ((1,), ())
    order = np.argsort(shape) if len(shape) >= 2 else None
    if order is None or shape[order[-2]] < ADAFACTOR_MIN_DIM_TO_FACTOR:
        return [(tuple(shape), tuple(names)), placeholder, placeholder]
    leaves = [placeholder]
    for dropped in (int(order[-1]), int(order[-2])):  # v_row drops the largest, v_col the second largest
        reduced = tuple(int(d) for d in np.delete(np.array(shape), dropped))  # Python ints: rows are JSON
        axis = removed_axis(reduced, shape)  # the axis the sharding layout reads it as (the first that fits)
        leaves.append((reduced, tuple(n for i, n in enumerate(names) if i != axis)))
    return leaves


def adafactor_state_elements(
    shapes: dict[str, tuple[int, ...]],
    names: dict[str, tuple[str, ...]] | None = None,
    sizes: Mapping[str, int] | None = None,
    table: tuple = layout_rules.RULES,
) -> int:
    """float32 elements of optax.adafactor's state (defaults: factored, no momentum) that one device holds.

    Per parameter of n elements whose two largest dims d1 >= d2 are both >= 128 (min_dim_size_to_factor):
    a row and a column second-moment vector of n/d1 and n/d2 elements, plus a 1-element placeholder; any other
    parameter (vectors, small matrices): the full second moment, n elements, plus two 1-element placeholders.
    On a mesh (`names` given, `sizes` the mesh's, `table` the optimizer state's rules) each statistic is split like
    the axes of its parameter it keeps (the layout of jaxscale.train.sharding.state_specs, shard_shape) and the
    placeholders are replicated. The step counters are left out
    (a few bytes). Which dims are the largest depends on the layout: a scanned model's [L, H, heads, head_dim]
    kernel is factored over H and whichever of the others is larger.
    """
    names = names or {path: (None,) * len(shape) for path, shape in shapes.items()}
    total = 0
    for path, shape in shapes.items():
        for leaf_shape, leaf_names in _adafactor_leaves(shape, names[path]):
            if leaf_names:
                leaf_shape = shard_shape(leaf_shape, leaf_names, sizes, table)
            total += math.prod(leaf_shape)
    return total


def shape_warnings(model: ml_collections.ConfigDict) -> list[str]:
    """One line per matmul dimension that is not a multiple of TILE (64): hidden size, head_dim, MLP width, vocab.

    Tensor cores multiply tiles; a dimension off the tile is padded inside the kernel or falls back to slower
    paths (Karpathy's GPT-2 vocabulary 50257 -> 50304 is the well-known case).
    """
    dims = {
        "model.hidden_size": model.hidden_size,
        "model.head_dim": model.head_dim,
        "MLP width (model.mlp_hidden_size or mlp_expansion x hidden_size)": ModelConfig.from_config(model).mlp_width,
        **({"model.moe_hidden_size": ModelConfig.from_config(model).expert_width} if model.num_experts else {}),
        "model.vocab_size": model.vocab_size,
    }
    lines = []
    for field, value in dims.items():
        if value % TILE:
            padded = -(-value // TILE) * TILE
            hint = f"; pad it to {padded} (unused token ids cost nothing but memory)" if "vocab" in field else ""
            lines.append(f"{field} = {value} is not a multiple of {TILE} (tensor-core tiles){hint}")
    return lines

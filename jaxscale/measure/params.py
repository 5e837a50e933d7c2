"""Parameters of each model family from the config alone: shapes, exact count, Adafactor's state, shape warnings.

Analytic (no model is built): `param_shapes` mirrors jaxscale.model's parameter tree (names and shapes; the
test suite checks them leaf by leaf against the initialised model), so the FLOP and memory models can count
per matrix.
"""

from __future__ import annotations

import math

import ml_collections

TILE = 64  # tensor-core friendly multiple for matmul dimensions (bf16 MMA tiles; cuBLAS/Triton pad otherwise)
ADAFACTOR_MIN_DIM_TO_FACTOR = 128  # optax.adafactor's default min_dim_size_to_factor


def mlp_width(model: ml_collections.ConfigDict) -> int:
    """The MLP's hidden width: mlp_hidden_size, or mlp_expansion * hidden_size when it is 0."""
    return model.mlp_hidden_size or model.mlp_expansion * model.hidden_size


def kv_width(model: ml_collections.ConfigDict) -> int:
    """Width of the keys (and of the values): K/V heads x head_dim (hidden_size without grouped-query attention)."""
    heads = model.hidden_size // model.head_dim
    return (model.num_kv_heads or heads) * model.head_dim


def _layer_shapes(model: ml_collections.ConfigDict) -> dict[str, tuple[int, ...]]:
    h, hd, f = model.hidden_size, model.head_dim, mlp_width(model)
    heads, kv_heads = h // hd, kv_width(model) // hd
    if model.family == "gpt":
        return {
            "attn/pre_norm/scale": (h,), "attn/pre_norm/bias": (h,),
            "attn/qkv/kernel": (h, heads, 3 * hd), "attn/qkv/bias": (heads, 3 * hd),
            "attn/out/kernel": (heads, hd, h), "attn/out/bias": (h,),
            "mlp/pre_norm/scale": (h,), "mlp/pre_norm/bias": (h,),
            "mlp/up/kernel": (h, f), "mlp/up/bias": (f,), "mlp/down/kernel": (f, h), "mlp/down/bias": (h,),
        }  # fmt: skip
    return {
        "attn/pre_norm/scale": (h,),
        "attn/q/kernel": (h, heads, hd), "attn/k/kernel": (h, kv_heads, hd), "attn/v/kernel": (h, kv_heads, hd),
        "attn/out/kernel": (heads, hd, h),
        "mlp/pre_norm/scale": (h,),
        "mlp/gate/kernel": (h, f), "mlp/up/kernel": (h, f), "mlp/down/kernel": (f, h),
    }  # fmt: skip


def param_shapes(model: ml_collections.ConfigDict) -> dict[str, tuple[int, ...]]:
    """Every parameter's path ("transformer/block_0/attn/q/kernel") and shape, as the model creates it.

    With scan_layers the layer parameters are stacked: "transformer/blocks/..." with a leading num_layers axis.
    """
    h, v = model.hidden_size, model.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed/embedding": (v, h)}
    if model.family == "gpt":
        shapes.update({"pos_emb": (model.max_seq_len, h), "post_norm/scale": (h,), "post_norm/bias": (h,)})
    else:
        shapes["post_norm/scale"] = (h,)
    if not model.tie_embeddings:
        shapes["output/kernel"] = (h, v)
        if model.family == "gpt":
            shapes["output/bias"] = (v,)
    layer = _layer_shapes(model)
    if model.scan_layers:
        shapes.update({f"transformer/blocks/{k}": (model.num_layers, *s) for k, s in layer.items()})
    else:
        for i in range(model.num_layers):
            shapes.update({f"transformer/block_{i}/{k}": s for k, s in layer.items()})
    return shapes


def param_count(model: ml_collections.ConfigDict) -> int:
    """Exact parameter count, from the config alone (H hidden, F MLP width, K = K/V width, V vocab, S positions).

    gpt, per layer: two LayerNorms 2·2H, fused QKV H·3H + 3H, attention output H·H + H, MLP up H·F + F and
    down F·H + H; plus token embedding V·H, positional embedding S·H, final LayerNorm 2H, and, untied, the
    output head H·V + V.
    llama, per layer: two RMSNorm scales 2H, q H·H, k and v 2·H·K, output H·H, gate, up and down 3·H·F; plus
    token embedding V·H, final RMSNorm H and, untied, the output head H·V (no biases anywhere).
    """
    h, f, v, kv = model.hidden_size, mlp_width(model), model.vocab_size, kv_width(model)
    if model.family == "gpt":
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        top = v * h + model.max_seq_len * h + 2 * h + (0 if model.tie_embeddings else h * v + v)
    else:
        per_layer = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * f
        top = v * h + h + (0 if model.tie_embeddings else h * v)
    return model.num_layers * per_layer + top


def embedding_only_params(model: ml_collections.ConfigDict) -> int:
    """Parameters used only by gathers, not by matmuls: the positional table (gpt) and, untied, the token embedding.

    Tied, the token embedding is also the output head's matrix, so it takes part in a matmul and counts in N.
    """
    positions = model.max_seq_len * model.hidden_size if model.family == "gpt" else 0
    return positions + (0 if model.tie_embeddings else model.vocab_size * model.hidden_size)


def adafactor_state_elements(shapes: dict[str, tuple[int, ...]]) -> int:
    """float32 elements of optax.adafactor's state (defaults: factored, no momentum) for these parameter shapes.

    Per parameter of n elements whose two largest dims d1 >= d2 are both >= 128 (min_dim_size_to_factor):
    a row and a column second-moment vector of n/d1 and n/d2 elements, plus a 1-element placeholder; any other
    parameter (vectors, small matrices): the full second moment, n elements, plus two 1-element placeholders.
    The step counters are left out (a few bytes). Which dims are the largest depends on the layout: a scanned
    model's [L, H, heads, head_dim] kernel is factored over H and whichever of the others is larger.
    """
    total = 0
    for shape in shapes.values():
        n = math.prod(shape)
        largest = sorted(shape)[-2:]
        if len(shape) >= 2 and largest[0] >= ADAFACTOR_MIN_DIM_TO_FACTOR:
            total += n // largest[1] + n // largest[0] + 1
        else:
            total += n + 2
    return total


def shape_warnings(model: ml_collections.ConfigDict) -> list[str]:
    """One line per matmul dimension that is not a multiple of TILE (64): hidden size, head_dim, MLP width, vocab.

    Tensor cores multiply tiles; a dimension off the tile is padded inside the kernel or falls back to slower
    paths (Karpathy's GPT-2 vocabulary 50257 -> 50304 is the well-known case).
    """
    dims = {
        "model.hidden_size": model.hidden_size,
        "model.head_dim": model.head_dim,
        "MLP width (model.mlp_hidden_size or mlp_expansion x hidden_size)": mlp_width(model),
        "model.vocab_size": model.vocab_size,
    }
    lines = []
    for field, value in dims.items():
        if value % TILE:
            padded = -(-value // TILE) * TILE
            hint = f"; pad it to {padded} (unused token ids cost nothing but memory)" if "vocab" in field else ""
            lines.append(f"{field} = {value} is not a multiple of {TILE} (tensor-core tiles){hint}")
    return lines

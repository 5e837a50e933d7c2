"""Analytic parameter and FLOP counts of the GPT (formulas stated where they are used)."""

from __future__ import annotations

import ml_collections


def param_count(model: ml_collections.ConfigDict) -> int:
    """Exact parameter count of jaxscale.model.GPT, from the config alone.

    Per layer: two LayerNorms (2·2H), fused QKV (H·3H + 3H), attention output (H·H + H),
    MLP up (H·eH + eH) and down (eH·H + H). Plus token embedding (V·H), positional embedding (S·H),
    final LayerNorm (2H) and output projection (H·V + V).
    """
    h, e, v, s = model.hidden_size, model.mlp_expansion, model.vocab_size, model.max_seq_len
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (e * h * h + e * h) + (e * h * h + h)
    return model.num_layers * per_layer + v * h + s * h + 2 * h + (h * v + v)


def model_flops_per_step(config: ml_collections.ConfigDict, causal: bool = False) -> float:
    """Model FLOPs of one optimizer step (forward + backward), the PaLM / nanoGPT formula.

    flops_per_token = 6·N + 12·L·H·Q·T, where N counts the parameters that take part in matmuls (all but
    the embeddings, which are gathers), L layers, H heads, Q head dim, T sequence length. The attention
    term counts QK^T and AV over the full T×T square; `causal=True` halves it (the useful half).
    """
    m = config.model
    matmul_params = param_count(m) - m.vocab_size * m.hidden_size - m.max_seq_len * m.hidden_size
    attention = 12 * m.num_layers * m.hidden_size * config.data.seq_len  # L·(H·Q)·T per token, ×12
    if causal:
        attention /= 2
    tokens = config.data.batch_size * config.data.seq_len
    return float(tokens * (6 * matmul_params + attention))

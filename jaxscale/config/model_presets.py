"""Named real models at full size (published configs) and small Llama sizes for tests, as config presets.

A preset is the text after the colon of `--config <file>:<preset>`: the config file chooses the technique
(dtype, scan, remat, accumulation), the preset the model and a default batch, and `--config.<group>.<field>`
overrides change anything else, e.g. the sequence and the batch:

    python -m jaxscale.run --config configs/bf16_remat.py:llama3.1-8b --config.data.seq_len=8192 \\
        --config.data.batch_size=2 --config.train.num_minibatches=1 --plan --target h100

Each real model lists its source; `tests/test_model_presets.py` checks every parameter count through
`jax.eval_shape` (nothing allocated). Not modelled: Llama 3.1/3.2's "llama3" RoPE frequency scaling (it
changes the rotation frequencies only, not shapes, memory or FLOPs).
"""

from __future__ import annotations

# Everything a Llama 3 model shares: RMSNorm eps 1e-5, RoPE base 500000, 128256-token vocabulary, no dropout,
# 131072 positions (RoPE has no position table, so this only bounds data.seq_len).
_LLAMA3 = dict(
    family="llama", vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, norm_epsilon=1e-5, dropout_rate=0.0
)
# Everything Llama 2 and TinyLlama share: RMSNorm eps 1e-5, RoPE base 10000, a 32000-token vocabulary, no dropout,
# untied output head.
_LLAMA2 = dict(
    family="llama", vocab_size=32000, rope_theta=10000.0, norm_epsilon=1e-5, dropout_rate=0.0, tie_embeddings=False
)
# GPT-2: learned positions for 1024 tokens, LayerNorm eps 1e-5, dropout 0.1, output tied to the token embedding.
_GPT2 = dict(family="gpt", vocab_size=50257, max_seq_len=1024, norm_epsilon=1e-5, dropout_rate=0.1, tie_embeddings=True)

# Default batch of a real-model preset: a handful of sequences at a common training length, no accumulation;
# meant to be overridden (data.seq_len, data.batch_size, train.num_minibatches) or searched (jaxscale.fit).
_TRAIN = {"train": dict(num_minibatches=1, steps=5, warmup_steps=1), "profile": dict(steps=1)}

MODEL_PRESETS: dict[str, dict[str, dict[str, object]]] = {
    # 124,439,808 parameters. Source: the Hugging Face config.json of openai-community/gpt2
    # (n_embd 768, n_layer 12, n_head 12).
    "gpt2": {
        "model": dict(_GPT2, hidden_size=768, head_dim=64, num_layers=12, mlp_expansion=4),
        "data": dict(batch_size=8, seq_len=1024),
        **_TRAIN,
    },
    # 354,823,168 parameters. Source: the Hugging Face config.json of openai-community/gpt2-medium
    # (n_embd 1024, n_layer 24, n_head 16).
    "gpt2-medium": {
        "model": dict(_GPT2, hidden_size=1024, head_dim=64, num_layers=24, mlp_expansion=4),
        "data": dict(batch_size=8, seq_len=1024),
        **_TRAIN,
    },
    # 774,030,080 parameters. Source: the Hugging Face config.json of openai-community/gpt2-large
    # (n_embd 1280, n_layer 36, n_head 20).
    "gpt2-large": {
        "model": dict(_GPT2, hidden_size=1280, head_dim=64, num_layers=36, mlp_expansion=4),
        "data": dict(batch_size=8, seq_len=1024),
        **_TRAIN,
    },
    # 1,557,611,200 parameters. Source: the Hugging Face config.json of openai-community/gpt2-xl
    # (n_embd 1600, n_layer 48, n_head 25).
    "gpt2-xl": {
        "model": dict(_GPT2, hidden_size=1600, head_dim=64, num_layers=48, mlp_expansion=4),
        "data": dict(batch_size=8, seq_len=1024),
        **_TRAIN,
    },
    # 1,100,048,384 parameters. Source: the Hugging Face config.json of TinyLlama/TinyLlama-1.1B-intermediate-
    # step-1431k-3T: hidden 2048, 22 layers, 32 heads of 64, 4 KV heads, intermediate 5632, vocabulary 32000,
    # RoPE base 10000, 2048 positions, untied.
    "tinyllama-1.1b": {
        "model": dict(
            _LLAMA2, hidden_size=2048, head_dim=64, num_layers=22, num_kv_heads=4, mlp_hidden_size=5632,
            max_seq_len=2048,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # 6,738,415,616 parameters. Source: the Hugging Face config.json of meta-llama/Llama-2-7b-hf: hidden 4096,
    # 32 layers, 32 heads of 128, 32 KV heads (no grouping), intermediate 11008, vocabulary 32000, RoPE base
    # 10000, 4096 positions, untied.
    "llama2-7b": {
        "model": dict(
            _LLAMA2, hidden_size=4096, head_dim=128, num_layers=32, num_kv_heads=32, mlp_hidden_size=11008,
            max_seq_len=4096,
        ),
        "data": dict(batch_size=8, seq_len=4096),
        **_TRAIN,
    },
    # 1,235,814,400 parameters. Source: the Hugging Face config.json of meta-llama/Llama-3.2-1B:
    # hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, intermediate 8192, tie_word_embeddings true.
    "llama3.2-1b": {
        "model": dict(
            _LLAMA3, hidden_size=2048, head_dim=64, num_layers=16, num_kv_heads=8, mlp_hidden_size=8192,
            tie_embeddings=True,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # 3,212,749,824 parameters. Source: the Hugging Face config.json of meta-llama/Llama-3.2-3B:
    # hidden 3072, 28 layers, 24 heads of 128, 8 KV heads, intermediate 8192, tie_word_embeddings true.
    "llama3.2-3b": {
        "model": dict(
            _LLAMA3, hidden_size=3072, head_dim=128, num_layers=28, num_kv_heads=8, mlp_hidden_size=8192,
            tie_embeddings=True,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # 8,030,261,248 parameters. Source: the Hugging Face config.json of meta-llama/Llama-3.1-8B:
    # hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, intermediate 14336, tie_word_embeddings false.
    "llama3.1-8b": {
        "model": dict(
            _LLAMA3, hidden_size=4096, head_dim=128, num_layers=32, num_kv_heads=8, mlp_hidden_size=14336,
            tie_embeddings=False,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # 70,553,706,496 parameters. Source: the Hugging Face config.json of meta-llama/Llama-3.1-70B:
    # hidden 8192, 80 layers, 64 heads of 128, 8 KV heads, intermediate 28672, tie_word_embeddings false.
    "llama3.1-70b": {
        "model": dict(
            _LLAMA3, hidden_size=8192, head_dim=128, num_layers=80, num_kv_heads=8, mlp_hidden_size=28672,
            tie_embeddings=False,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # Source: the Hugging Face config.json of meta-llama/Llama-3.1-405B: hidden 16384, 126 layers, 128 heads of 128,
    # 8 KV heads, intermediate 53248, tie_word_embeddings false (the "llama3" RoPE scaling not modelled, as above).
    "llama3.1-405b": {
        "model": dict(
            _LLAMA3, hidden_size=16384, head_dim=128, num_layers=126, num_kv_heads=8, mlp_hidden_size=53248,
            tie_embeddings=False,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # Llama at the sizes of `tiny` and `cpu` (tests; about a second a step on 2 CPU cores): 2 KV heads shared by
    # 4 query heads, SwiGLU width 3x hidden, tied embeddings at tiny (as the 1B/3B models) and untied at cpu.
    "tiny-llama": {
        "model": dict(
            family="llama", num_layers=2, hidden_size=64, head_dim=16, num_kv_heads=2, mlp_hidden_size=192,
            vocab_size=128, max_seq_len=32, norm_epsilon=1e-5, dropout_rate=0.0, tie_embeddings=True,
        ),
        "data": dict(batch_size=8, seq_len=32),
        "train": dict(num_minibatches=2, steps=3, warmup_steps=1),
        "profile": dict(steps=1),
    },
    "cpu-llama": {
        "model": dict(
            family="llama", num_layers=4, hidden_size=256, head_dim=64, num_kv_heads=2, mlp_hidden_size=768,
            vocab_size=2048, max_seq_len=256, norm_epsilon=1e-5, dropout_rate=0.0,
        ),
        "data": dict(batch_size=16, seq_len=256),
        "train": dict(num_minibatches=4, steps=10, warmup_steps=2),
        "profile": dict(steps=2),
    },
    # Mixtures of experts (jaxscale.model.moe): Llama blocks whose SwiGLU MLP is routed experts. Counts are exact
    # (tests/model/test_moe.py writes each out by hand); "active" is the parameters one token multiplies by (the 6N
    # rule's N: k of the E experts, the router, attention, norms and the output head; not the embedding lookup).
    # 46,702,792,704 parameters, 12,748,853,248 active. Source: the Hugging Face config.json of
    # mistralai/Mixtral-8x7B-v0.1: hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, intermediate 14336, 8 local
    # experts, 2 per token, vocabulary 32000, rope_theta 1e6, rms_norm_eps 1e-5, 32768 positions, untied,
    # router_aux_loss_coef 0.02; the router's softmax over all experts renormalised over the top 2 is the softmax of
    # the top-2 logits (HF MixtralSparseMoeBlock).
    "mixtral-8x7b": {
        "model": dict(
            family="llama", vocab_size=32000, hidden_size=4096, head_dim=128, num_layers=32, num_kv_heads=8,
            mlp_hidden_size=14336, rope_theta=1e6, norm_epsilon=1e-5, max_seq_len=32768, dropout_rate=0.0,
            tie_embeddings=False, num_experts=8, experts_per_token=2, moe_routing="topk_softmax",
            moe_aux_loss_weight=0.02,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # 6,919,161,856 parameters, 1,178,994,688 active. Source: the config.json of allenai/OLMoE-1B-7B-0924 (as
    # its fine-tunes copy it, e.g. huggingface.co/interview-eval/olmoe-math-train-gsm8k-2, and as transformers'
    # OlmoeConfig defaults restate it): hidden 2048, 16 layers, 16 heads of 128 (16 KV heads), intermediate 1024 per
    # expert, 64 experts, 8 per token, norm_topk_prob false, vocabulary 50304, rope_theta 10000, rms_norm_eps 1e-5,
    # 4096 positions, untied, router_aux_loss_coef 0.01; q and k RMSNorm over their whole width (transformers'
    # OlmoeAttention: q_norm of hidden_size, k_norm of the K/V width).
    "olmoe-1b-7b": {
        "model": dict(
            family="llama", vocab_size=50304, hidden_size=2048, head_dim=128, num_layers=16, num_kv_heads=16,
            mlp_hidden_size=1024, rope_theta=10000.0, norm_epsilon=1e-5, max_seq_len=4096, dropout_rate=0.0,
            tie_embeddings=False, qk_norm="full", num_experts=64, experts_per_token=8, moe_routing="softmax_topk",
            moe_aux_loss_weight=0.01,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # 30,532,122,624 parameters, 3,041,867,776 active. Source: the Hugging Face config.json of Qwen/Qwen3-30B-A3B,
    # as Megatron scripts restate it (slime's scripts/models/qwen3-30B-A3B.sh, github.com/zyzshishui/slime) and
    # transformers' Qwen3MoeConfig documents it: hidden 2048, 48 layers, 32 heads of 128 (more than hidden /
    # head_dim), 4 KV heads, intermediate 6144 (unused: every layer is MoE), moe_intermediate_size 768, 128 experts,
    # 8 per token, norm_topk_prob true, vocabulary 151936, rope_theta 1e6, rms_norm_eps 1e-6, 40960 positions,
    # untied, router_aux_loss_coef 0.001; q and k RMSNorm per head (Qwen3MoeAttention's q_norm, k_norm of head_dim).
    "qwen3-30b-a3b": {
        "model": dict(
            family="llama", vocab_size=151936, hidden_size=2048, head_dim=128, num_attention_heads=32,
            num_layers=48, num_kv_heads=4, mlp_hidden_size=6144, moe_hidden_size=768, rope_theta=1e6,
            norm_epsilon=1e-6, max_seq_len=40960, dropout_rate=0.0, tie_embeddings=False, qk_norm="head",
            num_experts=128, experts_per_token=8, moe_routing="softmax_topk_norm", moe_aux_loss_weight=0.001,
        ),
        "data": dict(batch_size=8, seq_len=2048),
        **_TRAIN,
    },
    # tiny-llama's blocks with 4 experts of width 32, 2 per token (tests; a CPU step in milliseconds).
    "tiny-moe": {
        "model": dict(
            family="llama", num_layers=2, hidden_size=64, head_dim=16, num_kv_heads=2, mlp_hidden_size=192,
            vocab_size=128, max_seq_len=32, norm_epsilon=1e-5, dropout_rate=0.0, tie_embeddings=True,
            num_experts=4, experts_per_token=2, moe_hidden_size=32,
        ),
        "data": dict(batch_size=8, seq_len=32),
        "train": dict(num_minibatches=2, steps=3, warmup_steps=1),
        "profile": dict(steps=1),
    },
}  # fmt: skip

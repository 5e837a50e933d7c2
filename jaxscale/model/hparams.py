"""ModelConfig: the hashable hyper-parameters of every model family (Flax module attributes must be hashable)."""

from __future__ import annotations

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The `model` group of the run config as a frozen dataclass; see jaxscale.config.base_config."""

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
    softmax_dtype: str = "float32"
    causal: bool = True
    remat: tuple[str, ...] = ()
    remat_policy: str = "nothing_saveable"
    scan_layers: bool = False
    attention: str = "reference"
    attention_block_q: int = 0
    attention_block_k: int = 0
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6
    tie_embeddings: bool = False

    @property
    def num_heads(self) -> int:
        """Query heads: hidden_size // head_dim."""
        return self.hidden_size // self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or one per query head when it is 0 (multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: mlp_hidden_size, or mlp_expansion * hidden_size when it is 0."""
        return self.mlp_hidden_size or self.mlp_expansion * self.hidden_size

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelConfig:
        """Reads every field from a config's `model` group (a missing field is a KeyError)."""
        return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls)})

"""Which parameters a run trains: LoRA's projections per family, and the trainable / frozen split of the tree.

One predicate, `trainable(path, config)`, decides for every parameter path of the model ("transformer/block_3/
attn/q/lora_a", the '/'-joined keys of Flax's params tree and of jaxscale.measure.params.param_table): the
train step differentiates and updates those and keeps the rest frozen in `finetune.frozen_dtype`, and the
analytic memory model counts the two sides with the same predicate.

- `finetune.train = "all"`: every parameter (pre-training, full fine-tuning).
- `"adapters"`: the LoRA adapters only (`lora_a`, `lora_b` of the projections in `model.lora_targets`,
  Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685).
- `"last_blocks"`: the top `finetune.last_blocks` transformer blocks (with unrolled blocks only: scanned
  blocks are one stacked array per parameter).
- `finetune.head`: with either of the last two, the output head and the final norm train too (tied
  embeddings: the token embedding, which is the head's matrix).
"""

from __future__ import annotations

import re

import ml_collections

from jaxscale.config.spec import ModelConfig

# The projections of each family, as its modules name them (jaxscale.model.gpt and .llama), and the groups.
PROJECTIONS = {
    "gpt": {"attention": ("qkv", "out"), "mlp": ("up", "down")},
    "llama": {"attention": ("q", "k", "v", "out"), "mlp": ("gate", "up", "down")},
}
TARGET_GROUPS = ("attention", "mlp", "all")
TRAIN_CHOICES = ("all", "adapters", "last_blocks")
LORA_PARAMS = ("lora_a", "lora_b")
_BLOCK = re.compile(r"^transformer/block_(\d+)/")
_HEAD = ("output/", "post_norm/")


def family_projections(family: str) -> tuple[str, ...]:
    """Every projection of a family that can carry an adapter, in block order."""
    groups = PROJECTIONS[family]
    return (*groups["attention"], *groups["mlp"])


def lora_projections(family: str, targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The projection names `targets` (names or the groups attention, mlp, all) select, in block order.

    Raises:
      KeyError: a target is neither a projection of the family nor a group (validation names it).
    """
    chosen: set[str] = set()
    for target in targets:
        if target == "all":
            chosen.update(family_projections(family))
        elif target in PROJECTIONS[family]:
            chosen.update(PROJECTIONS[family][target])
        elif target in family_projections(family):
            chosen.add(target)
        else:
            raise KeyError(target)
    return tuple(name for name in family_projections(family) if name in chosen)


def projection_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection of the family: (input width, output width) of its matmul (a kernel [in..., out...])."""
    h, f, heads = cfg.hidden_size, cfg.mlp_width, cfg.num_heads * cfg.head_dim
    if cfg.family == "gpt":
        return {"qkv": (h, 3 * heads), "out": (heads, h), "up": (h, f), "down": (f, h)}
    return {"q": (h, heads), "k": (h, cfg.kv_width), "v": (h, cfg.kv_width), "out": (heads, h), "gate": (h, f),
            "up": (h, f), "down": (f, h)}  # fmt: skip


def is_lora_param(path: str) -> bool:
    """A LoRA adapter matrix (`.../<projection>/lora_a` or `lora_b`)."""
    return path.rsplit("/", 1)[-1] in LORA_PARAMS


def _is_head(path: str, tied: bool) -> bool:
    return path.startswith(_HEAD) or (tied and path == "embed/embedding")


def trainable(path: str, config: ml_collections.ConfigDict) -> bool:
    """Whether the parameter at `path` ('/'-joined keys of the params tree) trains under `config.finetune`."""
    f = config.finetune
    if f.train == "all":
        return True
    if f.head and _is_head(path, config.model.tie_embeddings):
        return True
    if f.train == "adapters":
        return is_lora_param(path)
    block = _BLOCK.match(path)  # last_blocks: unrolled blocks only (validation refuses scan_layers)
    return block is not None and int(block.group(1)) >= config.model.num_layers - f.last_blocks


def backward_blocks(config: ml_collections.ConfigDict) -> int:
    """Transformer blocks the backward pass goes through: all, unless only the top finetune.last_blocks train
    and nothing below them does (a trained token embedding, as a tied head is, needs the gradient at the bottom)."""
    f, m = config.finetune, config.model
    if f.train != "last_blocks" or (f.head and m.tie_embeddings):
        return m.num_layers
    return f.last_blocks


def in_backward(path: str, config: ml_collections.ConfigDict) -> bool:
    """Whether the backward pass goes through the parameter at `path`: every one outside the blocks, and those of
    the top `backward_blocks` blocks."""
    block = _BLOCK.match(path)
    return block is None or int(block.group(1)) >= config.model.num_layers - backward_blocks(config)


def trains_everything(config: ml_collections.ConfigDict) -> bool:
    """Every parameter trains (the step keeps no frozen tree)."""
    return config.finetune.train == "all"

"""Which parameters a run trains: LoRA's projections per family, and the trainable / frozen split of the tree.

One predicate, `FinetuneSpec.trainable(path)`, decides for every parameter path of the model ("transformer/block_3/
attn/q/lora_a", the '/'-joined keys of Flax's params tree and of jaxscale.measure.params.param_table): the
train step differentiates and updates those and keeps the rest frozen in `finetune.frozen_dtype`, and the
analytic memory model counts the two sides with the same predicate. `FinetuneSpec` is the `finetune` group read
once, with "auto" resolved and the model facts the rules need; the functions that take a config build one and ask
it, and the analytic models ask the one their jaxscale.config.spec.RunSpec holds.

- `finetune.train = "auto"` (the default): `"adapters"` when the model has LoRA adapters (`model.lora_rank > 0`),
  the base frozen as in PEFT and torchtune, else `"all"`; `train_mode` resolves it, and every reader goes through it.
- `"all"`: every parameter (pre-training, full fine-tuning; with adapters, the base and the adapters).
- `"adapters"`: the LoRA adapters only (`lora_a`, `lora_b` of the projections in `model.lora_targets`,
  Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685).
- `"last_blocks"`: the top `finetune.last_blocks` transformer blocks (with unrolled blocks only: scanned
  blocks are one stacked array per parameter).
- `finetune.head`: with either of the last two, the output head and the final norm train too (tied
  embeddings: the token embedding, which is the head's matrix).
"""

from __future__ import annotations

import dataclasses
import re

import ml_collections

# The projections of each family, as its modules name them (jaxscale.model.gpt and .llama), and the groups.
PROJECTIONS = {
    "gpt": {"attention": ("qkv", "out"), "mlp": ("up", "down")},
    "llama": {"attention": ("q", "k", "v", "out"), "mlp": ("gate", "up", "down")},
}
TARGET_GROUPS = ("attention", "mlp", "all")
HEAD, HEAD_MODULE = "head", "output"  # model.fp8_targets' name for the untied output head, and its module's
MULTI_INPUT = {"out": 2}  # projections whose kernel contracts more than one input dim: out's (heads, head_dim)
TRAIN_CHOICES = ("auto", "all", "adapters", "last_blocks")
LORA_PARAMS = ("lora_a", "lora_b")
NF4 = "nf4"  # finetune.frozen_dtype of the 4-bit frozen base (QLoRA): nf4_kernel, jaxscale.model.nf4
EXPERTS, EXPERT_WEIGHTS = "experts", ("gate", "up", "down")  # jaxscale.model.moe.Experts' stacked [E, ...] weights
_BLOCK = re.compile(r"^transformer/block_(\d+)/")
_HEAD = ("output/", "post_norm/")


def family_projections(family: str) -> tuple[str, ...]:
    """Every projection of a family that can carry an adapter, in block order."""
    groups = PROJECTIONS[family]
    return (*groups["attention"], *groups["mlp"])


def group_projections(group: str) -> tuple[str, ...]:
    """The projections of a group ("attention" or "mlp") in any family, in block order (gpt's first).

    Args:
      group: a key of PROJECTIONS[family].

    Returns:
      The names, each once.
    """
    return tuple(dict.fromkeys(name for groups in PROJECTIONS.values() for name in groups[group]))


def input_dims(name: str) -> int:
    """How many input dims a projection's kernel contracts: 2 for MULTI_INPUT's, else 1."""
    return MULTI_INPUT.get(name, 1)


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


def fp8_projections(family: str, targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The module names `model.fp8_targets` selects (jaxscale.model.fp8): projections as lora_projections reads
    them, and the untied output head (module "output") when HEAD is among them.

    Raises:
      KeyError: a target is neither a projection of the family, a group, nor HEAD (validation names it).
    """
    rest = [target for target in targets if target != HEAD]
    return (*lora_projections(family, rest), *((HEAD_MODULE,) if HEAD in targets else ()))


@dataclasses.dataclass(frozen=True)
class FinetuneSpec:
    """What a run trains and how it stores the rest: the `finetune` group with finetune.train resolved
    (`resolve_train`), and the `model` facts the rules read. The rules on a run's parameters (trainable, nf4_kernel,
    nf4_stacked, in_backward, backward_blocks, stored_dtype) are its methods; the functions of the same names below
    take a config, build one (`from_config`) and ask it, so the train step and the analytic models share each."""

    mode: str  # all | adapters | last_blocks: finetune.train with "auto" resolved
    last_blocks: int  # finetune.last_blocks
    head: bool  # finetune.head
    frozen_dtype: str  # finetune.frozen_dtype: float32 | bfloat16 | nf4
    family: str  # model.family
    num_layers: int  # model.num_layers
    tie_embeddings: bool  # model.tie_embeddings
    scan_layers: bool  # model.scan_layers

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> FinetuneSpec:
        """Reads the `finetune` group and the model facts of `config` (a missing field is an AttributeError).

        Args:
          config: the run config.

        Returns:
          The config's fine-tuning view.
        """
        f, m = config.finetune, config.model
        return cls(
            mode=resolve_train(f.train, m.lora_rank),
            last_blocks=f.last_blocks,
            head=f.head,
            frozen_dtype=f.frozen_dtype,
            family=m.family,
            num_layers=m.num_layers,
            tie_embeddings=m.tie_embeddings,
            scan_layers=m.scan_layers,
        )

    def trainable(self, path: str) -> bool:
        """Whether the parameter at `path` ('/'-joined keys of the params tree) trains."""
        if self.mode == "all":
            return True
        if self.head and _is_head(path, self.tie_embeddings):
            return True
        if self.mode == "adapters":
            return is_lora_param(path)
        block = _BLOCK.match(path)  # last_blocks: unrolled blocks only (validation refuses scan_layers)
        return block is not None and int(block.group(1)) >= self.num_layers - self.last_blocks

    def nf4_kernel(self, path: str) -> bool:
        """Whether a frozen parameter at `path` is stored in NF4 (QLoRA, jaxscale.model.nf4): frozen_dtype=nf4 and
        either a projection's kernel in the blocks (`transformer/.../<projection>/kernel`, the family's PROJECTIONS; a
        mixture of experts' shared experts are such projections) or a mixture of experts' stacked expert weights
        (`transformer/.../experts/gate`, `up` [E, H, F], `down` [E, F, H]: every expert's linear layers, as
        bitsandbytes quantizes each expert's nn.Linear of Mixtral and OLMoE; frozen whenever there are adapters,
        which the experts never carry). The embeddings, norms, biases, the output head and the router are kept in
        `stored_dtype`, as QLoRA keeps everything but the linear layers' weights in 16 bits. The one rule: the state
        (train.step.frozen_leaf, and through it checkpoint's init_from) and the analytic memory model
        (measure.memory.frozen_bytes) ask it."""
        parts = path.split("/")
        if self.frozen_dtype != NF4 or parts[0] != "transformer" or len(parts) < 2:
            return False
        projection = parts[-1] == "kernel" and parts[-2] in family_projections(self.family)
        return projection or (parts[-2] == EXPERTS and parts[-1] in EXPERT_WEIGHTS)

    def nf4_stacked(self, path: str) -> int:
        """The leading dims of the NF4 parameter at `path` quantized apart (jaxscale.model.nf4.quantize's
        `stacked`): nn.scan's layers (model.scan_layers) and a stacked expert weight's experts, so each expert is its
        own [H, F] (or [F, H]) kernel, its blocks never straddling two experts."""
        return len(self.nf4_stacked_names(path))

    def nf4_stacked_names(self, path: str) -> tuple[str, ...]:
        """The logical names of nf4_stacked's leading dims, which the layout splits the NF4 arrays by as it splits
        the parameter's own (jaxscale.config.layout_rules): "layers" (nn.scan's, never split), then "expert" for a
        stacked expert weight (split over mesh.expert: each device holds its own experts' codes)."""
        return ("layers",) * int(self.scan_layers) + ("expert",) * int(path.split("/")[-2] == EXPERTS)

    @property
    def stored_dtype(self) -> str:
        """The dtype the frozen parameters other than NF4 kernels are stored in: frozen_dtype, bfloat16 under nf4."""
        return "bfloat16" if self.frozen_dtype == NF4 else self.frozen_dtype

    @property
    def backward_blocks(self) -> int:
        """Transformer blocks the backward pass goes through: all, unless only the top last_blocks train and
        nothing below them does (a trained token embedding, as a tied head is, needs the gradient at the bottom)."""
        if self.mode != "last_blocks" or (self.head and self.tie_embeddings):
            return self.num_layers
        return self.last_blocks

    def in_backward(self, path: str) -> bool:
        """Whether the backward pass goes through the parameter at `path`: every one outside the blocks, and those
        of the top `backward_blocks` blocks."""
        block = _BLOCK.match(path)
        return block is None or int(block.group(1)) >= self.num_layers - self.backward_blocks


def nf4_kernel(path: str, config: ml_collections.ConfigDict) -> bool:
    """Whether a frozen parameter at `path` is stored in NF4 under `config` (FinetuneSpec.nf4_kernel)."""
    return FinetuneSpec.from_config(config).nf4_kernel(path)


def nf4_stacked(path: str, config: ml_collections.ConfigDict) -> int:
    """The leading dims of the NF4 parameter at `path` quantized apart under `config` (FinetuneSpec.nf4_stacked)."""
    return FinetuneSpec.from_config(config).nf4_stacked(path)


def nf4_stacked_names(path: str, config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The logical names of nf4_stacked's leading dims under `config` (FinetuneSpec.nf4_stacked_names)."""
    return FinetuneSpec.from_config(config).nf4_stacked_names(path)


def stored_dtype(config: ml_collections.ConfigDict) -> str:
    """The dtype the frozen parameters other than NF4 kernels are stored in (FinetuneSpec.stored_dtype)."""
    return FinetuneSpec.from_config(config).stored_dtype


def is_lora_param(path: str) -> bool:
    """A LoRA adapter matrix (`.../<projection>/lora_a` or `lora_b`)."""
    return path.rsplit("/", 1)[-1] in LORA_PARAMS


def _is_head(path: str, tied: bool) -> bool:
    return path.startswith(_HEAD) or (tied and path == "embed/embedding")


def resolve_train(train: str, lora_rank: int) -> str:
    """finetune.train with "auto" resolved: "adapters" when there are adapters (lora_rank > 0), else "all".

    Args:
      train: the finetune.train field (one of TRAIN_CHOICES).
      lora_rank: model.lora_rank.

    Returns:
      "all", "adapters" or "last_blocks".
    """
    if train != "auto":
        return train
    return "adapters" if lora_rank > 0 else "all"


def train_mode(config: ml_collections.ConfigDict) -> str:
    """What `config` trains: finetune.train with "auto" resolved (resolve_train)."""
    return resolve_train(config.finetune.train, config.model.lora_rank)


def trainable(path: str, config: ml_collections.ConfigDict) -> bool:
    """Whether the parameter at `path` ('/'-joined keys of the params tree) trains under `config.finetune`
    (FinetuneSpec.trainable)."""
    return FinetuneSpec.from_config(config).trainable(path)


def backward_blocks(config: ml_collections.ConfigDict) -> int:
    """Transformer blocks the backward pass goes through under `config` (FinetuneSpec.backward_blocks)."""
    return FinetuneSpec.from_config(config).backward_blocks


def in_backward(path: str, config: ml_collections.ConfigDict) -> bool:
    """Whether the backward pass goes through the parameter at `path` under `config` (FinetuneSpec.in_backward)."""
    return FinetuneSpec.from_config(config).in_backward(path)


def trains_everything(config: ml_collections.ConfigDict) -> bool:
    """Every parameter trains (the step keeps no frozen tree)."""
    return train_mode(config) == "all"


def summary_line(row: dict) -> str | None:
    """What a run trains, for its summary, from its result row (None before its parameters were counted):
    "  trains: all 155,877,376 params" or "  trains: LoRA adapters (9,728 of 116,544 params), base frozen in
    bfloat16"."""
    total, trained = row.get("params"), row.get("trainable_params")
    if total is None or trained is None:
        return None
    rank = row.get("config.model.lora_rank", 0)
    mode = resolve_train(row.get("config.finetune.train", "all"), rank)
    if mode == "all":
        return f"  trains: all {total:,} params" + (" (the base and the LoRA adapters)" if rank else "")
    blocks, parts = row.get("config.finetune.last_blocks", 0), []
    if mode == "adapters":
        parts.append("LoRA adapters")
    elif blocks:
        parts.append("the top block" if blocks == 1 else f"the top {blocks} blocks")
    if row.get("config.finetune.head"):
        parts.append("the head")
    rest = "base" if mode == "adapters" else "rest"
    frozen = row.get("config.finetune.frozen_dtype")
    frozen = "nf4 (the linear layers' weights; the rest bfloat16)" if frozen == NF4 else frozen
    return f"  trains: {' and '.join(parts)} ({trained:,} of {total:,} params), {rest} frozen in {frozen}"

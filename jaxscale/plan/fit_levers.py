"""When nothing fits, what would: the fit planner's levers, cheapest first, each tried by compiling its plan.

`fit` searches remat choices for the largest minibatch that fits; when none fits even at minibatch 1, it tries these
levers one at a time on that question's config (each on top of the config as given, with the remat choice whose
minibatch-1 plan was smallest) and names the first whose minibatch-1 plan fits, with the plan that shows it; if no
single lever does, all of them together (of the optimizer levers, which replace one another, the last that
applies). Cheapest first means: what costs no speed (the allocator's share), then what costs a little compute
(the loss in chunks, bf16 weights, the update inside the backward pass), then smaller optimizer state (bf16 first
moment, 8-bit moments, Adafactor: a different optimizer), then the optimizer state in host memory (time on the host
link), then, for fine-tuning, LoRA and QLoRA (different methods). Each lever is one compile.

On several target GPUs whose mesh has a data-parallel axis (state replicated on each of its devices), two layout
levers move that axis's devices (`layout_levers`): to FSDP (ZeRO-3: every weight gathered at its use, gradients
reduce-scattered: link time, mostly hidden), tried after the chunked loss; and to two pipeline stages (each device
holds half the layers and their state; the bubble idles (p-1)/(m+p-1) of the step), tried after the host-memory
state. Of the two only FSDP joins the levers used together.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import ml_collections

from jaxscale.config import ConfigError, mesh_shape, validate
from jaxscale.config.overrides import apply_overrides
from jaxscale.plan import fit_search

LEVER_MEM_FRACTION = 0.95  # JAX's allocator share a lever asks for (its default is 75%: docs/fit.md)
LEVER_CHUNK_LEN = 512  # train.loss_chunk_len the chunked-loss lever sets


@dataclasses.dataclass(frozen=True)
class Lever:
    """One change that lowers the plan's peak or raises the budget.

    Attributes:
      name: its short name (in the answer and the row).
      cost: what it costs, in words.
      changes: config overrides (dotted names), or none.
      flags: what to add to the command to use it.
      mem_fraction: the allocator share it asks for, or None (the budget unchanged).
      applies: whether it changes anything for this config and budget fraction (an active lever is skipped).
      finetune: a fit_search.FINETUNE_CHOICES method it applies (with_finetune: its changes and LoRA rank), or None.
      optimizer: whether it replaces the optimizer's state (such levers exclude one another).
    """

    name: str
    cost: str
    changes: dict[str, Any]
    flags: str
    mem_fraction: float | None = None
    applies: Callable[[ml_collections.ConfigDict, float], bool] = lambda config, fraction: True
    finetune: str | None = None
    optimizer: bool = False
    layout: bool = False  # it moves the mesh's devices (layout_levers): made for one config, not in LEVERS


def _adam(config: ml_collections.ConfigDict) -> bool:
    return config.optimizer.name in ("adam", "adamw")


LEVERS: tuple[Lever, ...] = (
    Lever("mem_fraction", "no speed: JAX's allocator takes 95% of the GPU's memory instead of 75%", {},
          f"--mem_fraction {LEVER_MEM_FRACTION}", LEVER_MEM_FRACTION, lambda c, f: f < LEVER_MEM_FRACTION),
    Lever("chunked_loss", "a little compute: the output head and the loss in chunks, no [B, T, V] logits",
          {"train.loss_chunk_len": LEVER_CHUNK_LEN}, f"--config.train.loss_chunk_len={LEVER_CHUNK_LEN}",
          applies=lambda c, f: not c.train.loss_chunk_len and c.data.seq_len % LEVER_CHUNK_LEN == 0),
    Lever("bf16_weights", "bf16 weights with no float32 master copy, updated by stochastic rounding (2 bytes a trained "
          "parameter less, and 2 less for its gradient; jaxscale/train/bf16_weights.py)",
          {"model.param_dtype": "bfloat16", "optimizer.bf16_rounding": "stochastic"},
          "--config.model.param_dtype=bfloat16", applies=lambda c, f: c.model.param_dtype == "float32"),
    Lever("in_backward", "each layer's forward recomputed (as Block remat does anyway): every layer updated inside the "
          "backward pass, so the model's whole gradient never exists (jaxscale/train/fused_step.py)",
          {"optimizer.in_backward": True}, "--config.optimizer.in_backward=True",
          applies=lambda c, f: not c.optimizer.in_backward and c.model.scan_layers and c.train.num_minibatches == 1),
    Lever("bf16_state", "Adam's first moment in bf16 (2 bytes a parameter less)", {"optimizer.state_dtype": "bfloat16"},
          "--config.optimizer.state_dtype=bfloat16", optimizer=True,
          applies=lambda c, f: c.optimizer.state_dtype == "float32" and c.optimizer.name != "adafactor"),
    Lever("int8_state", "both Adam moments block-wise 8-bit (about 6 bytes a parameter less)",
          {"optimizer.state_dtype": "int8"}, "--config.optimizer.state_dtype=int8", optimizer=True,
          applies=lambda c, f: _adam(c) and c.optimizer.state_dtype != "int8"),
    Lever("adafactor", "a different optimizer: Adafactor (factored second moments, no first moment)",
          {"optimizer.name": "adafactor", "optimizer.state_dtype": "float32"},
          "--config.optimizer.name=adafactor --config.optimizer.state_dtype=float32", optimizer=True,
          applies=lambda c, f: c.optimizer.name != "adafactor"),
    Lever("offload_state", "host-link time: the optimizer state in host memory, brought over for the update "
          "(jaxscale/train/offload.py)", {"optimizer.offload_state": True}, "--config.optimizer.offload_state=True",
          applies=lambda c, f: not c.optimizer.offload_state),
    Lever("lora_all", "a different method: LoRA on every projection, the base frozen in bf16", {},
          "--finetune lora_all", applies=lambda c, f: c.finetune.train != "adapters", finetune="lora_all"),
    Lever("qlora_all", "a different method: QLoRA, LoRA on every projection over a 4-bit NF4 base", {},
          "--finetune qlora_all", finetune="qlora_all",
          applies=lambda c, f: c.finetune.frozen_dtype != "nf4" and c.model.fp8 == "none"),
)  # fmt: skip


PIPELINE_STAGES = 2  # the pipeline lever's stages: the fewest, the smallest bubble


def layout_levers(config: ml_collections.ConfigDict) -> list[Lever]:
    """The layout levers for `config`'s mesh: none unless its data-parallel axis (mesh.data) has devices to move.

    fsdp: mesh.data's devices join mesh.fsdp (the state split over all of them). pipeline: mesh.data halved and
    PIPELINE_STAGES stages made of the other half (the layers scanned; mesh.pipeline_microbatches as configured, 0
    being one a stage, so each device's minibatch is a multiple of them; its state half the layers'); a config the
    pipeline cannot carry (dropout, a mixture of experts, ...) fails validation and the lever is not tried."""
    data, fsdp = config.mesh.data, config.mesh.fsdp
    if data < 2:
        return []
    zero = config.mesh.zero_stage
    found = [Lever("fsdp", f"link time: the data-parallel axis's {data} devices shard the state too (mesh.fsdp "
                   f"{data * fsdp} at ZeRO stage {zero}: what it splits gathered where it is used, its gradients "
                   "reduce-scattered)",
                   {"mesh.data": 1, "mesh.fsdp": data * fsdp},
                   f"--config.mesh.data=1 --config.mesh.fsdp={data * fsdp}", layout=True)]  # fmt: skip
    if data % PIPELINE_STAGES == 0:
        p = PIPELINE_STAGES
        found.append(Lever(
            "pipeline", f"the bubble: {p} pipeline stages from the data-parallel axis (each device holds 1/{p} of "
            f"the layers and their state; GPipe idles (p-1)/(m+p-1) of the step, {p - 1}/{2 * p - 1} at {p} "
            "microbatches; jaxscale/model/pipeline.py)",
            {"mesh.data": data // p, "mesh.stage": p, "model.scan_layers": True},
            f"--config.mesh.data={data // p} --config.mesh.stage={p} --config.model.scan_layers=True", layout=True,
        ))  # fmt: skip
    return found


def with_levers(config: ml_collections.ConfigDict, levers: list[Lever]) -> ml_collections.ConfigDict:
    """A validated copy of `config` with the levers' changes (a fine-tuning method's through fit_search.with_finetune,
    the one place its LoRA rank is chosen)."""
    config = copy.deepcopy(config)
    rows = config.data.batch_size // config.train.num_minibatches // mesh_shape(config).batch_split
    for lever in levers:
        apply_overrides(config, lever.changes, f"lever {lever.name}")
        if lever.finetune:
            config = fit_search.with_finetune(config, lever.finetune)
    if any(lever.layout for lever in levers):  # each device's rows kept (a multiple of a pipeline's microbatches)
        step = fit_search.minibatch_step(config)
        rows = -(-max(rows, 1) // step) * step
        config.data.batch_size = rows * config.train.num_minibatches * mesh_shape(config).batch_split
    validate(config)
    return config


def _valid(config: ml_collections.ConfigDict, levers: list[Lever]) -> bool:
    """Whether the levers make a config the lab builds (e.g. LoRA on every projection does not apply to a mixture
    of experts' stacked experts: validation says so, and the lever is not tried)."""
    try:
        with_levers(config, levers)
    except ConfigError:
        return False
    return True


def together(levers: list[Lever]) -> list[Lever]:
    """The levers that can be used at once: every one but the optimizer levers and the fine-tuning methods, of each
    of which only the last (they replace one another: a command that set them all would ask for 8-bit Adam moments
    of Adafactor, or LoRA and QLoRA at once)."""
    last = [lever for lever in levers if lever.optimizer][-1:] + [lever for lever in levers if lever.finetune][-1:]
    last += [lever for lever in levers if lever.layout][:1]  # FSDP, not a pipeline too: both move mesh.data
    return [lever for lever in levers if not (lever.optimizer or lever.finetune or lever.layout) or lever in last]


def applicable(config: ml_collections.ConfigDict, shared: bool, fraction: float | None) -> list[Lever]:
    """The levers what_would_fit tries for `config`, in LEVERS' order with its layout levers placed (FSDP after
    the chunked loss, the pipeline after the host-memory state): those that apply to it (Lever.applies) and make a
    config the lab builds, the allocator's share only where the budget is one (`shared`)."""
    order = list(LEVERS)
    for lever in layout_levers(config):
        after = "chunked_loss" if lever.name == "fsdp" else "offload_state"
        order.insert(next((i + 1 for i, lv in enumerate(order) if lv.name == after), len(order)), lever)
    return [lv for lv in order if (lv.mem_fraction is None or shared) and lv.applies(config, fraction or 1)
            and _valid(config, [lv])]  # fmt: skip


def what_would_fit(
    config: ml_collections.ConfigDict,
    choice: str,
    plan: fit_search.Planner,
    usable: int,
    budget_at: Callable[[float], int] | None = None,
    fraction: float | None = None,
    respect_xla_limit: bool = True,
) -> tuple[list[Lever], fit_search.Probe] | None:
    """The cheapest lever (or, failing every one alone, all of them together) whose minibatch-1 plan of `choice`
    fits, with that plan's probe; None when none does.

    Args:
      config: the question's config (its method and precision applied).
      choice: the remat choice to plan (the one whose minibatch-1 plan was smallest).
      plan: the fit's planner.
      usable: the usable bytes of the fit's budget.
      budget_at: the usable bytes at another allocator share (a GPU target's budget), or None (a fixed --memory:
        the allocator lever does not apply).
      fraction: the allocator share of `usable` (None: not a share).
      respect_xla_limit: as the fit's --xla_limit.
    """
    shared = budget_at is not None and fraction is not None
    active = applicable(config, shared, fraction)

    def tried(levers: list[Lever]) -> fit_search.Probe:
        share = max([lever.mem_fraction for lever in levers if lever.mem_fraction], default=None)
        budget = budget_at(share) if share and budget_at else usable
        levered = with_levers(config, levers)
        smallest = fit_search.minibatch_step(levered)  # 1, or a pipeline's microbatches
        return fit_search.probe(plan, levered, choice, smallest, budget, respect_xla_limit)

    for lever in active:
        probe = tried([lever])
        if probe.fits:
            return [lever], probe
    combined = together(active)
    if len(combined) > 1 and _valid(config, combined):
        probe = tried(combined)
        if probe.fits:
            return combined, probe
    return None


def answer(levers: list[Lever], probe: fit_search.Probe) -> str:
    """The one line the fit prints: the levers, what they cost, the plan that shows it, and the flags."""
    gib = (probe.peak_bytes or 0) / 2**30
    named = "; ".join(f"{lever.name} ({lever.cost})" for lever in levers)
    flags = " ".join(lever.flags for lever in levers)
    at = f"its plan at minibatch {probe.minibatch} is {gib:.3g} GiB and fits"
    return f"what would fit: {named}: {at}; rerun with {flags}"

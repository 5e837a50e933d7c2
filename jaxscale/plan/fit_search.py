"""The fit planner's search: per remat choice, the largest per-device minibatch whose compiled plan fits.

Compilation alone decides (no step runs): `plan_minibatch(config)` is any function that compiles one config and
returns its plan as result-row fields (`compiled_peak_bytes`, `plan_fits`, ...): `target_planner` (XLA's GPU
plan for a target, deviceless) or `local_planner` (this machine's compiler; a CPU plan is only a proxy for a
GPU's). `search_largest` grows the minibatch, stepping by the plans' own slope and at most doubling, until a
plan does not fit, then bisects the bracket (interpolating between the two plans' peaks, with a midpoint
step when interpolation stalls (twice the same end moved) or the fitting plan already sits on XLA's own
limit, where XLA's rematerialization flattens the peaks), bounded by a largest minibatch and a number of
compiles. Plans are near-linear in the minibatch, so from the analytic estimate's answer a search takes about
four compiles.

The minibatch is per device: `with_minibatch` sets data.batch_size = minibatch x train.num_minibatches x the
devices the batch is split over (the mesh's data x fsdp axes), and `target_planner(..., devices=N)` plans the
config's mesh on N target GPUs, so every plan and budget is per device. A pipeline (mesh.stage > 1) splits each
device's minibatch into its microbatches, so there the search steps by `minibatch_step(config)` (the microbatches)
and every minibatch it tries, and answers, is a multiple of it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from jaxscale.config import flatten, mesh_shape, remat_policies, validate
from jaxscale.config.overrides import apply_overrides
from jaxscale.config.spec import RunSpec, pipeline_microbatches, tokens_per_step
from jaxscale.measure import flops, memory
from jaxscale.plan import gpu_plan
from jaxscale.train import abstract_inputs, make_train_step, offload, param_columns, sharding

# Remat choices the planner compares: (label, model.remat, model.remat_policy), roughly from least kept to most.
# The named policies apply to the whole block (what they keep is per block, MaxText's usage); what each keeps,
# with its source: jaxscale.config.remat_policies.POLICIES and docs/fit.md.
REMAT_CHOICES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "none": ("no remat", (), "nothing_saveable"),
    "mlp_attn": ("MLP+Attn", ("MLP", "Attn"), "nothing_saveable"),
    "block": ("Block", ("Block",), "nothing_saveable"),
    "block_qkv_proj_offloaded": ("Block, qkv_proj_offloaded", ("Block",), "qkv_proj_offloaded"),
    "block_save_out_proj": ("Block, save_out_proj", ("Block",), "save_out_proj"),
    "block_save_qkv_proj": ("Block, save_qkv_proj", ("Block",), "save_qkv_proj"),
    "block_selective_op": ("Block, selective_op", ("Block",), "selective_op"),
    "block_save_dot_with_context_except_mlp": (
        "Block, save_dot_with_context_except_mlp",
        ("Block",),
        "save_dot_with_context_except_mlp",
    ),
    "block_dots_no_batch": ("Block, dots_with_no_batch_dims_saveable", ("Block",), "dots_with_no_batch_dims_saveable"),
    "block_minimal_flash": ("Block, minimal_flash", ("Block",), "minimal_flash"),
    "block_dots": ("Block, dots_saveable", ("Block",), "dots_saveable"),
}
# Fine-tuning methods the planner compares (--finetune): name -> (label, config changes). LoRA takes the config's
# model.lora_rank, or DEFAULT_LORA_RANK when it is 0; what each trains and stores: docs/finetune.md.
DEFAULT_LORA_RANK = 16
FINETUNE_CHOICES: dict[str, tuple[str, dict[str, Any]]] = {
    "full": ("full, Adam", {"finetune.train": "all"}),
    "full_bf16_state": (
        "full, Adam, bf16 first moment",
        {"finetune.train": "all", "optimizer.state_dtype": "bfloat16"},
    ),
    "full_int8_state": (
        "full, Adam, 8-bit state",
        {"finetune.train": "all", "optimizer.state_dtype": "int8"},
    ),
    "full_adafactor": ("full, Adafactor", {"finetune.train": "all", "optimizer.name": "adafactor"}),
    # bf16 weights with no float32 master copy, updated by stochastic rounding (jaxscale.train.bf16_weights):
    # torchtune's and fms-fsdp's default weights; with the 8-bit state as torchtune's single-GPU recipe keeps it
    "full_bf16_weights": (
        "full, Adam, bf16 weights (stochastic rounding)",
        {"finetune.train": "all", "model.param_dtype": "bfloat16", "optimizer.bf16_rounding": "stochastic"},
    ),
    "full_bf16_weights_int8_state": (
        "full, Adam, bf16 weights, 8-bit state",
        {"finetune.train": "all", "model.param_dtype": "bfloat16", "optimizer.bf16_rounding": "stochastic",
         "optimizer.state_dtype": "int8"},
    ),  # fmt: skip
    # ... and each layer updated inside the backward pass (jaxscale.train.fused_step, torchtune's optimizer_in_bwd):
    # no whole gradient; one minibatch a step (accumulation needs the whole gradient)
    "full_bf16_weights_int8_state_in_backward": (
        "full, Adam, bf16 weights, 8-bit state, updated in the backward pass",
        {"finetune.train": "all", "model.param_dtype": "bfloat16", "optimizer.bf16_rounding": "stochastic",
         "optimizer.state_dtype": "int8", "optimizer.in_backward": True, "train.num_minibatches": 1},
    ),  # fmt: skip
    # ... with Adam's float32 state on the host instead, paged to the device a layer at a time inside the backward pass
    # (the lab's stand-in for torchtune's paged 8-bit AdamW: JAX has no unified memory)
    "full_bf16_weights_paged_state_in_backward": (
        "full, Adam, bf16 weights, state on the host paged by layer, updated in the backward pass",
        {"finetune.train": "all", "model.param_dtype": "bfloat16", "optimizer.bf16_rounding": "stochastic",
         "optimizer.offload_state": True, "optimizer.in_backward": True, "train.num_minibatches": 1},
    ),  # fmt: skip
    # Host offload (jaxscale.train.offload, MaxText's optimizer_ / parameter_memory_host_offload): the state, and the
    # trained parameters too, in pinned host memory; the plan's device peak leaves them out, the prediction prices
    # what crosses the target's PCIe link.
    "full_offload_state": ("full, Adam, state on the host", {"finetune.train": "all", "optimizer.offload_state": True}),
    "full_offload_params": (
        "full, Adam, state and parameters on the host",
        {"finetune.train": "all", "optimizer.offload_state": True, "train.offload_params": True},
    ),
    "lora_attention": ("LoRA on attention", {"finetune.train": "adapters", "model.lora_targets": ("attention",)}),
    "lora_all": ("LoRA on all projections", {"finetune.train": "adapters", "model.lora_targets": ("all",)}),
    # QLoRA: the same adapters over a base whose projection kernels are frozen in NF4 (jaxscale.model.nf4)
    "qlora_attention": (
        "QLoRA on attention (NF4 base)",
        {"finetune.train": "adapters", "model.lora_targets": ("attention",), "finetune.frozen_dtype": "nf4"},
    ),
    "qlora_all": (
        "QLoRA on all projections (NF4 base)",
        {"finetune.train": "adapters", "model.lora_targets": ("all",), "finetune.frozen_dtype": "nf4"},
    ),
}


def remat_choice(choice: str) -> tuple[str, tuple[str, ...], str]:
    """(label, model.remat, model.remat_policy) of a --remat choice: a REMAT_CHOICES name, or a per-activation
    policy (`per_activation:qkv_proj=offload+context=device`, jaxscale.config.remat_policies) on the whole block.

    Raises:
      KeyError: neither a REMAT_CHOICES name nor a well-formed per-activation policy.
    """
    if choice.startswith(remat_policies.PER_ACTIVATION):
        remat_policies.per_activation(choice)  # a malformed one is a KeyError, as an unknown name
        return f"Block, {choice}", ("Block",), choice
    return REMAT_CHOICES[choice]


# --precision: the matmuls' precision, side by side where the target has FP8 tensor cores (jaxscale.model.fp8).
PRECISION_CHOICES: dict[str, tuple[str, dict[str, Any]]] = {
    "bf16": ("bf16 matmuls", {"model.fp8": "none"}),
    "fp8": ("FP8 matmuls (dynamic tensorwise scaling)", {"model.fp8": "dynamic"}),
    "fp8_delayed": ("FP8 matmuls (delayed scaling, Flax's op)", {"model.fp8": "delayed"}),
}
DEFAULT_LIMIT = 4096  # largest minibatch tried
DEFAULT_MAX_COMPILES = 12  # per remat choice

Planner = Callable[[ml_collections.ConfigDict], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Probe:
    """One compiled plan: the minibatch, whether it fits the usable budget, and its row fields."""

    minibatch: int
    fits: bool
    peak_bytes: int | None
    reason: str | None  # why it does not fit, or the compile's error
    row: dict[str, Any]
    seconds: float
    failed: bool = False  # the compile itself failed (not a memory verdict)
    limit_bytes: int | None = None  # XLA's own memory limit, when its rematerialization warning gave it


@dataclasses.dataclass
class Search:
    """The probes of one search, in order, and what they bracket."""

    probes: list[Probe]
    largest: Probe | None  # the largest fitting minibatch found
    too_large: Probe | None  # the smallest minibatch above it that did not fit
    limit: int = DEFAULT_LIMIT  # the largest minibatch the search could try
    step: int = 1  # every minibatch tried is a multiple of it (a pipeline's microbatches; `minibatch_step`)

    @property
    def compiles(self) -> int:
        return len(self.probes)

    @property
    def complete(self) -> bool:
        """Whether the answer is the edge: the bracket closed (largest + step does not fit), the limit fits, or
        the smallest minibatch (one step) does not fit. False when --max_compiles or a failed compile stopped the
        search first: `largest` is then only a lower bound."""
        if self.largest is None:
            return self.too_large is not None and self.too_large.minibatch == self.step
        if self.too_large is None:
            return self.largest.minibatch == self.limit
        return self.too_large.minibatch == self.largest.minibatch + self.step


def minibatch_step(config: ml_collections.ConfigDict) -> int:
    """The granule of a per-device minibatch: a pipeline's microbatches (spec.pipeline_microbatches), which must
    divide every device's rows of a minibatch (config validation); 1 without a pipeline."""
    return pipeline_microbatches(config)


def finetune_fields(method: str) -> tuple[str, ...]:
    """The config fields FINETUNE_CHOICES[method] sets through `with_finetune` (its changes and the LoRA rank)."""
    return (*FINETUNE_CHOICES[method][1], "model.lora_rank")


def with_finetune(config: ml_collections.ConfigDict, method: str) -> ml_collections.ConfigDict:
    """A validated copy of `config` fine-tuned by FINETUNE_CHOICES[method] (LoRA at the config's rank, or 16).

    Raises:
      ConfigError: the method does not apply to this model (one line naming the field).
    """
    config = copy.deepcopy(config)
    _, changes = FINETUNE_CHOICES[method]
    apply_overrides(config, changes, f"--finetune {method}")
    if config.finetune.train == "adapters" and not config.model.lora_rank:
        config.model.lora_rank = DEFAULT_LORA_RANK
    if config.finetune.train == "all":
        config.model.lora_rank = 0
    validate(config)
    return config


def with_precision(config: ml_collections.ConfigDict, precision: str) -> ml_collections.ConfigDict:
    """A validated copy of `config` with the matmul precision PRECISION_CHOICES[precision]."""
    config = copy.deepcopy(config)
    apply_overrides(config, PRECISION_CHOICES[precision][1], f"--precision {precision}")
    validate(config)
    return config


def with_minibatch(config: ml_collections.ConfigDict, choice: str, minibatch: int) -> ml_collections.ConfigDict:
    """A validated copy of `config` with the remat choice and `minibatch` sequences per device and minibatch."""
    _, remat, policy = remat_choice(choice)
    config = copy.deepcopy(config)
    config.model.remat, config.model.remat_policy = remat, policy
    config.data.batch_size = minibatch * config.train.num_minibatches * mesh_shape(config).batch_split
    validate(config)
    return config


def target_planner(
    target: str, gemm: str = "both", usable: int | None = None, respect_xla_limit: bool = True, devices: int = 1
) -> Planner:
    """XLA's deviceless plan for a GPU target on `devices` GPUs (the config's mesh), compiled in this process
    (gpu_plan.plan_for_target's row, with its predicted step).

    With gemm="both" the cuBLAS plan (the larger one at large batches, docs/gpu_planning.md) is compiled
    first; when it already does not fit (XLA's warning, when respected, or a peak above `usable`), the Triton
    plan cannot change the verdict and is skipped (its peak stays null), which halves the cost of every probe
    that fails.
    """

    def enough(cublas: dict[str, Any]) -> bool:
        warned = respect_xla_limit and not cublas["plan_fits"]
        return warned or (usable is not None and device_peak(cublas) > usable)

    def plan(config: ml_collections.ConfigDict) -> dict[str, Any]:
        return gpu_plan.plan_for_target(config, target, gemm=gemm, devices=devices, in_process=True, enough=enough)

    return plan


def local_planner(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """This machine's compiler's plan of the train step (on a CPU only a proxy for a GPU's), as row fields."""
    start = time.perf_counter()
    with gpu_plan.captured_stderr() as stderr:
        if offload.parts(config):  # state in host memory: the placement's one-device layout carries the memory kinds
            placement = sharding.placement(config)
            inputs, step = placement.abstract_inputs(), placement.step()
        else:
            inputs, step = abstract_inputs(config), make_train_step(config)
        compiled = step.lower(*inputs).compile()
    row: dict[str, Any] = {**memory.compiled_memory(compiled), "compile_s": time.perf_counter() - start}
    row.update(param_columns(inputs[0]))
    warning = gpu_plan.parse_remat_warning(stderr[0])  # a local GPU's compiler warns as a target's does
    row.update(warning or dict.fromkeys(gpu_plan.REMAT_COLUMNS))
    row["compiled_backend"] = jax.default_backend()
    # judged as a target's plan is (gpu_plan.plan_row): the warning's estimate counts host-memory state as the device's
    judged = gpu_plan.device_warning(warning, row.get("compiled_host_argument_bytes") or 0)
    row["plan_fits"] = judged is None
    row["plan_fits_reason"] = None if judged is None else gpu_plan.remat_warning_reason(judged)
    return row


def plan_row(plan: Planner, config, choice: str, minibatch: int) -> tuple[dict[str, Any], str | None, float]:
    """Compiles `choice` at `minibatch`: (the plan's row fields, the compile's error or None, seconds)."""
    start = time.perf_counter()
    try:
        return plan(with_minibatch(config, choice, minibatch)), None, time.perf_counter() - start
    except Exception as error:  # the compile failed: a row, not a crash (XLA raises many types)
        message = " ".join(f"{type(error).__name__}: {error}".split())[:500]
        return {}, message, time.perf_counter() - start


def device_peak(row: dict[str, Any]) -> int | None:
    """The plan's peak on the device: compiled_device_peak_bytes (jaxscale.measure.host_memory: the CPU backend's
    plan counts host-memory state in its peak) where the row has it, else compiled_peak_bytes."""
    found = row.get("compiled_device_peak_bytes")
    return found if found is not None else row.get("compiled_peak_bytes")


def judge(
    minibatch: int, row: dict[str, Any], error: str | None, seconds: float, usable: int, respect_xla_limit: bool = True
) -> Probe:
    """A plan against `usable` bytes: it fits when its peak is within and, with `respect_xla_limit`, XLA did not
    warn that it could not rematerialize below its own limit (the planner's `plan_fits`).

    XLA's warning compares XLA's own estimate, made before its last fusions, with a limit derived from 80% of the
    device's memory; the buffer plan that follows can be well below it (gpt2 on an RTX 4090, docs/fit.md), so
    `respect_xla_limit=False` lets the plan's peak alone decide.
    """
    if error is not None:
        return Probe(minibatch, False, None, error, row, seconds, failed=True)
    peak = device_peak(row)
    reason = row.get("plan_fits_reason") if respect_xla_limit and row.get("plan_fits") is False else None
    if reason is None and peak is not None and peak > usable:
        reason = f"planned peak {peak} bytes > usable {usable} bytes"
    limit = row.get("compiled_remat_limit_bytes") if respect_xla_limit else None
    return Probe(minibatch, reason is None, peak, reason, row, seconds, limit_bytes=limit)


def probe(
    plan: Planner,
    config: ml_collections.ConfigDict,
    choice: str,
    minibatch: int,
    usable: int,
    respect_xla_limit: bool = True,
) -> Probe:
    """Compiles `choice` at `minibatch` and judges it against `usable` bytes; a failed compile is a Probe too."""
    return judge(minibatch, *plan_row(plan, config, choice, minibatch), usable, respect_xla_limit)


def _interpolate(low: Probe, high: Probe, usable: int) -> int | None:
    """The minibatch where the line through two plans' peaks meets `usable`, or None if they do not rise."""
    if low.peak_bytes is None or high.peak_bytes is None or high.peak_bytes <= low.peak_bytes:
        return None
    slope = (high.peak_bytes - low.peak_bytes) / (high.minibatch - low.minibatch)
    return low.minibatch + int((usable - low.peak_bytes) // slope)


PLATEAU = 0.97  # a fitting plan within 3% of the aim is taken to sit on XLA's rematerialization plateau


def _below(probe: Probe, xla_limit: int | None) -> bool:
    """Whether the line through this fitting plan can point to the edge: yes, unless XLA has named its own limit
    and the plan sits within 3% of it. There XLA's rematerialization flattens the peaks (at :seed on an A5000,
    MLP+Attn at minibatch 275 and 280 both planned 18.08 GiB against a limit of 18.31): only bisection finds
    the edge."""
    if probe.peak_bytes is None:
        return False
    return xla_limit is None or probe.peak_bytes < PLATEAU * xla_limit


def _next_grow(last: Probe, previous: Probe | None, usable: int, limit: int, xla_limit: int | None) -> int:
    """Grow step from a fitting probe: to where the peaks' line meets `usable`, at least +1, at most doubling."""
    line = previous is not None and _below(last, xla_limit)
    guess = _interpolate(previous, last, usable) if line else None
    target = 2 * last.minibatch if guess is None else guess + 1  # +1: land just past the edge, then bisect
    return min(limit, max(last.minibatch + 1, min(target, 2 * last.minibatch)))


@dataclasses.dataclass
class _Probes:
    """The probes of one search by minibatch (each measured once) and the aim they imply."""

    measure: Callable[[int], Probe]
    usable: int
    max_compiles: int
    seen: dict[int, Probe] = dataclasses.field(default_factory=dict)

    def at(self, minibatch: int) -> Probe:
        if minibatch not in self.seen:
            self.seen[minibatch] = self.measure(minibatch)
        return self.seen[minibatch]

    def spent(self) -> bool:
        return len(self.seen) >= self.max_compiles

    def xla_limit(self) -> int | None:
        return min((p.limit_bytes for p in self.seen.values() if p.limit_bytes), default=None)

    def aim(self) -> int:
        return min(self.usable, self.xla_limit() or self.usable)


def _grow(probes: _Probes, start: int, limit: int) -> tuple[Probe | None, Probe | None]:
    """(largest fitting, smallest not fitting) after growing from `start` (or halving when it does not fit)."""
    low = high = previous = None
    minibatch = max(1, min(start, limit))
    while not probes.spent():
        current = probes.at(minibatch)
        if current.failed:
            break
        if current.fits:
            low, previous = current, low
            if high is not None or minibatch == limit:
                break
            minibatch = _next_grow(current, previous, probes.aim(), limit, probes.xla_limit())
        else:
            high = current
            if low is not None or minibatch == 1:
                break
            minibatch = max(1, minibatch // 2)
    return low, high


def _bisect(probes: _Probes, low: Probe, high: Probe) -> tuple[Probe, Probe]:
    """Closes the bracket [low fits, high does not]: interpolated steps, a midpoint when they stall."""
    moved: list[bool] = []  # which end each step moved (True: low); twice the same end = stalling
    while high.minibatch - low.minibatch > 1 and not probes.spent():
        stalled = len(moved) >= 2 and moved[-1] == moved[-2]
        line = not stalled and _below(low, probes.xla_limit())
        guess = _interpolate(low, high, probes.aim()) if line else None
        if guess is None:
            guess = (low.minibatch + high.minibatch) // 2
        guess = min(max(guess, low.minibatch + 1), high.minibatch - 1)  # the line's edge, or just past `low`
        current = probes.at(guess)
        if current.failed:
            break
        moved.append(current.fits)
        low, high = (current, high) if current.fits else (low, current)
    return low, high


def search_largest(
    measure: Callable[[int], Probe],
    usable: int,
    start: int = 1,
    limit: int = DEFAULT_LIMIT,
    max_compiles: int = DEFAULT_MAX_COMPILES,
    step: int = 1,
) -> Search:
    """The largest minibatch in [1, limit] whose probe fits, by grow-then-bisect within `max_compiles`; with
    `step` > 1 only multiples of it are tried (the search runs in steps, each probe at steps x step).

    Assumes that fitting is monotone in the minibatch (a larger minibatch never needs less memory). The steps
    aim at `usable`, or at XLA's own lower limit once a probe's rematerialization warning has named it (a GPU
    plan fits only below that limit, about 77-80% of the device's memory).
    Args:
      measure: minibatch -> Probe (each call is one compile; repeated minibatches are not re-measured).
      usable: the budget in bytes (used to aim the steps; `measure` decides what fits).
      start: the first minibatch (e.g. the analytic estimate's answer).
    Returns:
      The Search; largest is None when minibatch 1 does not fit (or every compile failed).
    """
    def in_steps(steps: int) -> Probe:  # the search's arithmetic counts steps; the probe compiles steps x step
        return dataclasses.replace(measure(steps * step), minibatch=steps)

    def rows(found: Probe | None) -> Probe | None:
        return None if found is None else dataclasses.replace(found, minibatch=found.minibatch * step)

    probes = _Probes(in_steps, usable, max_compiles)
    low, high = _grow(probes, max(1, start // step), max(1, limit // step))
    if low is not None and high is not None:
        low, high = _bisect(probes, low, high)
    seen = [rows(p) for p in probes.seen.values()]
    return Search(seen, rows(low), rows(high), max(1, limit // step) * step, step)


def analytic_largest_minibatch(
    config: ml_collections.ConfigDict, choice: str, usable: int, limit: int = DEFAULT_LIMIT
) -> int:
    """The analytic memory model's answer (a prediction): largest minibatch whose analytic peak <= usable, or 0;
    a multiple of `minibatch_step(config)` (a pipeline's microbatches).

    The analytic peak is affine in the minibatch (states fixed, activations linear), so two evaluations suffice.
    """
    step = minibatch_step(config)
    one = memory.analytic_memory(with_minibatch(config, choice, step))["analytic_peak_bytes"]
    two = memory.analytic_memory(with_minibatch(config, choice, 2 * step))["analytic_peak_bytes"]
    if one > usable:
        return 0
    return step * int(min(limit // step, 1 + (usable - one) // max(two - one, 1)))


def fit_row(config: ml_collections.ConfigDict, choice: str, search: Search, settings: dict[str, Any]) -> dict:
    """The result row of one remat choice: the plan at its largest minibatch (or, when none fits, the smallest
    plan tried) with the analytic columns and the search's own `fit_*` columns.

    status: ok (a minibatch fits), oom (none fits: the row names the smallest plan), error (compiles failed).
    """
    chosen = search.largest or min(search.probes, key=lambda p: p.minibatch)
    planned = with_minibatch(config, choice, chosen.minibatch)
    row: dict[str, Any] = {"status": "ok", "error": None, **flatten(planned), **chosen.row}
    row["tokens_per_step"] = tokens_per_step(planned)
    run = RunSpec.from_config(planned)  # the analytic models' view, read once for both
    row.update(flops.analytic_columns(run), **memory.analytic_columns(run, chosen.peak_bytes))
    if search.largest is None:
        row["status"] = "error" if chosen.failed else "oom"
        row["error"] = (
            f"compile failed: {chosen.reason}"
            if chosen.failed
            else f"no minibatch fits: the smallest plan (minibatch {chosen.minibatch}) does not fit: {chosen.reason}"
        )
    row["fit_search_note"] = None
    if search.largest is not None and not search.complete:
        row["fit_search_note"] = (
            f"search stopped before the edge after {search.compiles} compiles (--max_compiles, or a failed "
            f"compile): minibatch {search.largest.minibatch} fits, larger ones up to "
            f"{search.too_large.minibatch - 1 if search.too_large else search.limit} were not tried"
        )
    label, remat, policy = remat_choice(choice)
    row.update(
        fit_choice=choice,
        fit_remat=label,
        fit_largest_minibatch=search.largest.minibatch if search.largest else None,
        fit_first_too_large_minibatch=search.too_large.minibatch if search.too_large else None,
        fit_compiles=search.compiles,
        fit_compile_s=sum(p.seconds for p in search.probes),
        fit_probes=[[p.minibatch, p.peak_bytes, p.fits] for p in search.probes],
        fit_search_complete=search.complete,
        analytic_largest_minibatch=analytic_largest_minibatch(
            config, choice, settings["fit_usable_bytes"], search.limit
        ),
        **settings,
    )
    return row

"""docs/published.md's memory table: the published runs whose lab program did not fit their card at first sight,
replanned as their setups stand, each beside its framework's own memory accounting, tensor by tensor.

The frameworks' accounting, per GPU, as they write it (N parameters, d the ranks the optimizer state is split over,
s the sequence a GPU holds, b its microbatch, h the hidden size, L the layers, V the vocabulary):

- Megatron-Core's distributed optimizer (NVIDIA/Megatron-LM docs/source/api-guide/dist_optimizer.md @ 50b073cc,
  and megatron/training/theoretical_memory_usage.py's `compute_weight_and_optimizer_memory` @ 00caa53a): bf16
  parameters (2 bytes) and float32 main gradients (4) on every rank, float32 main parameters and Adam's two moments
  (12) split over d: 6 + 12/d bytes a parameter; with gradients reduced in bf16 (`grad_reduce_in_fp32=False`),
  4 + 16/d (the float32 main gradient joins the split state). For an MoE model the experts' parameters are split over
  the expert axis and their state over the expert-data-parallel ranks (d / EP); Megatron's function has no expert
  term, so that split is the lab's reading of the distributed optimizer's, and is said so in the table.
- Megatron FSDP (Megatron-Bridge's `use_megatron_fsdp`): the distributed optimizer's bytes, each split over d (the
  lab's reading: Megatron's function has no FSDP term).
- Megatron-Core's activations without sequence parallelism (`compute_activation_memory_without_sp`, tensor and
  pipeline parallel 1): s b h (10 + 24) a layer (Korthikanti et al. 2022, Table 2, with flash attention's s^2 term
  gone), the embedding's 8 s b + s b h, the output layer's (s b V + s b h) x 2, and 5% over all of it. It has no
  mixture-of-experts term: for an MoE model the column is the formula as written.
- PyTorch FSDP2 with float32 sharded parameters (NeMo AutoModel): float32 parameters (4), float32 gradients (4) and
  Adam's moments (8) all split over d, 16/d bytes a parameter (ZeRO-3's accounting, Rajbhandari et al. 2020, with
  float32 parameters); with every block checkpointed, each layer keeps its bf16 input, 2 s b h (Korthikanti et al.
  2022, full recompute).

The lab's side is its analytic memory model of the same program (jaxscale/measure/memory.py: weights, gradients,
optimizer state, activations) and the compiled plan's peak beside it.
"""

from __future__ import annotations

import dataclasses
import pathlib

from jaxscale.report.models_tables import markdown
from jaxscale.sweep.results import read_rows

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Accounting:
    """A framework's bytes a GPU for one run, by tensor, and the formula they follow."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    formula: str

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def megatron_activation_bytes(seq: int, micro_batch: int, hidden: int, layers: int, vocab: int) -> float:
    """Megatron-Core's `compute_activation_memory_without_sp` at tensor and pipeline parallel 1, in bytes."""
    sbh = seq * micro_batch * hidden
    per_layer = sbh * (10 + 24)
    embedding = 8 * seq * micro_batch + sbh
    output = (seq * micro_batch * vocab + sbh) * 2
    return (per_layer * layers + embedding + output) * 1.05


def _expert_params(row: dict) -> int:
    """The routed experts' parameters: gate, up and down of each expert in each MoE layer."""
    experts = row.get("config.model.num_experts") or 0
    if not experts:
        return 0
    moe_layers = row["config.model.num_layers"] - (row.get("config.model.first_dense_layers") or 0)
    return moe_layers * experts * 3 * row["config.model.hidden_size"] * row["config.model.moe_hidden_size"]


def _per_gpu_sequence(published: dict) -> int:
    return published["seq_len"] // (published["layout"].get("cp") or 1)


def framework_accounting(published: dict, row: dict) -> Accounting | None:
    """The run's framework's own bytes a GPU (the module's docstring), or None for a framework without one here, and
    for a pipeline-parallel run (layout pp > 1): the formulas above are written for pipeline parallel 1 (every GPU
    holds every layer), and Megatron's pipeline terms (a stage's layers, its in-flight microbatches) are not built."""
    layout, n = published["layout"], published["n_gpus"]
    if (layout.get("pp") or 1) > 1:
        return None
    params, experts = row["params"], _expert_params(row)
    expert_axis = layout.get("ep") or 1
    local = params - experts + experts / expert_axis  # the parameters a GPU holds
    s, b = _per_gpu_sequence(published), published["per_gpu_batch"]
    h, layers = row["config.model.hidden_size"], row["config.model.num_layers"]
    project = published["project"]
    if "AutoModel" in project:  # FSDP2, float32 sharded parameters, every block checkpointed
        return Accounting(4 * params / n, 4 * params / n, 8 * params / n, 2 * s * b * h * layers,
                          "FSDP2: 16/d a parameter; 2 s b h a layer (full recompute)")  # fmt: skip
    if "Megatron" not in project and "NeMo" not in project:
        return None
    bf16_grads = "reduced in bf16" in published["precision"] or "grad_reduce_in_fp32 False" in published["optimizer"]
    grad_bytes, split_bytes = (2, 16) if bf16_grads else (4, 12)
    activations = megatron_activation_bytes(s, b, h, layers, row["config.model.vocab_size"])
    if "Megatron FSDP" in published["optimizer"]:
        return Accounting(
            2 * params / n,
            grad_bytes * params / n,
            split_bytes * params / n,
            activations,
            f"Megatron FSDP: ({2 + grad_bytes} + {split_bytes})/d a parameter (the lab's reading)",
        )
    expert_split = (n // expert_axis) if experts else n
    optimizer = split_bytes * ((params - experts) / n + experts / expert_axis / expert_split)
    formula = f"distributed optimizer: {2 + grad_bytes} + {split_bytes}/d a parameter"
    if experts:
        formula += f"; experts split over EP {expert_axis}, their state over d/EP = {expert_split} (the lab's reading)"
    return Accounting(2 * local, grad_bytes * local, optimizer, activations, formula)


def selected(runs: list[dict]) -> list[dict]:
    """The registered runs whose first-sight plan did not fit the card they ran on (jaxscale.published's rule: a
    larger card than the lab's target, as torchtitan's 96 GB H100s, with the plan below it, is not one)."""
    from jaxscale import published as runs_file  # imports JAX: only when this table is written

    return [run for run in runs if run.get("first_sight") and not runs_file.first_sight_fitted(run)]


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value / GIB:.1f}"


def published_memory_table(rows_path: pathlib.Path, runs_path: pathlib.Path) -> str:
    """One line a run (selected): its card, the lab's plan now and at first sight, the lab's model by tensor, and
    the framework's accounting by tensor (GiB a GPU).

    Args:
      rows_path: experiments/results/published/results.jsonl.
      runs_path: experiments/published_runs.json.

    Returns:
      The markdown table.
    """
    rows = {row["variant"]: row for row in read_rows(rows_path)}
    header = ("run", "card GiB", "plan GiB (first sight)", "fits", "lab: weights / gradients / optimizer / "
              "activations", "framework: weights / gradients / optimizer / activations", "framework total",
              "framework's accounting")  # fmt: skip
    lines = []
    from jaxscale import published as runs_file  # imports JAX: only when this table is written

    for published in selected(runs_file.load_runs(runs_path)):
        row = rows[published["id"]]
        theirs = framework_accounting(published, row)
        lab = " / ".join(_gib(row[f"analytic_{name}_bytes"]) for name in ("params", "grads", "optimizer", "activation"))
        framework = (
            "–"
            if theirs is None
            else " / ".join(
                _gib(value) for value in (theirs.weights, theirs.gradients, theirs.optimizer, theirs.activations)
            )
        )
        lines.append((
            published["id"], _gib(row["plan_target_memory_bytes"]),
            f"{_gib(row['compiled_peak_bytes'])} ({published['first_sight']['plan_peak_gib']:.1f})",
            "yes" if row["plan_fits"] else "no", lab, framework, _gib(theirs and theirs.total),
            "–" if theirs is None else theirs.formula,
        ))  # fmt: skip
    return markdown(header, lines)

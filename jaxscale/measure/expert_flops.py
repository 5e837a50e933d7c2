"""What a mixture of experts' matmuls cost in the compiled program against what its active experts need.

The experts' matmuls (jaxscale.model.moe: gate, up and down of every dispatch) run under the named scope
EXPERT_SCOPE, so every dot the compiled program runs for them (forward, input and weight gradients, remat's
recomputation; a cuBLAS call or a Triton GEMM fusion on a GPU) carries it in its `op_name`. Counting their FLOPs
with each loop body times its trip count (jaxscale.measure.hlo) gives what the program really executes, which the
dispatch decides:

- dense: every expert on every token, E / k times the active experts' FLOPs;
- capacity: E x C slots per sequence (C = ceil(factor x T x k / E)), E C / (T k) times them;
- ragged: `jax.lax.ragged_dot` as the backend compiles it. XLA's CPU backend and its GPU backend (the
  `ragged_dot_rewriter`, unless a grouped path is compiled: docs/models.md) expand it into a dot over every group
  of a masked copy of the rows, E times the active FLOPs (the weight gradient's ragged contracting dot too);
  a grouped GEMM would be 1.

Columns (compiled_* per device on a mesh, as every compiled column; null with `expert_flops_note` otherwise):
- compiled_expert_matmul_flops_per_step: the experts' matmuls in the compiled step (remat's recomputation included);
- compiled_expert_recompute_flops_per_step: of which recomputed by remat (`rematted_computation` in op_name);
- analytic_expert_matmul_flops_per_step: the active experts' forward and backward: tokens x MoE layers x 3 x
  6·k·H·F_e (gate, up and down, 2·H·F_e each, for the k experts a token goes to; the same k experts the model
  FLOPs and MFU count, jaxscale.measure.flops);
- compiled_to_analytic_expert_flops_ratio: (compiled - recompute) / (analytic / mesh devices).
"""

from __future__ import annotations

import re

import ml_collections

from jaxscale.config.spec import ModelConfig, tokens_per_step
from jaxscale.measure import hlo

EXPERT_SCOPE = "expert_matmuls"  # jax.named_scope of the experts' matmuls in jaxscale.model.moe
COMPILED = ("compiled_expert_matmul_flops_per_step", "compiled_expert_recompute_flops_per_step")
COLUMNS = (*COMPILED, "analytic_expert_matmul_flops_per_step", "compiled_to_analytic_expert_flops_ratio")
# The scope as one element of an op_name: ".../mlp/expert_matmuls/...", "transpose(jvp(expert_matmuls))/..."
_IN_SCOPE = re.compile(rf"(^|[/(]){EXPERT_SCOPE}([/)]|$)")


def is_expert_matmul(instruction: hlo.Instruction) -> bool:
    """Whether an HLO instruction is (part of) the experts' matmuls: EXPERT_SCOPE in its op_name."""
    return bool(_IN_SCOPE.search(instruction.op_name))


def compiled_columns(hlo_text: str) -> dict[str, float]:
    """The experts' matmul FLOPs in a compiled program (per device), all and remat's recomputed part.

    Args:
      hlo_text: `compiled.as_text()` (this machine's or a GPU target's optimized HLO).
    """
    module = hlo.parse(hlo_text)
    every = hlo.count_matmul_flops(module, is_expert_matmul).matmul_flops
    recomputed = hlo.count_matmul_flops(module, lambda i: is_expert_matmul(i) and hlo.is_rematerialized(i))
    return {COMPILED[0]: float(every), COMPILED[1]: float(recomputed.matmul_flops)}


def analytic_flops_per_step(config: ml_collections.ConfigDict) -> float:
    """The active experts' matmul FLOPs of one training step: forward, input and weight gradients (3x), each
    token through k experts' gate, up and down (2·H·F_e each) in every MoE layer; 0 without experts."""
    sizes = ModelConfig.from_config(config.model)
    per_token = 3 * 3 * 2 * sizes.hidden_size * sizes.expert_width * sizes.experts_per_token
    return float(tokens_per_step(config) * sizes.moe_layers * per_token)


def row_columns(config: ml_collections.ConfigDict, hlo_text: str | None, row: dict) -> dict[str, object]:
    """The expert FLOP columns of a result row (this module's docstring).

    Args:
      config: the run's config.
      hlo_text: the compiled step's HLO, or None where the compile ran elsewhere (a GPU target's plan, whose child
        process put the compiled columns into `row` already).
      row: the row so far (mesh_devices; the compiled columns of a GPU target's plan).
    """
    if not config.model.num_experts:
        return {**dict.fromkeys(COLUMNS), "expert_flops_note": "not a mixture of experts (model.num_experts = 0)"}
    compiled = compiled_columns(hlo_text) if hlo_text is not None else {k: row.get(k) for k in COMPILED}
    analytic = analytic_flops_per_step(config)
    columns = {**compiled, "analytic_expert_matmul_flops_per_step": analytic}
    if compiled[COMPILED[0]] is None:
        note = "the GPU plan came from a plan cache entry written before these columns; clear it to count them"
        return {**columns, "compiled_to_analytic_expert_flops_ratio": None, "expert_flops_note": note}
    per_device = analytic / (row.get("mesh_devices") or 1)
    ratio = (compiled[COMPILED[0]] - compiled[COMPILED[1]]) / per_device if per_device else None
    return {**columns, "compiled_to_analytic_expert_flops_ratio": ratio, "expert_flops_note": None}

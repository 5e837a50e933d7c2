"""FLOPs of a train step: analytic model and hardware FLOPs, XLA's count (loop-aware), and MFU.

Sources, as named in the result row:
- analytic_*: formulas below, from the config alone (its typed view, jaxscale.config.spec.RunSpec, read once:
  each public function takes a RunSpec or a config and passes the view down).
- compiled_*: the optimized HLO of the compiled step (XLA's cost analysis, and matmul FLOPs counted
  with each while-loop body multiplied by its trip count, see jaxscale.hlo).
- mfu, hfu: analytic FLOPs / measured median step time / peak FLOP/s (jaxscale.peaks).
"""

from __future__ import annotations

import math

import jax
import ml_collections

from jaxscale.config import finetune, remat_policies
from jaxscale.config.spec import ModelConfig, RunSpec
from jaxscale.measure import hlo, params, peaks


# Forward matmuls recomputed in the backward pass, per remat target, derived from what the policy keeps
# (jaxscale.config.remat_policies: `not_recomputed`, the tensors kept on the device or offloaded). A recomputed
# tensor that the backward pass does not read is dropped (dead code): the output projection of Attn and the down
# projection of MLP only feed a dropout and a residual add, whose gradients do not need them, so remat of Attn or
# MLP alone never recomputes them; remat of the whole Block must recompute the attention output (the MLP's
# LayerNorm reads it) unless it is kept. The names: "qkv" the q, k and v projections ("k" llama's k alone, where q
# and v are kept), "logits" the T x T QK^T (the reference attention's backward reads the softmax, so it comes back
# unless kept), "values" the AV einsum (the out projection's weight gradient reads its output, so it comes back
# unless `context` is kept), "out", "up" the up projection (llama: gate and up; "up_only" its up alone, where the
# gate is kept; "gate_only" its gate alone, where the up is kept, as a per-activation policy may). Checked against
# the compiled HLO in tests/measure/test_flops.py.
def recomputed(policy: str, family: str) -> dict[str, tuple[str, ...]]:
    """The forward matmuls each remat target ("Attn", "MLP", "Block") recomputes under `policy` in `family`.

    Args:
      policy: a name of jaxscale.config.remat_policies.POLICIES.
      family: the model family.

    Returns:
      target -> the names of the recomputed matmuls (forward_matmul_flops_per_token's, with "k", "up_only" and
        "gate_only").
    """
    kept = remat_policies.not_recomputed(policy, family)
    attn = _partly_kept(kept, ("q", "k", "v"), "qkv", {"k": "k"})
    attn += tuple(name for name, tensor in (("logits", "logits"), ("values", "context")) if tensor not in kept)
    up = tuple(t for t in ("gate", "up") if t in remat_policies.FAMILY_TENSORS[family])
    mlp = _partly_kept(kept, up, "up", {"up": "up_only", "gate": "gate_only"})
    return {"Attn": attn, "MLP": mlp, "Block": (*attn, *(() if "out" in kept else ("out",)), *mlp)}


def _partly_kept(kept: frozenset[str], tensors: tuple[str, ...], whole: str, parts: dict[str, str]) -> tuple[str, ...]:
    """The recomputed matmul of a group of projections: none when all are kept, `whole` when none is, and
    `parts[t]` when only t is missing (llama's k, or its up without the gate)."""
    missing = tuple(t for t in tensors if t not in kept)
    if not missing:
        return ()
    if missing == tensors:
        return (whole,)
    if len(missing) == 1 and missing[0] in parts:
        return (parts[missing[0]],)
    raise ValueError(f"no FLOP count for keeping {sorted(set(tensors) - set(missing))} of {tensors}")


def param_count(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """Exact parameter count of the config's model family, from the config alone (see params.param_count)."""
    return params.param_count(model)


def non_embedding_params(model: ModelConfig | ml_collections.ConfigDict) -> int:
    """N of the 6N rule: every parameter that takes part in a token's matmuls (all but gather-only embeddings; a
    tied token embedding is the output head's matrix too, so it stays in N; of a mixture of experts' routed
    experts only the k a token goes to: params.active_param_count)."""
    return params.active_param_count(model)


def six_n_flops_per_step(config: RunSpec | ml_collections.ConfigDict) -> float:
    """The 6N rule: 2N forward + 4N backward FLOPs per token (Kaplan et al. 2020), times tokens per step."""
    run = RunSpec.of(config)
    return float(6 * non_embedding_params(run.model) * run.tokens_per_step)


def backward_params(config: RunSpec | ml_collections.ConfigDict) -> tuple[int, int]:
    """(N_through, N_trained): of N (non_embedding_params), the parameters whose matmuls the backward pass
    differentiates with respect to their input (every block the gradient goes through, and the head), and
    those differentiated with respect to themselves (the trained ones, jaxscale.config.finetune). Both are N
    when every parameter trains."""
    run = RunSpec.of(config)
    m, rules = run.model, run.finetune
    gathers = {"pos_emb"} | (set() if m.tie_embeddings else {"embed/embedding"})
    share = _active_share(m)
    table = {k: share(k, math.prod(shape)) for k, (shape, _) in params.param_table(m).items() if k not in gathers}
    trained = sum(n for k, n in table.items() if rules.trainable(k))
    through = sum(n for k, n in table.items() if rules.in_backward(k))
    return through, trained


def _active_share(model: ModelConfig):
    """(path, size) -> the part of a parameter one token multiplies by: k / E of a routed expert's stacked weights
    (jaxscale.model.moe's "mlp/experts/..."), the whole of every other."""
    k, e = model.experts_per_token, model.num_experts

    def share(path: str, size: int) -> int:
        return size // e * k if "/mlp/experts/" in path else size

    return share


def model_flops_per_step(config: RunSpec | ml_collections.ConfigDict, causal: bool = False) -> float:
    """Model FLOPs of one optimizer step (forward + backward), the PaLM / nanoGPT formula.

    flops_per_token = 6·N + 12·L·H·Q·T, where N counts the parameters that take part in a token's matmuls (all but
    the embeddings used only as gathers; a tied token embedding is the output head too, so it counts; of a mixture
    of experts' routed experts the k a token goes to, `non_embedding_params`), L layers, H heads, Q head dim, T
    sequence length. The attention term counts QK^T and AV over the full T×T square;
    `causal=True` halves it (the useful half).

    Fine-tuning (jaxscale.config.finetune) takes the same three parts apart: 2·N forward, 2·N_through for the
    input gradients (every layer the backward pass goes through) and 2·N_trained for the weight gradients
    (`backward_params`); the attention's backward 8·L_through·H·Q·T. With everything trained this is 6·N + 12·L·H·Q·T.
    """
    run = RunSpec.of(config)
    m = run.model
    per_layer = 4 * m.q_width * run.seq_len  # QK^T and AV: 2·(H·Q)·T each per token
    attention = per_layer * (m.num_layers + 2 * run.finetune.backward_blocks)  # backward: twice the forward
    if causal:
        attention /= 2
    through, trained = backward_params(run)
    return float(run.tokens_per_step * (2 * non_embedding_params(m) + 2 * through + 2 * trained + attention))


def forward_matmul_flops_per_token(config: RunSpec | ml_collections.ConfigDict) -> dict[str, float]:
    """Forward matmul FLOPs per token of one layer, by matmul (2 FLOPs per multiply-add), and of the head.

    H hidden, F MLP width, K the K/V width (K/V heads x head_dim; H without grouped-query attention), Q the
    query width (heads x head_dim: H unless model.num_attention_heads), T sequence, V vocabulary. gpt: qkv 2·H·3H,
    up 2·H·F; llama: qkv 2·H·(Q + 2K) (q, k and v), up 2·2·H·F (gate and up). Both: logits (QK^T) 2·T·Q, values
    (AV) 2·T·Q (every query head, whatever K), out 2·Q·H, down 2·F·H; head 2·H·V (tied or not). The attention
    terms cover the full T×T square, as the reference and 'xla' kernels compute it; a causal cuDNN kernel skips
    the masked half, so it gets half of them.

    A mixture of experts' layer (jaxscale.model.moe): up 2·2·H·F_e·k + 2·2·H·F_s and down 2·F_e·H·k +
    2·F_s·H (the k routed experts a token goes to, F_e = model.moe_hidden_size, and the shared experts' F_s =
    num_shared_experts x F_e), and "router" 2·H·E; with model.first_dense_layers, up, down and router are the
    mean over the layers (their sum over all layers is exact). The dispatch's own work (one-hot einsums, sorts)
    and the experts the dense dispatch runs beyond the k are not model FLOPs and are not counted.
    """
    run = RunSpec.of(config)
    m, t = run.model, run.seq_len
    h, f, kv, q = m.hidden_size, m.mlp_width, m.kv_width, m.q_width
    attention = 2 * t * q * (0.5 if m.attention == "cudnn" and m.causal else 1.0)
    llama = m.family == "llama"
    moe_layers, fe = m.moe_layers, m.expert_width
    moe_width = fe * m.experts_per_token + fe * m.num_shared_experts  # per token, through the experts
    mean_width = ((m.num_layers - moe_layers) * f + moe_layers * moe_width) / m.num_layers
    return {
        "qkv": 2 * h * (q + 2 * kv),
        "logits": attention,
        "values": attention,
        "out": 2 * q * h,
        "up": 2 * h * mean_width * (2 if llama else 1),
        "down": 2 * mean_width * h,
        "router": 2 * h * m.num_experts * moe_layers / m.num_layers,
        "head": 2 * h * m.vocab_size,
    }


# The projections of each remat unit (jaxscale.config.finetune.PROJECTIONS' groups; LoRA adapters recompute with
# their unit), and which recomputed forward matmul (`recomputed`'s names) is each projection's output.
_UNIT_PROJECTIONS = {"Attn": finetune.group_projections("attention"), "MLP": finetune.group_projections("mlp")}
_OUTPUT_OF = {"qkv": ("qkv",), "q": ("qkv",), "k": ("qkv", "k"), "v": ("qkv",), "out": ("out",),
              "gate": ("up", "gate_only"), "up": ("up", "up_only"), "down": ()}  # fmt: skip


def _adapter_recompute(run: RunSpec, target: str, names: tuple[str, ...]) -> float:
    """Forward FLOPs per token and layer of the LoRA adapters remat recomputes in `target`: each adapter's x @ A
    (its B's gradient reads it) unless the policy saves dots, and its (x A) @ B where the projection's output is
    recomputed (`names`)."""
    m = run.model
    if not m.lora_rank:
        return 0.0
    sizes = m.projection_sizes
    unit = (*_UNIT_PROJECTIONS["Attn"], *_UNIT_PROJECTIONS["MLP"]) if target == "Block" else _UNIT_PROJECTIONS[target]
    total = 0.0
    for name in finetune.lora_projections(m.family, tuple(m.lora_targets)):
        if name not in unit:
            continue
        if not remat_policies.saves_by_dot_type(m.remat_policy):  # an adapter's x @ A is a dot without batch dims
            total += 2 * m.lora_rank * sizes[name][0]
        if any(n in names for n in _OUTPUT_OF[name]):
            total += 2 * m.lora_rank * sizes[name][1]
    return total


def recompute_flops_per_step(config: RunSpec | ml_collections.ConfigDict) -> float:
    """Forward matmul FLOPs that remat recomputes in the backward pass (see RECOMPUTED).

    Nested remat (Block together with MLP or Attn) counts the Block's recomputation plus the inner
    module's again, as JAX's checkpoint semantics imply; XLA may merge such duplicates (it did for the
    MLP, not for Attn, in JAX 0.10.2), so for nested sets this is an upper bound.

    Fine-tuning: only blocks the backward pass goes through recompute (finetune.backward_blocks); a block whose
    out projection neither trains nor has an adapter does not recompute the attention's AV ("values"), which only
    that projection's weight gradient reads; LoRA adapters recompute as `_adapter_recompute` says.

    The chunked loss (train.loss_chunk_len > 0) runs each chunk's output head under jax.checkpoint, so the backward
    pass recomputes its logits: the head's forward matmul once more, 2·H·V per token (`chunked_loss_recompute`).
    """
    run = RunSpec.of(config)
    m = run.model
    per_token = forward_matmul_flops_per_token(run)
    per_token.update(k=2 * m.hidden_size * m.kv_width, up_only=per_token["up"] / 2)  # llama: up of gate+up
    per_token.update(gate_only=per_token["up_only"])  # llama's gate alone: the same 2·H·F as its up
    policy = recomputed(m.remat_policy, m.family)
    out_adapted = m.lora_rank > 0 and "out" in finetune.lora_projections(m.family, tuple(m.lora_targets))
    total = 0.0
    for layer in range(m.num_layers - run.finetune.backward_blocks, m.num_layers):
        block = "transformer/blocks" if m.scan_layers else f"transformer/block_{layer}"
        trained = run.finetune.trainable(f"{block}/attn/out/kernel")
        for target in m.remat:
            names = tuple(n for n in policy[target] if n != "values" or trained or out_adapted)
            total += sum(per_token[name] for name in names) + _adapter_recompute(run, target, names)
    return float(run.tokens_per_step * total) + chunked_loss_recompute(run)


def chunked_loss_recompute(config: RunSpec | ml_collections.ConfigDict) -> float:
    """FLOPs of the output head the chunked loss recomputes in the backward pass (0 without train.loss_chunk_len).

    Args:
      config: the run's config, or its typed view.

    Returns:
      tokens per step x the head's forward matmul per token (2·H·V): every chunk's logits once more.
    """
    run = RunSpec.of(config)
    if not run.loss_chunk_len:
        return 0.0
    head = forward_matmul_flops_per_token(run)["head"]
    return float(run.tokens_per_step * head)


def hardware_flops_per_step(config: RunSpec | ml_collections.ConfigDict) -> float:
    """Matmul FLOPs the hardware executes: 3 × forward matmuls (forward, input and weight gradients)
    plus the forward matmuls remat recomputes. Biases and LayerNorms are not matmuls and not counted.

    Fine-tuning: the forward once; input gradients (and the attention's backward, twice its forward) in the
    layers the backward pass goes through; weight gradients only of trained kernels (LoRA's adapters, whose
    forward is 2·r·(in + out) per token and projection, train; their frozen kernels do not); the head's
    input gradient always, its weight gradient when finetune.head; remat recomputes as recompute_flops_per_step
    says (the chunked loss's head included). With everything trained this is 3 × forward + recompute.
    """
    run = RunSpec.of(config)
    m, f = run.model, run.finetune
    per_token = forward_matmul_flops_per_token(run)
    kernels = sum(per_token[k] for k in ("qkv", "out", "up", "down", "router"))
    attention, adapters = per_token["logits"] + per_token["values"], 2 * params.adapter_params(m)
    layers, through, mode = m.num_layers, f.backward_blocks, f.mode  # mode: finetune.train with "auto" resolved
    trained_kernel_layers = {"all": layers, "adapters": 0, "last_blocks": f.last_blocks}[mode]
    head_trained = mode == "all" or f.head
    forward = layers * (kernels + attention + adapters) + per_token["head"]
    backward_input = through * (kernels + 2 * attention + adapters) + per_token["head"]
    weights = trained_kernel_layers * kernels + layers * adapters + (per_token["head"] if head_trained else 0)
    return float(run.tokens_per_step * (forward + backward_input + weights) + recompute_flops_per_step(run))


def analytic_columns(config: RunSpec | ml_collections.ConfigDict) -> dict[str, float]:
    """The analytic FLOP columns of a result row (per optimizer step), the config read once (RunSpec.of)."""
    run = RunSpec.of(config)
    return {
        "analytic_6n_flops_per_step": six_n_flops_per_step(run),
        "analytic_model_flops_per_step": model_flops_per_step(run),
        "analytic_model_flops_causal_per_step": model_flops_per_step(run, causal=True),
        "analytic_recompute_flops_per_step": recompute_flops_per_step(run),
        "analytic_hardware_flops_per_step": hardware_flops_per_step(run),
    }


def _xla_flops(compiled: jax.stages.Compiled) -> float | None:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX returned one dict per device
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def compiled_columns(compiled: jax.stages.Compiled, hlo_text: str | None = None) -> dict[str, object]:
    """XLA's FLOP count beside a loop-aware recount of the compiled step's matmuls.

    compiled_xla_flops_per_step is `cost_analysis()["flops"]` as XLA reports it: every while-loop body
    counted once, so a scanned step is under-counted; compiled_xla_flops_lower_bound says when a loop
    makes it one. compiled_matmul_flops_per_step counts each dot with its loops' trip counts (exact for
    matmuls); compiled_xla_flops_corrected_per_step adds to XLA's figure the matmul FLOPs its loops
    missed (non-matmul work inside loops stays counted once, so it is still slightly low).
    """
    text = hlo_text if hlo_text is not None else compiled.as_text()
    count = hlo.count_matmul_flops(hlo.parse(text))
    xla = _xla_flops(compiled)
    missed = count.matmul_flops - count.matmul_flops_once
    return {
        "compiled_xla_flops_per_step": xla,
        "compiled_xla_flops_lower_bound": count.while_loops > 0,
        "compiled_while_loops": count.while_loops,
        "compiled_matmul_loops": count.matmul_loops,
        "compiled_unknown_trip_count_loops": count.unknown_trip_counts,
        "compiled_matmul_flops_per_step": float(count.matmul_flops),
        "compiled_xla_flops_corrected_per_step": None if xla is None else xla + missed,
    }


def utilization_columns(
    row: dict, dtype: str, device: jax.Device | None = None, fp8: bool = False
) -> dict[str, object]:
    """MFU = analytic model FLOP/s / peak FLOP/s, and HFU with hardware FLOPs, from a row's median step.

    With `fp8` (model.fp8 on) also mfu_fp8_peak: the same FLOP/s over the accelerator's FP8 tensor peak (NVIDIA's
    FP8 tables divide so; `mfu` stays over the compute dtype's peak, torchtitan's convention), null on a CPU (no
    FP8 units, no such peak) or where the datasheet gives none.

    On a CPU the peak is this machine's measured matmul roofline (peaks.measured_peak), so there MFU reads
    "fraction of what a large matmul reaches here", not of a datasheet peak. On a mesh of accelerators the
    peak is the mesh's (devices x one device's); simulated CPU devices share the one machine's roofline.
    """
    step_s = row.get("step_s_median")
    device = device or jax.devices()[0]
    peak, source = peaks.resolve_peak(dtype, device)
    devices = row.get("mesh_devices") or 1
    if peak is not None and devices > 1:
        if device.platform == "cpu":  # simulated devices share the cores the roofline was measured on
            source += f"; the whole machine's, shared by the {devices} simulated devices"
        else:  # the step runs on every device of the mesh: its peak is theirs together
            peak, source = peak * devices, f"{devices} x {source}"
    model, hardware = row.get("analytic_model_flops_per_step"), row.get("analytic_hardware_flops_per_step")
    achieved = model / step_s if step_s and model else None
    columns = {
        "peak_flops_per_s": peak,
        "peak_flops_source": source,
        "achieved_model_flops_per_s": achieved,
        "mfu": achieved / peak if achieved and peak else None,
        "hfu": hardware / step_s / peak if step_s and hardware and peak else None,
    }
    if fp8:
        fp8_peak = None if device.platform == "cpu" else peaks.peak_flops(device.device_kind, peaks.FP8)[0]
        fp8_peak = fp8_peak * devices if fp8_peak is not None else None
        columns["mfu_fp8_peak"] = achieved / fp8_peak if achieved and fp8_peak else None
    return columns

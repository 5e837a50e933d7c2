"""Memory figures named by source: analytic estimate, XLA's compiled plan, the device's allocator, the host.

On a device mesh every figure is per device: XLA's plan of a sharded program is one device's, and the
analytic model divides each tensor by the mesh axes that split it (`sharded_param_count`, `Dims.t`).

The analytic estimate reads the config once: `analytic_memory(config)` builds the run's typed view
(jaxscale.config.spec.RunSpec; a caller that built it passes it instead) and every helper below it takes that
view; a layer's activations are jaxscale.measure.layer_memory's, their sizes jaxscale.measure.activation_dims'
(Dims, MoEDims), a mixture of experts' routed terms jaxscale.measure.moe_memory's.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import resource
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections

from jaxscale.config import finetune, layout_rules
from jaxscale.config.defaults import INT8_BLOCK_SIZE, INT8_MIN_SIZE
from jaxscale.config.quantization import ABSMAX_BLOCK_SIZE, NF4_BLOCK_SIZE, absmax_layout
from jaxscale.config.spec import ModelConfig, RunSpec
from jaxscale.measure import host_memory, params
from jaxscale.measure.activation_dims import Dims
from jaxscale.measure.layer_memory import FITTED_TERMS, closed_form_residuals, head_residuals, layer_activation_bytes


def compiled_memory(compiled: jax.stages.Compiled, hlo_text: str | None = None) -> dict[str, int | str | None]:
    """XLA's buffer plan for one call of the compiled step, in bytes, and its host-memory share
    (jaxscale.measure.host_memory.host_columns; `hlo_text`: compiled.as_text(), read here when None).

    compiled_peak_bytes = argument + output - alias + temp: the inputs and outputs live at once except
    where an output reuses a donated input's buffer (alias), plus XLA's scratch for intermediates (temp).
    It is the plan of the backend that compiled it (a CPU plan is only a proxy for a GPU's), and it
    leaves out the runtime's own overheads (allocator fragmentation, CUDA context, preallocation).
    """
    analysis = compiled.memory_analysis()
    host = host_memory.host_columns(analysis, compiled.as_text() if hlo_text is None else hlo_text)
    if analysis is None:
        return {**{f"compiled_{k}_bytes": None for k in ("argument", "output", "temp", "alias", "peak")}, **host}
    row = {
        "compiled_argument_bytes": int(analysis.argument_size_in_bytes),
        "compiled_output_bytes": int(analysis.output_size_in_bytes),
        "compiled_temp_bytes": int(analysis.temp_size_in_bytes),
        "compiled_alias_bytes": int(analysis.alias_size_in_bytes),
    }
    row["compiled_peak_bytes"] = (
        row["compiled_argument_bytes"]
        + row["compiled_output_bytes"]
        - row["compiled_alias_bytes"]
        + row["compiled_temp_bytes"]
    )
    return {**row, **host}


def device_peak_bytes(devices: Sequence[jax.Device] | None = None) -> tuple[int | None, str | None]:
    """The allocator's peak_bytes_in_use (the largest over `devices`, default the first device), or
    (None, why) where the backend keeps no statistics (CPU)."""
    devices = list(devices or jax.local_devices()[:1])
    peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use") for device in devices]
    if any(peak is None for peak in peaks):
        platform = devices[0].platform
        return None, f"not available on the {platform} backend (memory_stats() has no peak_bytes_in_use)"
    return int(max(peaks)), None


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process (getrusage; kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def host_allocator(maps: str | None = None) -> str | None:
    """The malloc this process runs with: "tcmalloc", "jemalloc" or "mimalloc" where its library is mapped into
    the process (LD_PRELOAD), else "glibc" on Linux; None where /proc/self/maps cannot be read (not Linux).

    It matters on a CPU: XLA:CPU allocates its large buffers with malloc, and glibc's malloc serves any
    allocation over its mmap threshold (32 MiB at most) with a fresh mmap that every step faults in again
    (docs/measurements.md, "The CPU's allocator"). `maps`: the text of /proc/self/maps (read when None).
    """
    if maps is None:
        try:
            maps = pathlib.Path("/proc/self/maps").read_text()
        except OSError:
            return None
    libraries = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/" in line}
    for name in _ALLOCATORS:
        if any(library.startswith(f"lib{name}") for library in libraries):
            return name
    return "glibc"


# ---------------------------------------------------------------------------------------------------------
# Analytic estimate: bytes of named tensors, per config (see docs/measurements.md for the derivation); a layer's
# activations are jaxscale.measure.layer_memory's.

STACK_PREFIX = "transformer/blocks/"  # nn.scan's stacked layer parameters in params.param_table's paths
_FLOAT32 = 4  # params, gradients, optimizer state and LayerNorm statistics are float32


def sharded_param_count(
    model: ModelConfig | ml_collections.ConfigDict, fsdp: int = 1, tensor: int = 1, expert: int = 1
) -> int:
    """Parameters one device holds under the default layout (jaxscale.config.layout_rules.RULES, ZeRO-3) on `fsdp`
    (mesh.fsdp x mesh.context), `tensor` and `expert` devices: every embed axis split fsdp x expert ways (the expert
    axis shards the model state as FSDP does) but the stacked experts' and router's (fsdp ways: expert parallelism
    splits their expert axis); heads, K/V heads, MLP width and vocabulary tensor ways. Tests check this count against
    the real shardings for both families and a mixture of experts. `params.param_count`: fsdp = tensor = expert = 1.

    Summed over the family's parameters (params.param_table) with each one's shard shape (params.shard_shape):
    for the GPT (s = fsdp x expert), per layer the four kernels (3H² + H² + 2FH) have both axes, so / (s·tensor);
    the two LayerNorms and the out and down biases (6H) only embed, / s; the QKV and up biases (3H + F) only heads
    or MLP, / tensor; plus the token embedding and output kernel (2VH, both), the positional embedding and final
    LayerNorm (SH + 2H, embed) and the output bias (V, vocabulary). For a Llama every kernel has both axes and the
    RMSNorm scales only embed.
    """
    return _held(params.param_table(model), {"fsdp": fsdp, "tensor": tensor, "expert": expert})


def _held(table: dict[str, tuple[tuple[int, ...], tuple]], sizes: dict, rules: tuple = layout_rules.RULES) -> int:
    """Elements one device holds of the parameters in `table` (path -> (shape, names)), each split by its names under
    the rules table `rules` on a mesh of `sizes` (params.shard_shape)."""
    return sum(math.prod(params.shard_shape(shape, names, sizes, rules)) for shape, names in table.values())


def trained_table(run: RunSpec) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """params.param_table restricted to the parameters that train (jaxscale.config.finetune.FinetuneSpec.trainable)."""
    return {k: v for k, v in params.param_table(run.model).items() if run.finetune.trainable(k)}


def state_tables(run: RunSpec) -> dict[str, tuple]:
    """The rules tables the layout lays out the parameters, the gradients and the optimizer state with at the run's
    mesh.zero_stage (ZeRO, Rajbhandari et al. 2020; jaxscale.config.layout_rules.table): stage 1 splits the state
    and the reduced gradients (layout_rules.gradient_table; accumulated on each device they are whole), 2 the state
    and the (accumulated) gradients, 3 all three, over the state axes (fsdp x context x expert)."""
    stage, split = run.zero_stage, run.sequence_parallel
    return {
        "params": layout_rules.table(stage, split, params=True),
        "grads": layout_rules.gradient_table(stage, split),
        "optimizer": layout_rules.table(stage, split),
    }


def zero_splits(run: RunSpec) -> dict[str, int]:
    """How many ways the state axes (fsdp x context x expert: layout_rules.STATE_AXES) split a parameter's embed axis
    in the parameters, the gradients and the optimizer state (`state_tables`; a mixture of experts' stacked experts
    and router, whose expert axis takes the expert axis, are split fsdp x context ways there)."""
    return {part: math.prod(getattr(run.mesh, axis) for axis in layout_rules.mesh_axes("embed", table))
            for part, table in state_tables(run).items()}  # fmt: skip


def trained_param_count(run: RunSpec, rules: tuple | None = None) -> int:
    """Parameters that train, held by one device (sharded like every parameter, see sharded_param_count), laid out
    with the rules table `rules` (default: the parameters' own, state_tables)."""
    rules = state_tables(run)["params"] if rules is None else rules
    return _held(trained_table(run), run.mesh._asdict(), rules)


def _frozen_itemsize(run: RunSpec) -> int:
    return jnp.dtype(run.finetune.stored_dtype).itemsize


def nf4_kernel_bytes(shape: tuple[int, ...], stacked: int = 0) -> int:
    """Bytes of a kernel of `shape` stored in NF4 (jaxscale.model.nf4; each of its `stacked` leading dims, nn.scan's
    layers, quantized apart): per kernel of n elements in b = ceil(n / 64) blocks, 32·b bytes of codes (4 bits a
    weight) + b absmax codes (8 bits a block) + 4·ceil(b / 256) float32 scales + one float32 offset: about 4.127 bits
    a weight (QLoRA's 0.127 bits of constants)."""
    layers, n = math.prod(shape[:stacked]), math.prod(shape[stacked:])
    blocks = -(-n // NF4_BLOCK_SIZE)
    return layers * (blocks * NF4_BLOCK_SIZE // 2 + blocks + _FLOAT32 * -(-blocks // ABSMAX_BLOCK_SIZE) + _FLOAT32)


def frozen_bytes(run: RunSpec, held: int, trained: int) -> int:
    """Bytes of the frozen parameters on one device that holds `held` parameters of which `trained` train:
    FinetuneSpec.stored_dtype's bytes per frozen one; under finetune.frozen_dtype=nf4 the projection kernels and
    stacked expert weights (FinetuneSpec.nf4_kernel; each layer and expert its own kernel, FinetuneSpec.nf4_stacked)
    at nf4_kernel_bytes instead, whole on every device that holds the kernel (a stacked expert weight's experts split
    over mesh.expert, jaxscale.model.nf4's names; nothing else splits the codes)."""
    rules = run.finetune
    if rules.frozen_dtype != finetune.NF4:
        return _frozen_itemsize(run) * (held - trained)
    kernels = {k: v for k, v in params.param_table(run.model).items() if rules.nf4_kernel(k)}
    quantized = _held(kernels, run.mesh._asdict(), state_tables(run)["params"])
    nf4 = sum(nf4_kernel_bytes(shape, rules.nf4_stacked(k))
              // (run.mesh.expert if "expert" in rules.nf4_stacked_names(k) else 1)
              for k, (shape, _) in kernels.items())  # fmt: skip
    return _frozen_itemsize(run) * (held - trained - quantized) + nf4


def optimizer_state_bytes(run: RunSpec) -> int:
    """Bytes of the optimizer's state on one device, for the parameters that train (T = trained_param_count):
    Adam/AdamW a first moment of `optimizer.state_dtype` and a float32 second moment, (2 or 4) · T + 4 · T; SGD
    its momentum, (2 or 4) · T; Adam/AdamW at state_dtype int8 _int8_adam_state_bytes (about 2 · (1 + 4/2048) · T,
    split like the parameters but for the flat moments of odd shapes); Adafactor 4 × (its factored second moments,
    params.adafactor_state_elements: n/d1 + n/d2 per matrix whose two largest dims are >= 128, n for every other
    parameter, each split like the parameter axes it keeps)."""
    rules = state_tables(run)["optimizer"]
    if run.state_dtype == "int8":
        return _int8_adam_state_bytes(run, rules)
    if run.optimizer == "adafactor":
        table = trained_table(run)
        shapes, names = {k: s for k, (s, _) in table.items()}, {k: n for k, (_, n) in table.items()}
        return _FLOAT32 * params.adafactor_state_elements(shapes, names, run.mesh._asdict(), rules)
    first = jnp.dtype(run.state_dtype).itemsize
    per_param = {"adam": first + _FLOAT32, "adamw": first + _FLOAT32, "sgd": first}[run.optimizer]
    return per_param * trained_param_count(run, rules)


def bf16_buffer_bytes(run: RunSpec) -> int:
    """Bytes one device holds beside bf16 weights (model.param_dtype=bfloat16) for optimizer.bf16_rounding: Kahan's
    bf16 compensation (2 a trained weight) or the float32 master copy (4), laid out like the optimizer state (split
    over the state axes at every ZeRO stage; on the device even where the state is offloaded); 0 otherwise."""
    per_weight = {"kahan": 2, "master": _FLOAT32}.get(run.bf16_rounding, 0)
    return per_weight * trained_param_count(run, state_tables(run)["optimizer"]) if per_weight else 0


def int8_moment_bytes(elements: int, block_size: int = INT8_BLOCK_SIZE) -> int:
    """Bytes of one moment of a tensor of `elements` stored 8-bit (jaxscale.train.quantized_state), whole: a uint8 code
    per element and a float32 absmax per block of `block_size` (the last one partial): n + 4 · ceil(n / block_size)."""
    return elements + _FLOAT32 * -(-elements // block_size)


def int8_moment_shard_bytes(
    shape: tuple[int, ...],
    names: tuple,
    sizes: dict | None = None,
    rules: tuple = layout_rules.RULES,
    block: int = INT8_BLOCK_SIZE,
) -> int:
    """Bytes one device holds of one 8-bit moment of a parameter of `shape` named `names`, on a mesh of `sizes` (mesh
    axis name -> size) under the rules table `rules`: blocked (jaxscale.config.quantization.absmax_layout), the codes
    split like the parameter (params.shard_shape, a byte an element) and the absmax split by its prefix's names (4
    bytes a block); flat, int8_moment_bytes whole (the layout replicates it). `block`: the block size."""
    layout = absmax_layout(shape, names, block)
    if layout is None:
        return int8_moment_bytes(math.prod(shape), block)
    codes = math.prod(params.shard_shape(shape, names, sizes, rules))
    return codes + _FLOAT32 * math.prod(params.shard_shape(*layout, sizes, rules))


def _int8_adam_state_bytes(run: RunSpec, rules: tuple) -> int:
    """Adam's two moments at optimizer.state_dtype=int8 on one device: per trained parameter of at least
    INT8_MIN_SIZE elements 2 · int8_moment_shard_bytes (2 x (1 + 4/2048) bytes per element, split like the
    parameter's optimizer state under the table `rules`: the codes by every name, the absmax by its prefix's); per
    smaller one two float32 moments split like the parameter, 2 · 4 bytes per element it holds."""
    total, sizes = 0, run.mesh._asdict()
    for shape, names in trained_table(run).values():
        if math.prod(shape) >= INT8_MIN_SIZE:
            total += 2 * int8_moment_shard_bytes(shape, names, sizes, rules)
        else:
            total += 2 * _FLOAT32 * math.prod(params.shard_shape(shape, names, sizes, rules))
    return total


def _gathered_layer_bytes(run: RunSpec, gradient_only: bool = False) -> int:
    """Under FSDP, one block's parameters gathered whole over the state axes (/ tensor, a mixture of experts' experts
    / expert: layout_rules.gathered_table) with their full gradients before the reduce-scatter: 4 + 4 bytes per
    trained parameter, the frozen dtype's per frozen one (no gradient); `gradient_only` (ZeRO-2, whose weights are
    whole already): 4 bytes per trained parameter. A parameter with an embed axis the state axes leave whole is used
    where it lies (the stacked experts under expert parallelism without fsdp), not counted. The top block is the one
    counted (with finetune.train=last_blocks it trains)."""
    m, rules, sizes = run.model, run.finetune, run.mesh._asdict()
    block = "transformer/blocks" if m.scan_layers else f"transformer/block_{m.num_layers - 1}"
    split = state_tables(run)["grads" if gradient_only else "params"]
    total = 0
    for key, (shape, names) in params.layer_param_table(m).items():
        whole = params.shard_shape(shape, names, sizes, layout_rules.gathered_table(run.sequence_parallel))
        if "embed" in names and params.shard_shape(shape, names, sizes, split) == whole:
            continue
        trains = rules.trainable(f"{block}/{key}")
        gathered = not (gradient_only or rules.nf4_kernel(f"{block}/{key}"))  # NF4: whole already
        weight = _weight_itemsize(run)
        per = (1 if gradient_only else 2) * weight if trains else _frozen_itemsize(run) if gathered else 0
        total += per * math.prod(whole)
    return total


def _weight_itemsize(run: RunSpec) -> int:
    """Bytes of a trained weight and of its gradient (the backward pass gives it in the weight's dtype): 4 for
    float32 weights, 2 for bf16 ones without a master copy (model.param_dtype, jaxscale.train.bf16_weights)."""
    return jnp.dtype(run.model.param_dtype).itemsize


def in_backward_grads_bytes(run: RunSpec) -> int:
    """Gradient bytes alive at once in the step that updates each layer inside the backward pass (optimizer.in_backward,
    jaxscale.train.fused_step; one device, every parameter trained): the largest of three phases, never the whole
    model's gradient.

    - the head's (output projection and final norm) gradients, in the weights' dtype, before their update;
    - one layer's: its gradient in the weights' dtype, the optimizer's float32 update of it and the new float32
      moments (Adam's two, SGD's one momentum; none at state_dtype int8, whose update runs over 4M-element chunks)
      computed whole before they are written back into the stacked state (the compiled plans' temporaries);
    - the embedding's (token table, GPT's positions) at the end.
    A tied table's head share of its gradient waits through the layers' phase for the embedding's update."""
    table = params.param_shapes(run.model)

    def size(*prefixes: str) -> int:
        return sum(math.prod(shape) for path, shape in table.items() if path.startswith(prefixes))

    layer = sum(math.prod(shape) for shape, _ in params.layer_param_table(run.model).values())
    weight = _weight_itemsize(run)
    moments = 0 if run.state_dtype == "int8" else {"adam": 2, "adamw": 2, "sgd": 1}.get(run.optimizer, 2)
    tied = weight * size("embed/") if run.model.tie_embeddings else 0
    head = weight * size("output/", "post_norm/") + tied
    one_layer = layer * (weight + 4 + 4 * moments) + tied
    return max(head, one_layer, weight * size("embed/", "pos_emb"))


def in_backward_accumulation_count(run: RunSpec, rules: tuple) -> int:
    """Gradient elements one device makes besides the accumulator when each scanned layer's gradient is added into
    it inside the backward pass (jaxscale.train.backward_accumulation; RunSpec.accumulates_in_backward): one layer's
    (its share of the stacked gradient, laid out with `rules`) and the parameters' outside the layer stack, made
    whole and then added (an unchunked head's; the chunked head's is added into the accumulator chunk by chunk, each
    chunk's gradient whole before its add), but for an untied token table's, whose scatter-add XLA folds into the
    accumulator (the compiled plans)."""
    table = trained_table(run)
    stacked = {k: v for k, v in table.items() if k.startswith(STACK_PREFIX)}
    folded = set() if run.model.tie_embeddings else {"embed/embedding"}
    outside = {k: v for k, v in table.items() if k not in stacked and k not in folded}
    sizes = run.mesh._asdict()
    return _held(outside, sizes, rules) + _held(stacked, sizes, rules) // run.model.num_layers


def _total(terms: dict[str, int]) -> int:
    return sum(terms.values())


def analytic_memory(config: RunSpec | ml_collections.ConfigDict) -> dict[str, int]:
    """Analytic peak memory of one train step on one device, in bytes, broken down for the result row.

    Peak = params + gradients + optimizer state + activations, at the start of the (last minibatch's)
    backward pass, when every layer's saved activations are alive:
      params: 4·N (float32; 2·N for bf16 weights, model.param_dtype, whose gradients are bf16 too and whose
        buffers, bf16_buffer_bytes, count with the optimizer state: Kahan's 2, a float32 master copy's 4 a weight,
        split like the state), N the
        parameters this device holds (sharded_param_count: all of them on one
        device or under pure data parallelism; ZeRO-3 / FSDP divides by the state axes mesh.fsdp x mesh.context x
        mesh.expert, Rajbhandari et al. 2020; tensor parallelism divides the split matrices by mesh.tensor, Shoeybi
        et al. 2019; expert parallelism a mixture of experts' experts and router by mesh.expert, Lepikhin et al.
        2020, their embed axis then by fsdp x context only). Below ZeRO stage 3 the parameters are whole on the
        state axes (state_tables, zero_splits). The gradients and the optimizer state are split over expert as
        their parameters are.
      optimizer: optimizer_state_bytes (Adam 2 × 4·N; Adafactor factored; split over the state axes at every
        ZeRO stage; Adam's 8-bit moments at state_dtype int8 about 2 × (1 + 4/2048)·N, split alike).
      grads: 4·N for the minibatch's gradients, plus 4·N for the accumulator when num_minibatches > 1 (with
        optimizer.in_backward one layer's at a time instead: in_backward_grads_bytes; accumulated inside the
        backward pass, the minibatch's only outside the layer stack and one layer's: in_backward_accumulation_count)
        (scanned layers write their gradients into a stacked buffer allocated before the backward loop);
        split like the optimizer state at every ZeRO stage (the step constrains them so: reduce-scatters), and
        whole where the step accumulates them on each device (accumulates_locally).
      activations: L × per-layer bytes (layer_activation_bytes) + one recomputed unit + head_residuals (with a
        pipeline of p stages, m microbatches and v visits: L x (v·m + p - 1)/(p·v·m) layers' and 1/p of the head's,
        and with v > 1 the stack's weights and their gradients in the stage-major layout, 2 x their bytes),
        for the minibatch's share of this device (/ data·fsdp·expert, and the sequence / context) with
        tensor-parallel terms split (Dims.t), and every term under sequence parallelism (Dims.sp);
        with accumulate='loop' every minibatch's activations, as both XLA backends schedule the unrolled
        minibatches' forward passes together (measured; see docs/measurements.md). Under FSDP (the state axes
        splitting the parameters: fsdp, context or expert) one layer's parameters are gathered whole (/ tensor) at
        a time, with their full gradient before it is reduce-scattered: 2 × 4 × its parameters
        (analytic_fsdp_gather_bytes, in the activations; at ZeRO stage 2 its whole gradient only, 4 ×).
    Host offload (jaxscale.train.offload): the optimizer state (optimizer.offload_state) and the trained parameters'
    4 bytes each (train.offload_params) are analytic_host_offload_bytes, in host memory and left out of the peak (the
    device never holds offloaded parameters whole: its kernels read them from host memory in place, as the compiled
    plans show; their compute-dtype casts stay in the activations' kernel_casts).
    Fine-tuning (jaxscale.config.finetune): params are 4 bytes per trained parameter plus
    finetune.frozen_dtype's bytes per frozen one (frozen_bytes: under nf4 the projection kernels' 4-bit codes and
    constants, the rest bfloat16); gradients and optimizer state are the trained parameters'
    only; with finetune.train=last_blocks only the blocks the backward pass goes through keep activations
    (finetune.backward_blocks). Otherwise the activations are full training's: an upper bound, as a frozen
    projection's input is kept only where something below it still needs it.

    `config`: the run config, read once into its typed view (jaxscale.config.spec.RunSpec.of), which every helper
    below takes; or that view, where the caller built it.
    """
    run = RunSpec.of(config)
    m, splits, tables = run.model, zero_splits(run), state_tables(run)
    d, n = Dims.from_spec(run), _held(params.param_table(m), run.mesh._asdict(), tables["params"])
    trained = trained_param_count(run)
    layer, working = layer_activation_bytes(d, tuple(m.remat), m.remat_policy, m.scan_layers)
    causal_mask = m.scan_layers and m.causal and m.attention == "reference"
    # Blocks below the backward pass's lowest (finetune.train=last_blocks) keep nothing for it. A mixture of experts'
    # first_dense_layers (the bottom blocks) keep a dense layer's activations.
    blocks = run.finetune.backward_blocks
    dense_blocks = max(0, blocks - m.moe_layers) if d.moe else 0
    if dense_blocks:
        dense = layer_activation_bytes(dataclasses.replace(d, moe=None), tuple(m.remat), m.remat_policy, m.scan_layers)
        working = max(working, dense[1])
    per_minibatch = (blocks - dense_blocks) * layer + dense_blocks * (dense[0] if dense_blocks else 0)
    head = sum(head_residuals(d, causal_mask).values())
    relayout = 0
    if run.mesh.stage > 1:  # a pipeline (jaxscale.model.pipeline): a stage keeps its L/(p·v) layers' residuals of one
        # microbatch (1/m of the minibatch) in each of the loop's v·m + p - 1 iterations; the head runs on 1/p of the
        # positions
        p, m_, v = run.mesh.stage, run.pipeline_microbatches, run.pipeline_repeats
        per_minibatch = per_minibatch * (v * m_ + p - 1) // (p * v * m_)
        head //= p
        if v > 1:  # circular: the stack's weights in the stage-major layout (an all-to-all's copy of the device's
            # share) and, in the backward pass, their gradients in it before they move back (jaxscale.model.pipeline)
            stack = {k: shape for k, shape in trained_table(run).items() if k.startswith(STACK_PREFIX)}
            relayout = 2 * _weight_itemsize(run) * _held(stack, run.mesh._asdict(), tables["params"])
    per_minibatch += head
    live = run.num_minibatches if run.accumulate == "loop" else 1
    # Under FSDP one layer's weights are gathered whole with their whole gradient (_gathered_layer_bytes, 4 + 4
    # bytes a trained parameter); at ZeRO stage 2 the weights are whole already and only one layer's whole
    # gradient lives before its reduce-scatter (4 bytes). The minibatch's gradients and their accumulator are
    # split at every stage (XLA reduce-scatters each layer's inside the backward loop, as the compiled plans
    # show). Accumulated on each device (RunSpec.accumulates_locally: data parallel and ZeRO-1/2 with several
    # minibatches) both are whole, reduced once after the last minibatch.
    local = run.accumulates_locally
    gather = _gathered_layer_bytes(run) if splits["params"] > 1 else 0
    if splits["params"] == 1 < splits["grads"] and not local:
        gather = _gathered_layer_bytes(run, gradient_only=True)
    weight = _weight_itemsize(run)
    minibatch_grads = weight * trained_param_count(run, tables["params" if local else "grads"])
    accumulator = minibatch_grads if run.num_minibatches > 1 else 0
    if run.accumulates_in_backward:  # the stacked layers' gradients go into the accumulator a layer at a time
        minibatch_grads = weight * in_backward_accumulation_count(run, tables["params" if local else "grads"])
    if run.in_backward:  # no whole gradient: one phase's at a time (one device, one minibatch: validation)
        minibatch_grads = in_backward_grads_bytes(run)
    row = {
        "analytic_params_bytes": weight * trained + frozen_bytes(run, n, trained),
        "analytic_grads_bytes": minibatch_grads + accumulator,
        # optimizer state, and the bf16 weights' buffers (Kahan's compensation, the float32 master copy)
        "analytic_optimizer_bytes": optimizer_state_bytes(run) + bf16_buffer_bytes(run),
        "analytic_activation_bytes": live * per_minibatch + working + gather + relayout,
        "analytic_activation_per_layer_bytes": layer,
        # what one layer's backward pass reads (closed_form_residuals), whatever the layer keeps: the docs' yardstick
        "analytic_closed_form_per_layer_bytes": sum(map(_total, closed_form_residuals(d).values())),
        "analytic_fsdp_gather_bytes": gather,
    }
    # Host offload (jaxscale.train.offload): the offloaded parts live in host memory, out of the device's peak.
    row["analytic_host_offload_bytes"] = (optimizer_state_bytes(run) * run.offload_state
                                          + weight * trained * run.offload_params)  # fmt: skip
    row["analytic_peak_bytes"] = sum(row[f"analytic_{k}_bytes"] for k in ("params", "grads", "optimizer", "activation"))
    row["analytic_peak_bytes"] -= row["analytic_host_offload_bytes"]
    return row


def analytic_columns(config: RunSpec | ml_collections.ConfigDict, compiled_peak_bytes: int | None) -> dict[str, object]:
    """The analytic breakdown (analytic_memory of the config or its typed view), the names of its fitted terms
    (analytic_fitted_terms: FITTED_TERMS joined by commas), and compiled_to_analytic_peak_ratio (compiled plan /
    analytic estimate)."""
    row: dict[str, object] = dict(analytic_memory(config))
    row["analytic_fitted_terms"] = ",".join(FITTED_TERMS)
    peak = row["analytic_peak_bytes"]
    row["compiled_to_analytic_peak_ratio"] = compiled_peak_bytes / peak if compiled_peak_bytes and peak else None
    return row

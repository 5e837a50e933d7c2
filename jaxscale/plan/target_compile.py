"""Compiles the train step for a GPU target without a GPU: the one compile behind `jaxscale.plan.gpu_plan`.

`compile_for_target` runs in a child process (`python -m jaxscale.plan.target_compile RESULT.json` with a
pickled {"config", "target_config_text", "devices", "gemm"} on stdin and `JAX_PLATFORMS=cpu` in the
environment; it writes the compiled plan as JSON to RESULT.json), which run and sweep use because a
malformed target config can kill the compiling process with a signal (SIGFPE); or in the caller's process
(`gpu_plan.plan_for_target(..., in_process=True)`, the fit planner's many compiles). Either way XLA's logs
(its rematerialization warning among them) go to the compiling process's stderr, where the caller reads
them; the GEMM mode is a compile option (GEMM_OPTIONS). A plan already in the plan cache
(jaxscale.compile_cache; written here after each compile, with XLA's warnings) is not compiled again: its
stored stderr is written to stderr, as the compile wrote it, and the result says compile_cache_hit.

For several GPUs (the config's mesh on `devices` of them) the CUDA topology "<slices>x<hosts>x<devices>"
(`targets.topology`) gives that many compile-only devices; the step is the run's sharded step
(`jaxscale.train.sharding`), and XLA's plan is one device's.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import pathlib
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
from absl import flags
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale import compile_cache, train
from jaxscale.cli import Usage, fail, print_help, wants_help
from jaxscale.config import RunSpec, mesh_shape
from jaxscale.measure import collectives, expert_flops, kernels, layer_loop, memory
from jaxscale.measure.activation_dims import MoEDims
from jaxscale.plan import targets
from jaxscale.train import offload, sharding
from jaxscale.train.step import param_columns

# The GEMM choice of a deviceless compile, as compile options (`lowered.compile(compiler_options=...)`): without
# a device XLA cannot autotune GEMMs and takes Triton kernels where it can; on a real GPU the autotuner may
# pick cuBLAS instead. The plans differ, so planning compiles both (jaxscale.plan.gpu_plan).
GEMM_OPTIONS: dict[str, dict[str, bool]] = {
    "triton": {"xla_gpu_enable_triton_gemm": True},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
}

USAGE = Usage(
    command="python -m jaxscale.plan.target_compile RESULT.json < REQUEST.pickle",
    summary="The child process of GPU planning (jaxscale.plan.gpu_plan starts it; run `python -m jaxscale.run "
    "--plan --target a5000` instead). Reads a pickled {'config': ConfigDict, 'target_config_text': str} from stdin, "
    "compiles the train step for that GPU target without a GPU (JAX_PLATFORMS=cpu, the gpu-plan extra) and "
    "writes XLA's memory plan as JSON to RESULT.json; XLA's warnings go to stderr.",
    examples=(
        "python -m jaxscale.plan.target_compile /tmp/plan.json < /tmp/request.pickle",
        "python -m jaxscale.run --config configs/bf16_remat.py:seed --plan --target a5000   # starts it for you",
    ),
)


def target_sharding(target_config_text: str) -> NamedSharding:
    """A replicated sharding on the one compile-only device of the target (a 1x1x1 CUDA topology)."""
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config_text, topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("device",))
    return NamedSharding(mesh, PartitionSpec())


def abstract_inputs(config: ml_collections.ConfigDict, sharding: NamedSharding) -> tuple[Any, Any, Any]:
    """(state, metrics, batch) of the run's train step as ShapeDtypeStructs placed on `sharding`.

    Every leaf carries the sharding, so the step compiles for the target's device; nothing is allocated.
    """

    def place(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)

    return place(train.abstract_inputs(config))


def sharded_inputs(
    config: ml_collections.ConfigDict, target_config_text: str, devices: int
) -> tuple[Any, tuple[Any, Any, Any], jax.Device]:
    """(the sharded step, its abstract inputs, one device) for the config's mesh on `devices` target GPUs."""
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config_text, topology=targets.topology(devices)
    )
    mesh = sharding.make_mesh(config, topology.devices)
    init_fn = train.make_init_fn(config)
    layout = sharding.make_layout(config, mesh, init_fn)
    return sharding.make_step(config, layout), sharding.abstract_inputs(config, layout, init_fn), topology.devices[0]


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collects what this process writes to file descriptor 2 (XLA's C++ warnings included) inside the block.

    Yields a list that holds the captured text once the block has ended.
    """
    sys.stderr.flush()
    captured: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def _emit(stderr: str) -> None:
    """Writes XLA's warnings to file descriptor 2, as the compile wrote them: the caller reads them from there
    (the parent from the child's stderr, compile_in_process from its fd-2 capture), whatever sys.stderr is
    (a notebook's or pytest's replaces it)."""
    sys.stderr.flush()
    data = stderr.encode()
    while data:
        data = data[os.write(2, data) :]


def compile_for_target(
    config: ml_collections.ConfigDict,
    target_config_text: str,
    devices: int = 1,
    gemm: str | None = None,
    hlo_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Lowers and compiles the run's train step (same accumulation, remat, scan, mesh) for the target, or reads
    the plan from the plan cache; the one compile of GPU planning, in a child process or in the caller's.

    XLA's warnings (its rematerialization warning among them) go to this process's stderr either way: a
    compile's are captured, stored with the plan, and written again; a cached plan's are written as stored.

    Args:
      config: a validated run config.
      target_config_text: an XLA GpuTargetConfig text proto (see jaxscale.targets).
      devices: target GPUs; the config's mesh must use them all (a 1x1x1 mesh compiles for one).
      gemm: "triton" or "cublas" (GEMM_OPTIONS, as compile options of this compile), or None for XLA's
        default (XLA_FLAGS decides).
      hlo_path: where to keep the compiled program's HLO text, gzipped (what XLA will run on the GPU, the
        dtype of every collective included); None keeps none. The plan cache keeps it too, for a hit.
    Returns:
      compiled_{argument,output,temp,alias,peak}_bytes of XLA's GPU plan (one device's), the
      compiled_collective_* columns of its HLO, compile_s (lower + compile, or lower + cache read on a hit,
      seconds), params, the device_kind the compile-only device reports, the topology compiled for,
      plan_key, compile_cache_hit (None: cache off), compile_cache_saved_s, and `kernels`: the kernels the
      program launches (jaxscale.measure.kernels, as dicts) for the time prediction.
    """
    if mesh_shape(config).devices == 1 and not offload.parts(config):  # offload: the layout's step (1x1x1 mesh)
        target = target_sharding(target_config_text)
        step, inputs, device = (
            train.make_train_step(config),
            abstract_inputs(config, target),
            target.mesh.devices.flat[0],
        )
        devices = 1
    else:
        step, inputs, device = sharded_inputs(config, target_config_text, devices)
    options = GEMM_OPTIONS[gemm] if gemm else None
    start = time.perf_counter()
    lowered = step.lower(*inputs)
    key = compile_cache.plan_key(
        lowered.as_text(), target_config_text, os.environ.get("XLA_FLAGS", ""), targets.topology(devices), options
    )
    cached = compile_cache.read_plan(key)
    if cached is not None and hlo_path is not None:
        try:
            pathlib.Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(compile_cache.plan_hlo_path(key), hlo_path)
        except OSError:  # an entry kept without its program: compile again
            cached = None
    if cached is not None:
        _emit(cached["stderr"])
        seconds = time.perf_counter() - start
        saved = max(0.0, cached["result"]["compile_s"] - seconds)
        result = {**cached["result"], "compile_s": seconds, "compile_cache_hit": True, "compile_cache_saved_s": saved}
        missing = "compiled_scan_saved_bytes" not in result or (
            RunSpec.of(config).mesh.stage > 1 and "compiled_pipeline_iterations" not in result)
        if missing:  # an entry written before the column was
            try:
                with gzip.open(compile_cache.plan_hlo_path(key), "rt") as handle:
                    result.update(_loop_columns(handle.read(), config))
            except OSError:  # kept without its program
                result["compiled_scan_saved_bytes"] = None
        return result
    with captured_stderr() as stderr:
        compiled = lowered.compile(compiler_options=options)
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    result = {
        **memory.compiled_memory(compiled, text),
        **collectives.collective_columns(text),
        **expert_flops.compiled_columns(text),
        **_loop_columns(text, config),
        "compile_s": seconds,
        **param_columns(inputs[0]),
        "device_kind": device.device_kind,
        "plan_topology": targets.topology(devices),
        "plan_key": key,
        "kernels": kernels.as_dicts(kernels.kernels(text)),
    }
    if hlo_path is not None:
        _write_gzipped(text, pathlib.Path(hlo_path))
    if compile_cache.enabled():
        _write_gzipped(text, compile_cache.plan_hlo_path(key))
    compile_cache.write_plan(key, result, stderr[0])  # the plan and XLA's warnings, for the next compile
    _emit(stderr[0])
    return {**result, "compile_cache_hit": False if compile_cache.enabled() else None, "compile_cache_saved_s": None}


def _loop_columns(text: str, config: ml_collections.ConfigDict) -> dict[str, int | None]:
    """compiled_scan_saved_bytes: what the scanned layers' forward loop writes out for the backward pass, one device's
    (jaxscale.measure.layer_loop; None with unrolled layers, and with a pipeline, whose loop is over its iterations);
    with a pipeline, compiled_pipeline_iterations: that loop's trip count (layer_loop.pipeline_iterations)."""
    run = RunSpec.of(config)
    if run.mesh.stage > 1:  # a pipeline's loop keeps its iterations' residuals: not the layer loop's shape
        return {"compiled_scan_saved_bytes": None, "compiled_pipeline_iterations": layer_loop.pipeline_iterations(text)}
    if not run.model.scan_layers:
        return {"compiled_scan_saved_bytes": None}
    seq, moe = run.seq_len // run.mesh.context, MoEDims.from_spec(run)
    # a mixture of experts' slot tensors [B, E, C, ...], where a device holds every expert (the memory model's sizes)
    slots = (moe.e, moe.c) if moe and moe.dispatch in ("capacity", "scatter") and moe.ep == 1 else None
    return {"compiled_scan_saved_bytes": layer_loop.saved_bytes(text, run.model.num_layers, run.minibatch_per_device,
                                                                seq, slots)}  # fmt: skip


def _write_gzipped(text: str, path: pathlib.Path) -> None:
    """The text gzipped at `path`, written whole or not at all (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    with gzip.open(partial, "wt") as handle:
        handle.write(text)
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    """Child entry point: pickled request on stdin, JSON result to argv[1]."""
    if wants_help(argv):
        return print_help(USAGE, flags.FlagValues())  # no flags: one argument and stdin
    if len(argv) != 2 or sys.stdin.isatty():
        return fail("give RESULT.json and a pickled request on stdin; see --help (this is planning's child process)")
    try:
        request = pickle.loads(sys.stdin.buffer.read())
    except Exception as error:  # noqa: BLE001 - any unreadable request is bad input
        return fail(f"stdin: not a pickled planning request ({type(error).__name__}); see --help")
    # JAX's own cache cannot load a deviceless executable back (see jaxscale.compile_cache): not used here.
    jax.config.update("jax_enable_compilation_cache", False)
    result = compile_for_target(
        request["config"],
        request["target_config_text"],
        request.get("devices", 1),
        request.get("gemm"),
        request.get("hlo_path"),
    )
    with open(argv[1], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Compiles the train step for a GPU target without a GPU: the child process behind `jaxscale.gpu_plan`.

Run as `python -m jaxscale.plan.target_compile RESULT.json` with a pickled {"config", "target_config_text"} on
stdin and `JAX_PLATFORMS=cpu` in the environment; it writes the compiled plan as JSON to RESULT.json. XLA
logs (its rematerialization warning among them) go to this process's stderr, which the parent reads.
It runs in its own process because a malformed target config can kill it with a signal (SIGFPE).
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from typing import Any

import jax
import ml_collections
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale import train
from jaxscale.measure import memory
from jaxscale.model import count_params


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


def compile_for_target(
    config: ml_collections.ConfigDict, target_config_text: str, compiler_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Lowers and compiles the run's train step (same accumulation, remat, scan) for the target.

    Args:
      config: a validated run config.
      target_config_text: an XLA GpuTargetConfig text proto (see jaxscale.targets).
      compiler_options: XLA options of this compile (e.g. gpu_plan.GEMM_OPTIONS["cublas"]).
    Returns:
      compiled_{argument,output,temp,alias,peak}_bytes of XLA's GPU plan, compile_s (lower + compile,
      seconds), params and the device_kind the compile-only device reports.
    """
    sharding = target_sharding(target_config_text)
    state, metrics, batch = abstract_inputs(config, sharding)
    start = time.perf_counter()
    compiled = train.make_train_step(config).lower(state, metrics, batch).compile(compiler_options=compiler_options)
    seconds = time.perf_counter() - start
    return {
        **memory.compiled_memory(compiled),
        "compile_s": seconds,
        "params": count_params(state.params),
        "device_kind": next(iter(sharding.mesh.devices.flat)).device_kind,
    }


def main(argv: list[str]) -> int:
    """Child entry point: pickled request on stdin, JSON result to argv[1]."""
    request = pickle.loads(sys.stdin.buffer.read())
    result = compile_for_target(request["config"], request["target_config_text"])
    with open(argv[1], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

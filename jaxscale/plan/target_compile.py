"""Compiles the train step for a GPU target without a GPU: the child process behind `jaxscale.gpu_plan`.

Run as `python -m jaxscale.plan.target_compile RESULT.json` with a pickled {"config", "target_config_text",
"devices"} on stdin and `JAX_PLATFORMS=cpu` in the environment; it writes the compiled plan as JSON to
RESULT.json. XLA logs (its rematerialization warning among them) go to this process's stderr, which the
parent reads. It runs in its own process because a malformed target config can kill it with a signal (SIGFPE).

For several GPUs (the config's mesh on `devices` of them) the CUDA topology "<slices>x<hosts>x<devices>"
(`targets.topology`) gives that many compile-only devices; the step is the run's sharded step
(`jaxscale.train.sharding`), and XLA's plan is one device's.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import time
from typing import Any

import jax
import ml_collections
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale import train
from jaxscale.config import mesh_shape
from jaxscale.measure import collectives, memory
from jaxscale.model import count_params
from jaxscale.plan import targets
from jaxscale.train import sharding


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


def compile_for_target(config: ml_collections.ConfigDict, target_config_text: str, devices: int = 1) -> dict[str, Any]:
    """Lowers and compiles the run's train step (same accumulation, remat, scan, mesh) for the target.

    Args:
      config: a validated run config.
      target_config_text: an XLA GpuTargetConfig text proto (see jaxscale.targets).
      devices: target GPUs; the config's mesh must use them all (a 1x1x1 mesh compiles for one).
    Returns:
      compiled_{argument,output,temp,alias,peak}_bytes of XLA's GPU plan (one device's), the
      compiled_collective_* columns of its HLO, compile_s (lower + compile, seconds), params, the
      device_kind the compile-only device reports and the topology compiled for.
    """
    if math.prod(mesh_shape(config)) == 1:
        target = target_sharding(target_config_text)
        step, inputs, device = (
            train.make_train_step(config),
            abstract_inputs(config, target),
            target.mesh.devices.flat[0],
        )
        devices = 1
    else:
        step, inputs, device = sharded_inputs(config, target_config_text, devices)
    start = time.perf_counter()
    compiled = step.lower(*inputs).compile()
    seconds = time.perf_counter() - start
    return {
        **memory.compiled_memory(compiled),
        **collectives.collective_columns(compiled.as_text()),
        "compile_s": seconds,
        "params": count_params(inputs[0].params),
        "device_kind": device.device_kind,
        "plan_topology": targets.topology(devices),
    }


def main(argv: list[str]) -> int:
    """Child entry point: pickled request on stdin, JSON result to argv[1]."""
    request = pickle.loads(sys.stdin.buffer.read())
    result = compile_for_target(request["config"], request["target_config_text"], request.get("devices", 1))
    with open(argv[1], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Which GPU paths keep `jax.lax.ragged_dot` grouped: deviceless H100 compiles of each, and the FLOPs they execute.

    python experiments/ragged_dot_paths.py                        # all trials, a few minutes on 2 cores
    python experiments/ragged_dot_paths.py --only bare            # the bare ragged_dot trials alone
    python experiments/ragged_dot_paths.py --out DIR              # default experiments/results/ragged_dot_paths_h100

Needs the gpu-plan extra (jax-cuda12-plugin, ptxas). Each trial compiles in its own child process with
JAX_PLATFORMS=cpu (an XLA CHECK failure aborts the process that compiles), for the lab's h100 target
(jaxscale.plan.targets), and prints one line: the path, whether it compiled (else the error's first line), the
expert-matmul kernels of the compiled program, and the FLOPs they execute against the active experts' FLOPs.
Writes trials.json (every field) and trials.md (the table) to --out.

Trials:
- bare: `jax.lax.ragged_dot` [M, H] x [E, H, F] (OLMoE's layer: M = 2048 tokens x k 8 rows, H 2048, F 1024,
  E 64, bf16) under jax.grad (forward, input and weight gradients: 3 x 2·M·H·F active FLOPs), under
  - xla / xla-cublas: XLA's defaults, with Triton GEMMs on (the deviceless default) or off;
  - cudnn-fusion: XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true, the target's cuDNN 9.8 (the
    lab's targets), then 9.28 (above XLA's kMinCudnnVersionForRaggedDotFusion), then 9.28 with cuDNN's wheels
    importable (--cudnn_site DIR, a `pip install --target DIR nvidia-cudnn-cu12 nvidia-cuda-runtime-cu12`);
  - hipblaslt-grouped: --xla_gpu_experimental_use_ragged_dot_grouped_gemm=true (XLA takes it on ROCm only);
  - jax-pallas-triton: jax_ragged_dot_use_gpu_pallas_triton_lowering=True (JAX's own switch);
  - pallas-mosaic-gpu: jax.experimental.pallas.ops.gpu.ragged_dot_mgpu (forward and input gradient) and
    transposed_ragged_dot_mgpu (weight gradient) under a custom VJP written here (the kernels ship without one);
    the weight gradient's kernel reads `jax.devices()[0].core_count` (the GPU's SMs) while tracing, so a second
    trial gives it the H100's 132 SMs.
- model: the train step of tiny-moe and of OLMoE's layer (experiments/moe_dispatch.py:olmoe-1b-7b with one
  layer and one sequence of 2048), each dispatch, and ragged under the cuDNN flag, planned for h100 with cuBLAS
  GEMMs; the FLOPs are the row's expert columns (jaxscale.measure.expert_flops).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "results" / "ragged_dot_paths_h100"
FUSION = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
# (name, XLA_FLAGS, target cuDNN version, cuDNN wheels importable, what it computes)
BARE = (
    ("xla", "", None, False, "lax"),
    ("xla-cublas", "--xla_gpu_enable_triton_gemm=false", None, False, "lax"),
    ("cudnn-fusion (target cuDNN 9.8)", FUSION, None, False, "lax"),
    ("cudnn-fusion (target cuDNN 9.28)", FUSION, (9, 28, 0), False, "lax"),
    ("cudnn-fusion (cuDNN 9.28 wheels)", FUSION, (9, 28, 0), True, "lax"),
    ("hipblaslt-grouped", "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true", None, False, "lax"),
    ("jax-pallas-triton", "", None, False, "pallas_flag"),
    ("pallas-mosaic-gpu", "", None, False, "mgpu"),
    ("pallas-mosaic-gpu (SM count given)", "", None, False, "mgpu_sms"),
)
MODEL = (
    ("tiny-moe", "ragged", ""), ("tiny-moe", "dense", ""), ("tiny-moe", "capacity", ""), ("tiny-moe", "ragged", FUSION),
    ("olmoe-layer", "ragged", ""), ("olmoe-layer", "dense", ""), ("olmoe-layer", "capacity", ""),
    ("olmoe-layer", "ragged", FUSION),
)  # fmt: skip
TOKENS, K, HIDDEN, WIDTH, EXPERTS = 2048, 8, 2048, 1024, 64  # OLMoE-1B-7B's layer, one sequence
BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=2, grid_block_n=1)


def _target_text(dnn: tuple[int, int, int] | None) -> str:
    from jaxscale.plan import targets

    if dnn is not None:
        targets.DNN_VERSION = dnn  # the version XLA reads from the target to decide what cuDNN can do
    return targets.target_config_text(targets.get_target("h100"))


def _mgpu_ragged_dot():
    """ragged_dot with the Mosaic GPU kernels: forward and input gradient ragged_dot_mgpu (the latter with the
    weights transposed), weight gradient transposed_ragged_dot_mgpu."""
    import jax
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    @jax.custom_vjp
    def grouped(x, w, sizes):
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, **BLOCKS)

    def forward(x, w, sizes):
        return grouped(x, w, sizes), (x, w, sizes)

    def backward(saved, dy):
        x, w, sizes = saved
        dx = ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=sizes, transpose_rhs=True, **BLOCKS)
        dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=sizes, **BLOCKS)
        return dx, dw, None

    grouped.defvjp(forward, backward)
    return grouped


def bare_trial(kind: str, dnn: tuple[int, int, int] | None) -> dict:
    """Compiles the bare ragged_dot's forward and its pullback (a cotangent given, so that all three matmuls run)
    for h100; its kernels and FLOPs."""
    import jax
    import jax.numpy as jnp

    from jaxscale.measure import hlo, kernels
    from jaxscale.plan import target_compile

    sharding = target_compile.target_sharding(_target_text(dnn))
    rows = TOKENS * K
    shapes = (
        ((rows, HIDDEN), jnp.bfloat16),
        ((EXPERTS, HIDDEN, WIDTH), jnp.bfloat16),
        ((EXPERTS,), jnp.int32),
        ((rows, WIDTH), jnp.bfloat16),
    )  # x [M, H], w [E, H, F], group sizes [E], cotangent [M, F]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    if kind == "pallas_flag":
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    if kind == "mgpu_sms":  # the weight gradient's kernel sizes its grid by the device's SMs
        cpu_devices = jax.devices
        jax.devices = lambda *a: [type("H100", (), {"core_count": 132})()] if not a else cpu_devices(*a)
    matmul = _mgpu_ragged_dot() if kind.startswith("mgpu") else jax.lax.ragged_dot

    def step(x, w, sizes, cotangent):
        out, pullback = jax.vjp(lambda x, w: matmul(x, w, sizes), x, w)
        return out, pullback(cotangent)

    text = jax.jit(step).lower(*args).compile().as_text()
    found = [k for k in kernels.kernels(text) if k.category == "matmul" or k.detail.startswith(("mosaic", "__cudnn"))]
    calls = sorted({k.detail for k in found})
    executed = hlo.count_matmul_flops(hlo.parse(text)).matmul_flops
    if kind.startswith("mgpu"):  # no dots to the HLO reader: each Mosaic GPU call is a grouped 2·M·K·N
        executed = 3 * 2 * rows * HIDDEN * WIDTH  # tiles at group edges aside (at most E - 1 more tiles of block_m)
    return {
        "compiled": True,
        "kernels": ", ".join(f"{sum(1 for k in found if k.detail == c)} x {c}" for c in calls)
        + "".join(f"; GEMM (batch, m, n, k) {k.gemm}" for k in found if k.gemm),
        "flops_source": "Mosaic GPU calls' shapes" if kind.startswith("mgpu") else "compiled HLO dots",
        "gemm_shapes": sorted({str(k.gemm) for k in found if k.gemm}),
        "executed_flops": float(executed),
        "active_flops": float(3 * 2 * rows * HIDDEN * WIDTH),
    }


def model_config(preset: str, dispatch: str):
    """tiny-moe, or OLMoE's layer as experiments/moe_dispatch.py has it (one layer, one sequence of 2048)."""
    from jaxscale.config import base_config, import_file, validate

    if preset == "tiny-moe":
        config = base_config("tiny-moe", "ragged_dot_paths")
    else:
        config = import_file(ROOT / "experiments" / "moe_dispatch.py").get_config("olmoe-1b-7b")
        config.model.num_layers, config.data.batch_size = 1, 1
    config.model.moe_dispatch = dispatch
    validate(config)
    return config


def model_trial(preset: str, dispatch: str, dnn: tuple[int, int, int] | None) -> dict:
    """Plans the train step for h100 (cuBLAS GEMMs) and reads the row's expert FLOP columns."""
    from jaxscale.measure import expert_flops
    from jaxscale.plan import gpu_plan, targets

    config = model_config(preset, dispatch)
    _target_text(dnn)
    plan = gpu_plan.plan_for_target(config, "h100", gemm="cublas", in_process=True)
    columns = expert_flops.row_columns(config, None, {**plan, "mesh_devices": 1})
    del targets
    return {
        "compiled": True,
        "kernels": f"plan peak {plan['compiled_peak_bytes'] / 2**30:.2f} GiB, fits: {plan['plan_fits']}; remat "
        f"recomputes {columns['compiled_expert_recompute_flops_per_step']:.3g} FLOPs more (not in the ratio)",
        "executed_flops": columns["compiled_expert_matmul_flops_per_step"]
        - columns["compiled_expert_recompute_flops_per_step"],
        "flops_source": "compiled HLO dots (op_name scope)",
        "active_flops": columns["analytic_expert_matmul_flops_per_step"],
    }


def child(spec: dict) -> None:
    """One trial in this process; prints its result as one JSON line."""
    dnn = tuple(spec["dnn"]) if spec.get("dnn") else None
    try:
        if spec["trial"] == "bare":
            result = bare_trial(spec["kind"], dnn)
        else:
            result = model_trial(spec["preset"], spec["dispatch"], dnn)
    except Exception as error:  # noqa: BLE001 - the trial's outcome, written down
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{pathlib.Path(frame.filename).name}:{frame.lineno}"
        text = " ".join(str(error).split())[:250]
        result = {"compiled": False, "error": f"{type(error).__name__}: {text} ({where})"}
    print("RESULT " + json.dumps(result))


def run_one(spec: dict, cudnn_site: str | None, timeout_s: float = 900) -> dict:
    """Runs a trial in a child process; a crash or an exception is the trial's error (its first line)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": spec["flags"]}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), cudnn_site if spec.get("wheels") else None) if p)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=timeout_s, check=False)  # fmt: skip
    seconds = round(time.perf_counter() - start, 1)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**spec, **json.loads(line[7:]), "seconds": seconds}
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    error = next((ln for ln in lines if ln.startswith(("F0", "F1")) or "Check failed" in ln), None)
    error = error or next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    error = error or f"exit code {done.returncode} (XLA's message went to the plan's captured stderr)"
    return {**spec, "compiled": False, "error": error.strip()[:300], "exit": done.returncode, "seconds": seconds}


def markdown(results: list[dict]) -> str:
    """The table of trials.md."""
    lines = [
        "| trial | path | compiles | kernels (expert matmuls) | executed / active FLOPs | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["executed_flops"] / r["active_flops"] if r.get("compiled") and r.get("active_flops") else None
        flops = f"{r['executed_flops']:.3g} / {r['active_flops']:.3g} = {ratio:.2f}x" if ratio else "–"
        flops += f" ({r['flops_source']})" if ratio else ""
        lines.append(
            f"| {r['trial']} | {r['name']} | {'yes' if r.get('compiled') else 'no'} | {r.get('kernels', '–')} | "
            f"{flops} | {r.get('error', '') or ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("bare", "model"), default=None)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--cudnn_site", default="/tmp/cudnn_site", help="a --target dir holding cuDNN's wheels")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    specs = []
    if args.only in (None, "bare"):
        specs += [{"trial": "bare", "name": n, "flags": f, "dnn": d, "wheels": w, "kind": k} for n, f, d, w, k in BARE]
    if args.only in (None, "model"):
        specs += [{"trial": "model", "name": f"{p} {d}" + (" + cudnn-fusion (cuDNN 9.28)" if f else ""), "flags": f,
                   "dnn": (9, 28, 0) if f else None, "preset": p, "dispatch": d} for p, d, f in MODEL]  # fmt: skip
    results = []
    for spec in specs:
        results.append(run_one(spec, args.cudnn_site))
        r = results[-1]
        print(f"{r['trial']:5} {r['name']:40} {'ok ' if r.get('compiled') else 'FAIL'} {r['seconds']:6.1f}s "
              f"{r.get('kernels', r.get('error', ''))[:150]}", flush=True)  # fmt: skip
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trials.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "trials.md").write_text(markdown(results))
    print(markdown(results))
    print(f"written: {out / 'trials.json'}, {out / 'trials.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

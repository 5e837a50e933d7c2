"""Plans GPU memory (and step time) for a config on a named GPU target, on any machine (no GPU needed).

`plan_for_target(config, "a5000")` compiles the run's train step for the target once per GEMM backend
(`jaxscale.plan.target_compile.compile_for_target`: in a child process with `JAX_PLATFORMS=cpu` by default,
or in this process with `in_process=True`), reads XLA's rematerialization warning from the compile's stderr,
and returns result-row fields:

- `compiled_{argument,output,temp,alias,peak}_bytes`: XLA's GPU plan (the larger-peak GEMM mode),
  `compiled_backend` = "cuda:<target>", `compiled_gemm` (which mode they come from),
  `compiled_triton_peak_bytes` / `compiled_cublas_peak_bytes` (the band), `compile_s`;
- `plan_target`, `plan_target_device_kind`, `plan_target_memory_bytes` (the target's device memory);
- `plan_fits` and `plan_fits_reason`; `compiled_remat_{limit,reached,original}_bytes` from XLA's
  "Can't reduce memory use below ..." warning (None when XLA did not warn);
- `compile_cache_hit`, `compile_cache_saved_s`: whether the plans came from the plan cache
  (jaxscale.compile_cache; the compile writes its plan and stderr there).
- `predicted_*`: the step time predicted from the compiled programs' kernels (jaxscale.plan.predict).
- on several GPUs (`devices`, the config's mesh): `plan_devices`, `plan_topology` ("1x1x8": slices x hosts
  x GPUs per host), and the plan per device; the compiled_collective_* columns (jaxscale.measure.collectives).

Both ways run the same compile function (so the same cache, topology, collectives and kernels): the child is
what run and sweep use, because a malformed target config can kill the compiling process with a signal
(SIGFPE); in process (the GEMM mode is a compile option either way, XLA's warning read from this process's
own file descriptor 2) is what the fit planner (jaxscale.plan.fit_search) uses for its many compiles.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from jaxscale import _env
from jaxscale.config import ConfigError, check_mesh_devices, kernel_blocks, mesh_shape
from jaxscale.config.gpu_arch import FP8_MIN_COMPUTE_CAPABILITY
from jaxscale.measure import kernels
from jaxscale.plan import budget, predict, target_compile, targets
from jaxscale.plan.errors import PlanError, PlanFlagError

# Without a device XLA cannot autotune GEMMs and takes Triton kernels where it can; on a real GPU the
# autotuner may pick cuBLAS instead. The plans differ, so both are compiled and the band is reported. Each
# mode is a compile option of its compile (`xla_gpu_enable_triton_gemm`, as the XLA flag
# --xla_gpu_enable_triton_gemm=true|false would set it): target_compile.GEMM_OPTIONS.
GEMM_MODES = tuple(target_compile.GEMM_OPTIONS)  # ("triton", "cublas")
GEMM_CHOICES = ("both", *GEMM_MODES)
EXTRA_HINT = "pip install -e '.[gpu-plan]'"
CUDNN_HINT = "pip install -e '.[gpu-plan-cudnn]'"
CUDNN_MODULES = ("nvidia.cudnn", "nvidia.cuda_runtime")  # the wheels' packages (the CUDA 12 builds)
# The CUDA compiler plugin (any one of them), and ptxas (from the pip CUDA packages, or on the PATH).
EXTRA_MODULES = _env.CUDA_PLUGINS
PTXAS_MODULES = ("nvidia.cuda_nvcc", "nvidia.cu13")
DEFAULT_TIMEOUT_S = 900

_REMAT_WARNING = re.compile(
    r"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; "
    r"only reduced to \S+ \((\d+) bytes\), down from \S+ \((\d+) bytes\) originally"
)
REMAT_COLUMNS = ("compiled_remat_limit_bytes", "compiled_remat_reached_bytes", "compiled_remat_original_bytes")
captured_stderr = target_compile.captured_stderr  # fd 2 of this process, collected (the fit's local plans)


def missing_extra() -> str | None:
    """None when the gpu-plan extra is installed, else a one-line message naming it."""
    missing = []
    if not any(_env.installed(m) for m in EXTRA_MODULES):
        missing.append(" or ".join(EXTRA_MODULES))
    if not any(_env.installed(m) for m in PTXAS_MODULES) and shutil.which("ptxas") is None:
        missing.append("ptxas (" + " or ".join(PTXAS_MODULES) + ")")
    if not missing:
        return None
    return (
        f"--target: GPU planning needs the gpu-plan extra ({', '.join(missing)} not installed): {EXTRA_HINT} "
        f"(jax-cuda12-plugin=={jax.__version__} and nvidia-cuda-nvcc-cu12)"
    )


def missing_cudnn() -> str | None:
    """None when cuDNN's libraries are installed (the gpu-plan-cudnn extra), else a one-line message naming it."""
    if all(_env.installed(m) for m in CUDNN_MODULES):
        return None
    return (
        "model.attention=cudnn: planning cuDNN attention for a GPU target needs cuDNN's libraries, which XLA "
        f"loads to compile it: {CUDNN_HINT} ({' and '.join(CUDNN_MODULES)} not all installed; docs/attention.md)"
    )


def check_target_flag(target: str | None, plan: bool, gemm: str = "both", attention: str | None = None) -> None:
    """Checks `--target` (and `--gemm`) before any work: known target, used with --plan, extra installed, and
    for cuDNN attention (`attention`, the config's model.attention) cuDNN's libraries.

    Raises:
      PlanFlagError: one line naming what is wrong (the known targets, or the extra to install).
    """
    if gemm not in GEMM_CHOICES:
        raise PlanFlagError(f"--gemm: unknown {gemm!r}; allowed: {', '.join(GEMM_CHOICES)}")
    if target is None:
        if gemm != "both":
            raise PlanFlagError(f"--gemm {gemm}: picks the GEMMs of a GPU target's plan; add --target (and --plan)")
        return
    try:
        targets.get_target(target)
    except ValueError as error:  # UnknownTargetError included
        raise PlanFlagError(str(error)) from None
    if not plan:
        raise PlanFlagError(f"--target {target}: only plans (the GPU is not here); add --plan")
    missing = missing_extra() or (missing_cudnn() if attention == "cudnn" else None)
    if missing:
        raise PlanFlagError(missing)


def check_fp8(config: ml_collections.ConfigDict, target: str | None) -> None:
    """model.fp8 needs FP8 tensor cores: a target below compute capability 8.9 (A100, A5000) is one line.

    Raises:
      PlanFlagError: naming model.fp8, the target and its compute capability.
    """
    if target is None or config.model.fp8 == "none":
        return
    cc = targets.get_target(target).compute_capability
    if cc < FP8_MIN_COMPUTE_CAPABILITY:
        low = ".".join(map(str, FP8_MIN_COMPUTE_CAPABILITY))
        raise PlanFlagError(
            f"model.fp8: {config.model.fp8!r} needs FP8 tensor cores (compute capability {low} or newer: Ada, Hopper, "
            f"Blackwell); {target} is {cc[0]}.{cc[1]}; use model.fp8=none"
        )


def check_flash_blocks(config: ml_collections.ConfigDict, target: str | None) -> None:
    """The flash kernel's blocks against the target's own shared memory (config validation checks only the largest
    of any target's): the forward kernel's bytes by its architecture's rule (config.kernel_blocks), before any
    compile, so a plan for an Ada or Ampere card with Hopper-sized blocks is one line rather than XLA's error.

    Raises:
      PlanFlagError: one line naming the block field, the target, the bytes and the largest square block that fits.
    """
    m = config.model
    if target is None or m.attention != "flash":
        return
    spec = targets.get_target(target)
    cc, itemsize, seq_len = spec.compute_capability, 4 if m.dtype == "float32" else 2, config.data.seq_len
    default = kernel_blocks.default_block(m.head_dim, seq_len, itemsize)
    block_q, block_k = m.attention_block_q or default, m.attention_block_k or default
    need = kernel_blocks.forward_shared_memory(block_q, block_k, m.head_dim, itemsize, cc)
    limit = kernel_blocks.shared_memory_limit(cc)
    if need <= limit:
        return
    fitting = [b for b in (1 << i for i in range(default.bit_length())) if seq_len % b == 0
               and kernel_blocks.forward_shared_memory(b, b, m.head_dim, itemsize, cc) <= limit]  # fmt: skip
    field = "model.attention_block_q" if m.attention_block_q else "model.attention_block_k"
    raise PlanFlagError(
        f"{field}: blocks of {block_q} queries and {block_k} keys at model.head_dim={m.head_dim} ({m.dtype}) need "
        f"{need:,} bytes of shared memory in the flash forward kernel on {target} (compute capability "
        f"{cc[0]}.{cc[1]}), over its {limit:,}; set model.attention_block_q and _k to "
        + (f"{max(fitting)} or less" if fitting else "blocks that fit")
    )


def check_devices_flag(config: ml_collections.ConfigDict, target: str | None, devices: int | None) -> None:
    """Checks `--devices` (the target GPUs to plan on): with --target, a count XLA's CUDA topology takes, and
    the config's mesh uses them all (a 1x1x1 mesh with --devices N > 1 is refused: it would plan one GPU).

    Raises:
      PlanFlagError: one line naming --devices or mesh and what would work.
    """
    if target is None:
        raise PlanFlagError(
            f"--devices {devices}: sets how many target GPUs to plan for; add --plan --target (a run uses the "
            "devices it has; simulate CPU devices with --host_devices)"
        )
    try:
        targets.topology(devices or 1)
        check_mesh_devices(config, devices or 1, f"target {target} (--devices)", "; --devices sets the target's count")
    except (ConfigError, ValueError) as error:
        raise PlanFlagError(str(error)) from None
    if (devices or 1) > 1 and mesh_shape(config).devices == 1:  # a 1x1x1 mesh plans one of them
        raise PlanFlagError(
            f"--devices {devices}: the mesh (data x fsdp x tensor = 1x1x1) uses 1 of the {devices} target GPUs and "
            f"leaves {devices - 1} idle; set mesh.data, mesh.fsdp or mesh.tensor so that their product is {devices} "
            f"(e.g. --config.mesh.fsdp={devices}), or drop --devices to plan one GPU"
        )


def parse_remat_warning(stderr: str) -> dict[str, int] | None:
    """The numbers of XLA's last "Can't reduce memory use below ..." warning, or None if there is none."""
    found = _REMAT_WARNING.findall(stderr)
    if not found:
        return None
    return dict(zip(REMAT_COLUMNS, (int(n) for n in found[-1]), strict=True))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin compiles for the target without opening a device
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # keep XLA's warnings, drop its INFO lines
    return _env.with_package_on_path(env)


def _failure(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"target compile killed by {name} (a malformed target config can do this)"
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not _env.is_native_noise(line)]
    return f"target compile failed (exit {returncode}): " + (lines[-1][:400] if lines else "no message")


def compile_in_subprocess(
    config: ml_collections.ConfigDict,
    config_text: str,
    gemm: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    devices: int = 1,
    hlo_path: pathlib.Path | None = None,
) -> tuple[dict[str, Any], str]:
    """Runs `jaxscale.plan.target_compile` for one GEMM mode on `devices` target GPUs in a child process;
    returns (its result, its stderr). `hlo_path`: where the child keeps the compiled HLO (gzipped).

    Raises:
      PlanError: the child crashed, was killed, timed out or raised.
    """
    request = {"config": config, "target_config_text": config_text, "devices": devices, "gemm": gemm}
    request["hlo_path"] = None if hlo_path is None else str(hlo_path)
    with tempfile.TemporaryDirectory(prefix="jaxscale_plan_") as tmp:
        result_path = pathlib.Path(tmp) / "plan.json"
        command = [sys.executable, "-m", "jaxscale.plan.target_compile", str(result_path)]
        try:
            done = subprocess.run(
                command,
                input=pickle.dumps(request),
                capture_output=True,
                env=_child_env(),
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise PlanError(f"target compile ({gemm}) took longer than {timeout_s:.0f} s") from None
        stderr = done.stderr.decode(errors="replace")
        if done.returncode != 0 or not result_path.exists():
            raise PlanError(_failure(done.returncode, stderr))
        return json.loads(result_path.read_text()), stderr


def compile_in_process(
    config: ml_collections.ConfigDict,
    config_text: str,
    gemm: str,
    timeout_s: float | None = None,
    devices: int = 1,
    hlo_path: pathlib.Path | None = None,
) -> tuple[dict[str, Any], str]:
    """`target_compile.compile_for_target` in this process for one GEMM mode; (result, its stderr).

    Cheaper than a child per compile when many programs are planned (jaxscale.fit), but a malformed target
    config can kill this process (see the module docstring), and `timeout_s` is not enforced.

    Raises:
      PlanError: the compile raised (an XLA error).
    """
    del timeout_s  # a compile in this process cannot be interrupted
    with captured_stderr() as stderr:
        try:
            result = target_compile.compile_for_target(config, config_text, devices, gemm, hlo_path)
        except Exception as error:  # XLA raises many types; all mean the target compile failed
            raise PlanError(f"target compile failed: {' '.join(str(error).split())[:400]}") from None
    return result, stderr[0]


def remat_warning_reason(warning: dict[str, int]) -> str:
    """Why a plan with XLA's "Can't reduce memory use below ..." warning does not fit, on one line."""
    return (
        f"XLA could not rematerialize below its limit of {warning['compiled_remat_limit_bytes']} bytes "
        f"(reached {warning['compiled_remat_reached_bytes']}, from {warning['compiled_remat_original_bytes']})"
    )


def device_warning(warning: dict[str, int] | None, host_bytes: int) -> dict[str, int] | None:
    """XLA's rematerialization warning as it bears on the device: its estimate counts the arrays in host memory
    (jaxscale.train.offload) as device memory. Measured on the H100 plans of llama3.1-8b at sequence 2048 with Adam's
    state offloaded: "reached" 143,533,343,444 bytes = the device peak 79,291,296,160 + the host arguments
    64,242,089,992 (with the parameters offloaded too, 151,049,536,212 = 54,686,447,008 + 96,363,134,984). So with
    `host_bytes` in host memory the warning stands only where what it reached less them is above its limit."""
    if warning is None or not host_bytes:
        return warning
    reached = warning["compiled_remat_reached_bytes"] - host_bytes
    return warning if reached > warning["compiled_remat_limit_bytes"] else None


def fits(target: targets.GpuTarget, peak: int, warning: dict[str, int] | None) -> tuple[bool, str | None]:
    """(whether a plan fits the target, why not): XLA could not rematerialize below its limit, or peak > memory."""
    if warning is not None:
        return False, remat_warning_reason(warning)
    if peak > target.device_memory_size:
        return False, f"planned peak {peak} bytes > device memory {target.device_memory_size} bytes"
    return True, None


def plan_row(
    config: ml_collections.ConfigDict,
    spec: targets.GpuTarget,
    plans: dict[str, dict[str, Any]],
    warnings: dict[str, dict[str, int] | None],
    devices: int,
) -> dict[str, Any]:
    """The row fields of the compiled GEMM modes' plans (see plan_for_target): the larger plan, the band, the
    verdict (any mode's warning, or the larger peak above the memory) and the predicted step of the faster."""
    modes = tuple(plans)
    chosen = max(modes, key=lambda m: plans[m]["compiled_peak_bytes"])
    plan = plans[chosen]
    warning = next((warnings[m] for m in (chosen, *modes) if warnings[m] is not None), None)
    plan_fits, reason = fits(spec, plan["compiled_peak_bytes"],
                             device_warning(warning, plan.get("compiled_host_argument_bytes") or 0))  # fmt: skip
    hits = [plans[m].get("compile_cache_hit") for m in modes]
    by_mode = {mode: kernels.from_dicts(plans[mode]["kernels"]) for mode in modes}
    plan_devices = devices if mesh_shape(config).devices > 1 else 1
    return {
        "params": plan["params"],
        "trainable_params": plan.get("trainable_params", plan["params"]),
        "compile_s": plan["compile_s"],
        "compile_cache_hit": None if None in hits else all(hits),
        "compile_cache_saved_s": plan.get("compile_cache_saved_s") if all(hits) and None not in hits else None,
        **{k: v for k, v in plan.items() if k.startswith("compiled_")},
        "compiled_backend": f"cuda:{spec.name}",
        "compiled_gemm": chosen,
        **{f"compiled_{m}_peak_bytes": plans[m]["compiled_peak_bytes"] if m in plans else None for m in GEMM_MODES},
        **(warning or dict.fromkeys(REMAT_COLUMNS)),
        "plan_target": spec.name,
        "plan_target_device_kind": plan["device_kind"],
        "plan_target_memory_bytes": spec.device_memory_size,
        "plan_devices": plan_devices,
        "plan_topology": plan["plan_topology"],
        "plan_fits": plan_fits,
        "plan_fits_reason": reason,
        **predict.target_columns(config, spec, by_mode, plan_devices),
    }


PLAN_HLO_FILE = "plan_{gemm}.hlo.txt.gz"  # a plan's compiled program, beside its row (hlo_dir)


def plan_for_target(
    config: ml_collections.ConfigDict,
    target: str,
    gemm: str = "both",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    devices: int = 1,
    in_process: bool = False,
    enough: Callable[[dict[str, Any]], bool] | None = None,
    hlo_dir: pathlib.Path | None = None,
) -> dict[str, Any]:
    """XLA's memory plan of the run's train step on a GPU target, as result-row fields.

    Args:
      config: a validated run config (the same the run would execute).
      target: a name in jaxscale.targets.TARGETS or a GpuTargetConfig .txtpb path.
      gemm: "both" (default; the reported plan is the larger), "triton" or "cublas".
      timeout_s: per child compile.
      devices: target GPUs the config's mesh runs on (its product; 1 for the 1x1x1 mesh). The plan, and
        whether it fits, is per device.
      in_process: compile in this process (compile_in_process) instead of one child per GEMM mode.
      enough: with gemm="both", compile cuBLAS first and skip Triton when `enough(row of the cuBLAS plan)`
        (the fit planner: a verdict of "does not fit" cannot change); the row then says plan_gemm_partial.
      hlo_dir: keep each compiled program there as `plan_<gemm>.hlo.txt.gz` (PLAN_HLO_FILE), listed in the
        row's plan_hlo_files; None keeps none (the fit planner's probes).
    Returns:
      The row fields listed in this module's docstring, plus params, plan_devices, plan_topology, the
      compiled_collective_* columns and plan_wall_s (all compiles, seconds).
    Raises:
      targets.UnknownTargetError, ValueError: bad target; PlanError: a compile failed.
    """
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm: unknown {gemm!r}; allowed: {', '.join(GEMM_CHOICES)}")
    spec = targets.get_target(target)
    check_fp8(config, target)
    text = targets.target_config_text(spec)
    modes = (GEMM_MODES if enough is None else ("cublas", "triton")) if gemm == "both" else (gemm,)
    compile_one = compile_in_process if in_process else compile_in_subprocess
    start = time.perf_counter()
    plans, warnings, partial = {}, {}, False
    for mode in modes:
        hlo_path = None if hlo_dir is None else pathlib.Path(hlo_dir) / PLAN_HLO_FILE.format(gemm=mode)
        plans[mode], stderr = compile_one(config, text, mode, timeout_s, devices, hlo_path)
        warnings[mode] = parse_remat_warning(stderr)
        if enough is not None and len(plans) < len(modes) and enough(plan_row(config, spec, plans, warnings, devices)):
            partial = True
            break
    row = plan_row(config, spec, plans, warnings, devices)
    if partial:
        row["plan_gemm_partial"] = True
    if hlo_dir is not None:
        kept = [PLAN_HLO_FILE.format(gemm=mode) for mode in plans]
        row["plan_hlo_files"] = [name for name in kept if (pathlib.Path(hlo_dir) / name).exists()]
    return {**row, "plan_wall_s": time.perf_counter() - start}


def _allocator_note(peak: int, memory: int) -> str:
    """What a fitting plan needs of JAX's allocator on the GPU: nothing within its default pool, else the
    fraction to set (jaxscale.plan.budget), or that no fraction leaves room for the CUDA context."""
    if peak <= budget.DEFAULT_MEM_FRACTION * memory:
        return f" (within JAX's default allocator, {budget.DEFAULT_MEM_FRACTION:.0%} of the memory)"
    needed = math.ceil(100 * peak / memory) / 100
    if needed > budget.largest_fraction(memory):
        return (f" in the device's memory, but not in what JAX's allocator can have beside the "
                f"{budget.CONTEXT_RESERVE_BYTES / 2**30:g} GiB assumed for the CUDA context (docs/fit.md)")  # fmt: skip
    return f" only with {budget.MEM_FRACTION_ENV[0]}={needed:g} set (JAX's allocator takes 75% by default)"


def summary_line(row: dict[str, Any]) -> str:
    """One line for the run summary: fits or not on the target, and the GEMM band."""
    gib = 2**30
    band = [row.get(f"compiled_{m}_peak_bytes") for m in GEMM_MODES]
    band_text = " / ".join("-" if b is None else f"{b / gib:.3f}" for b in band)
    verdict = "fits" if row["plan_fits"] else f"does NOT fit: {row['plan_fits_reason']}"
    if row["plan_fits"]:
        verdict += _allocator_note(row["compiled_peak_bytes"], row["plan_target_memory_bytes"])
    devices = row.get("plan_devices") or 1
    each = f" x {devices} (topology {row.get('plan_topology')}; plan per device)" if devices > 1 else ""
    return (
        f"  target {row['plan_target']}{each} ({row['plan_target_device_kind']}, "
        f"{row['plan_target_memory_bytes'] / gib:.2f} GiB): {verdict}; "
        f"peak triton / cublas GEMMs {band_text} GiB"
    )

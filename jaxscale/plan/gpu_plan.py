"""Plans GPU memory for a config on a named GPU target, on any machine (no GPU needed).

`plan_for_target(config, "a5000")` compiles the run's train step for the target in child processes
(`jaxscale.target_compile`, `JAX_PLATFORMS=cpu`), once per GEMM backend, reads XLA's rematerialization
warning from their stderr, and returns result-row fields:

- `compiled_{argument,output,temp,alias,peak}_bytes`: XLA's GPU plan (the larger-peak GEMM mode),
  `compiled_backend` = "cuda:<target>", `compiled_gemm` (which mode they come from),
  `compiled_triton_peak_bytes` / `compiled_cublas_peak_bytes` (the band), `compile_s`;
- `plan_target`, `plan_target_device_kind`, `plan_target_memory_bytes` (the target's device memory);
- `plan_fits` and `plan_fits_reason`; `compiled_remat_{limit,reached,original}_bytes` from XLA's
  "Can't reduce memory use below ..." warning (None when XLA did not warn).

`in_process=True` compiles in this process instead (the GEMM mode as a compile option, XLA's warning read
from this process's own stderr): what the fit planner (jaxscale.plan.fit) uses for its many compiles.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from jaxscale import _env
from jaxscale.cli import UsageError
from jaxscale.plan import target_compile, targets

# Without a device XLA cannot autotune GEMMs and takes Triton kernels where it can; on a real GPU the
# autotuner may pick cuBLAS instead. The plans differ, so both are compiled and the band is reported.
GEMM_FLAGS: dict[str, str] = {
    "triton": "--xla_gpu_enable_triton_gemm=true",
    "cublas": "--xla_gpu_enable_triton_gemm=false",
}
# The same choice as compile options of one compile (`lowered.compile(compiler_options=...)`), for planners
# that compile several programs in one process (jaxscale.plan.fit).
GEMM_OPTIONS: dict[str, dict[str, bool]] = {
    "triton": {"xla_gpu_enable_triton_gemm": True},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
}
GEMM_CHOICES = ("both", *GEMM_FLAGS)
EXTRA_HINT = "pip install -e '.[gpu-plan]'"
EXTRA_MODULES = ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc")  # the CUDA compiler plugin, and ptxas
DEFAULT_TIMEOUT_S = 900

_REMAT_WARNING = re.compile(
    r"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; "
    r"only reduced to \S+ \((\d+) bytes\), down from \S+ \((\d+) bytes\) originally"
)
REMAT_COLUMNS = ("compiled_remat_limit_bytes", "compiled_remat_reached_bytes", "compiled_remat_original_bytes")
_NOISE = ("cudart_stub.cc", "absl::InitializeLog()")


class PlanError(RuntimeError):
    """The target compile failed (a crash, a signal or an XLA error); the message is one line."""


def missing_extra() -> str | None:
    """None when the gpu-plan extra is installed, else a one-line message naming it."""
    missing = [m for m in EXTRA_MODULES if not _env.installed(m)]
    if not missing:
        return None
    return (
        f"--target: GPU planning needs the gpu-plan extra ({', '.join(missing)} not installed): {EXTRA_HINT} "
        f"(jax-cuda12-plugin=={jax.__version__} and nvidia-cuda-nvcc-cu12)"
    )


def check_target_flag(target: str | None, plan: bool, gemm: str = "both") -> None:
    """Checks `--target` (and `--gemm`) before any work: known target, used with --plan, extra installed.

    Raises:
      UsageError: one line naming what is wrong (the known targets, or the extra to install).
    """
    if gemm not in GEMM_CHOICES:
        raise UsageError(f"--gemm: unknown {gemm!r}; allowed: {', '.join(GEMM_CHOICES)}")
    if target is None:
        if gemm != "both":
            raise UsageError(f"--gemm {gemm}: picks the GEMMs of a GPU target's plan; add --target (and --plan)")
        return
    try:
        targets.get_target(target)
    except ValueError as error:  # UnknownTargetError included
        raise UsageError(str(error)) from None
    if not plan:
        raise UsageError(f"--target {target}: only plans (the GPU is not here); add --plan")
    missing = missing_extra()
    if missing:
        raise UsageError(missing)


def parse_remat_warning(stderr: str) -> dict[str, int] | None:
    """The numbers of XLA's last "Can't reduce memory use below ..." warning, or None if there is none."""
    found = _REMAT_WARNING.findall(stderr)
    if not found:
        return None
    return dict(zip(REMAT_COLUMNS, (int(n) for n in found[-1]), strict=True))


def _child_env(gemm: str) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin compiles for the target without opening a device
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # keep XLA's warnings, drop its INFO lines
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {GEMM_FLAGS[gemm]}".strip()
    return _env.with_package_on_path(env)


def _failure(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"target compile killed by {name} (a malformed target config can do this)"
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not any(n in line for n in _NOISE)]
    return f"target compile failed (exit {returncode}): " + (lines[-1][:400] if lines else "no message")


def compile_in_subprocess(
    config: ml_collections.ConfigDict, config_text: str, gemm: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[dict[str, Any], str]:
    """Runs `jaxscale.target_compile` for one GEMM mode; returns (its result, its stderr).

    Raises:
      PlanError: the child crashed, was killed, timed out or raised.
    """
    request = pickle.dumps({"config": config, "target_config_text": config_text})
    with tempfile.TemporaryDirectory(prefix="jaxscale_plan_") as tmp:
        result_path = pathlib.Path(tmp) / "plan.json"
        command = [sys.executable, "-m", "jaxscale.plan.target_compile", str(result_path)]
        try:
            done = subprocess.run(
                command, input=request, capture_output=True, env=_child_env(gemm), timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise PlanError(f"target compile ({gemm}) took longer than {timeout_s:.0f} s") from None
        stderr = done.stderr.decode(errors="replace")
        if done.returncode != 0 or not result_path.exists():
            raise PlanError(_failure(done.returncode, stderr))
        return json.loads(result_path.read_text()), stderr


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


def compile_in_process(
    config: ml_collections.ConfigDict, config_text: str, gemm: str, timeout_s: float | None = None
) -> tuple[dict[str, Any], str]:
    """`target_compile.compile_for_target` in this process (GEMM mode as a compile option); (result, stderr).

    Cheaper than a child per compile when many programs are planned (jaxscale.fit), but a malformed target
    config can kill this process (see the module docstring), and `timeout_s` is not enforced.

    Raises:
      PlanError: the compile raised (an XLA error).
    """
    del timeout_s  # a compile in this process cannot be interrupted
    with captured_stderr() as stderr:
        try:
            result = target_compile.compile_for_target(config, config_text, GEMM_OPTIONS[gemm])
        except Exception as error:  # XLA raises many types; all mean the target compile failed
            raise PlanError(f"target compile failed: {' '.join(str(error).split())[:400]}") from None
    return result, stderr[0]


def remat_warning_reason(warning: dict[str, int]) -> str:
    """Why a plan with XLA's "Can't reduce memory use below ..." warning does not fit, on one line."""
    return (
        f"XLA could not rematerialize below its limit of {warning['compiled_remat_limit_bytes']} bytes "
        f"(reached {warning['compiled_remat_reached_bytes']}, from {warning['compiled_remat_original_bytes']})"
    )


def fits(target: targets.GpuTarget, peak: int, warning: dict[str, int] | None) -> tuple[bool, str | None]:
    """(whether a plan fits the target, why not): XLA could not rematerialize below its limit, or peak > memory."""
    if warning is not None:
        return False, remat_warning_reason(warning)
    if peak > target.device_memory_size:
        return False, f"planned peak {peak} bytes > device memory {target.device_memory_size} bytes"
    return True, None


def plan_for_target(
    config: ml_collections.ConfigDict,
    target: str,
    gemm: str = "both",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    in_process: bool = False,
) -> dict[str, Any]:
    """XLA's memory plan of the run's train step on a GPU target, as result-row fields.

    Args:
      config: a validated run config (the same the run would execute).
      target: a name in jaxscale.targets.TARGETS or a GpuTargetConfig .txtpb path.
      gemm: "both" (default; the reported plan is the larger), "triton" or "cublas".
      timeout_s: per child compile.
      in_process: compile in this process (compile_in_process) instead of one child per GEMM mode.
    Returns:
      The row fields listed in this module's docstring, plus params and plan_wall_s (all children, seconds).
    Raises:
      targets.UnknownTargetError, ValueError: bad target; PlanError: a compile failed.
    """
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm: unknown {gemm!r}; allowed: {', '.join(GEMM_CHOICES)}")
    spec = targets.get_target(target)
    text = targets.target_config_text(spec)
    modes = tuple(GEMM_FLAGS) if gemm == "both" else (gemm,)
    start = time.perf_counter()
    plans, warnings = {}, {}
    compile_one = compile_in_process if in_process else compile_in_subprocess
    for mode in modes:
        plans[mode], stderr = compile_one(config, text, mode, timeout_s)
        warnings[mode] = parse_remat_warning(stderr)
    chosen = max(modes, key=lambda m: plans[m]["compiled_peak_bytes"])
    plan = plans[chosen]
    warning = next((warnings[m] for m in (chosen, *modes) if warnings[m] is not None), None)
    plan_fits, reason = fits(spec, plan["compiled_peak_bytes"], warning)
    return {
        "params": plan["params"],
        "compile_s": plan["compile_s"],
        **{k: v for k, v in plan.items() if k.startswith("compiled_")},
        "compiled_backend": f"cuda:{spec.name}",
        "compiled_gemm": chosen,
        **{f"compiled_{m}_peak_bytes": plans[m]["compiled_peak_bytes"] if m in plans else None for m in GEMM_FLAGS},
        **(warning or dict.fromkeys(REMAT_COLUMNS)),
        "plan_target": spec.name,
        "plan_target_device_kind": plan["device_kind"],
        "plan_target_memory_bytes": spec.device_memory_size,
        "plan_fits": plan_fits,
        "plan_fits_reason": reason,
        "plan_wall_s": time.perf_counter() - start,
    }


def summary_line(row: dict[str, Any]) -> str:
    """One line for the run summary: fits or not on the target, and the GEMM band."""
    gib = 2**30
    band = [row.get(f"compiled_{m}_peak_bytes") for m in GEMM_FLAGS]
    band_text = " / ".join("-" if b is None else f"{b / gib:.3f}" for b in band)
    verdict = "fits" if row["plan_fits"] else f"does NOT fit: {row['plan_fits_reason']}"
    return (
        f"  target {row['plan_target']} ({row['plan_target_device_kind']}, "
        f"{row['plan_target_memory_bytes'] / gib:.2f} GiB): {verdict}; "
        f"peak triton / cublas GEMMs {band_text} GiB"
    )

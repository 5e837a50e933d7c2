"""Process environment set before JAX is imported (JAX reads JAX_PLATFORMS when it is imported)."""

import importlib.util
import os
import pathlib


def quiet_native_logs() -> None:
    """Keeps a machine without a GPU quiet when the CUDA plugin is installed (the gpu-plan extra).

    Without an NVIDIA device the plugin would fail to load CUDA and log a traceback at every start, so,
    unless JAX_PLATFORMS is set already, the backend is pinned to the CPU where no NVIDIA (/dev/nvidiactl)
    or TPU (/dev/accel0) device exists. INFO lines of native code are hidden; warnings stay.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    accelerators = ("/dev/nvidiactl", "/dev/accel0")
    if "JAX_PLATFORMS" not in os.environ and not any(os.path.exists(p) for p in accelerators):
        if installed("jax_plugins.xla_cuda12"):
            os.environ["JAX_PLATFORMS"] = "cpu"


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it; False when a parent package is missing."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # find_spec imports the parents: jax_plugins is absent without the CUDA plugin
        return False


def with_package_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with this checkout of jaxscale first on PYTHONPATH, so a child process imports the same code."""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}

"""Process environment set before JAX is imported, and a quiet start where the CUDA plugin has no GPU.

Why a start can be noisy: with the CUDA plugin installed (the gpu-plan or cuda12/cuda13 extras) `import jax`
loads the plugin's extension libraries (jax._src.lib imports jaxlib.gpu_prng, gpu_solver, gpu_linalg, which
load jax_cuda12_plugin/_prng.so, ...), and the first backend use loads its PJRT library
(xla_cuda_plugin.so, through plugin discovery). Each of these shared libraries links its own copy of TSL's
CUDA runtime stub and of absl logging. Without an NVIDIA driver the stub logs "cudart_stub.cc: Could not
find cuda drivers on your machine" when it is loaded, through an absl that nobody has initialised, so
absl prints its "All log messages before absl::InitializeLog() ..." header and the INFO line to fd 2
whatever TF_CPP_MIN_LOG_LEVEL or JAX_PLATFORMS say: two lines per library, before any of our code runs.

No setting of JAX or XLA turns this off, and the plugin cannot stay unloaded: the deviceless GPU plan
(jaxscale.plan.target_compile) needs it. So, only where the plugin is installed, `quiet_native_logs` runs
`import jax` and (where JAX_PLATFORMS excludes CUDA, so no device is touched) the plugin discovery with fd 2
written to a temporary file, and writes back every line of it except those two known lines. Everything
after that (XLA's warnings, such as the rematerialization warning that planning parses, and errors) goes
to stderr untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterator

# The CUDA PJRT plugins JAX discovers (jax_plugins namespace): CUDA 12 (jax 0.10, 0.11) and CUDA 13 (jax 0.11).
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/accel0")  # an NVIDIA driver's control device, a TPU

# The only lines dropped: absl's header before its first message, and the CUDA stub's "no driver" line.
NATIVE_NOISE = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"),
    re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.$"),
)


def is_native_noise(line: str) -> bool:
    """Whether a line of stderr is one of the CUDA plugin's start-up lines (see NATIVE_NOISE)."""
    return any(pattern.search(line.rstrip("\r\n")) for pattern in NATIVE_NOISE)


def quiet_native_logs() -> None:
    """Keeps the start of every process quiet on a machine without a GPU; call before JAX is imported.

    INFO lines of native code are hidden (TF_CPP_MIN_LOG_LEVEL=1; warnings stay). Where the CUDA plugin is
    installed: unless JAX_PLATFORMS is set already, the backend is pinned to the CPU where no NVIDIA
    (/dev/nvidiactl) or TPU (/dev/accel0) device exists, and JAX is imported (and its plugins registered)
    with the plugin's start-up lines filtered out (see this module's docstring).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if not cuda_plugin_installed():
        return
    if "JAX_PLATFORMS" not in os.environ and not any(os.path.exists(p) for p in ACCELERATOR_DEVICES):
        os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported before us: its lines are out already
        return
    with native_stderr_filtered():
        import jax  # noqa: F401  (loads the plugin's extension libraries)

        if not platforms_include_cuda(os.environ.get("JAX_PLATFORMS", "")):
            register_plugins()


def cuda_plugin_installed() -> bool:
    """Whether a CUDA PJRT plugin for JAX is installed (without importing it)."""
    return any(installed(module) for module in CUDA_PLUGINS)


def platforms_include_cuda(platforms: str) -> bool:
    """Whether a JAX_PLATFORMS value may use CUDA ("" lets JAX choose, so it may)."""
    names = {name.strip() for name in platforms.split(",") if name.strip()}
    return not names or bool(names & {"cuda", "gpu"})


def register_plugins() -> None:
    """Runs JAX's PJRT plugin discovery now (it would run at the first backend use), creating no backend.

    Only called where JAX_PLATFORMS excludes CUDA: the CUDA plugin then skips its driver checks, so no GPU
    is touched. `_discover_and_register_pjrt_plugins` is private to JAX (0.10 and 0.11 have it); where a
    JAX lacks it, discovery simply happens later, unfiltered.
    """
    from jax._src import xla_bridge

    discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if discover is not None:
        discover()


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Sends fd 2 (native code and Python alike) to a temporary file for the block, then writes its lines
    back to fd 2 in order, except the CUDA plugin's start-up lines (NATIVE_NOISE).

    If fd 2 cannot be duplicated (a closed stderr) the block runs unfiltered. A hard crash inside the block
    (a signal) would lose what it wrote, so keep the block to imports and registration.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().splitlines(keepends=True)
            kept = [line for line in lines if not is_native_noise(line.decode(errors="replace"))]
            if kept:
                os.write(2, b"".join(kept))


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

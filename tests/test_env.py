"""The environment set before JAX is imported must work with and without the optional CUDA plugin."""

from jaxscale import _env


def test_installed_is_false_when_a_parent_package_is_missing():
    # Without the gpu-plan extra there is no jax_plugins package at all; find_spec would raise.
    assert not _env.installed("jaxscale_no_such_package.xla_cuda12")
    assert not _env.installed("jaxscale.no_such_module")
    assert _env.installed("jaxscale._env")


def test_backend_is_pinned_only_without_an_accelerator(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(_env.os.path, "exists", lambda path: False)  # no /dev/nvidiactl, no /dev/accel0
    monkeypatch.setattr(_env, "installed", lambda module: False)  # no CUDA plugin: nothing to pin
    _env.quiet_native_logs()
    assert "JAX_PLATFORMS" not in _env.os.environ
    monkeypatch.setattr(_env, "installed", lambda module: True)  # plugin but no GPU: pin to the CPU
    _env.quiet_native_logs()
    assert _env.os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(_env.os.path, "exists", lambda path: path == "/dev/nvidiactl")  # a GPU: leave JAX be
    _env.quiet_native_logs()
    assert "JAX_PLATFORMS" not in _env.os.environ

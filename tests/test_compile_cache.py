"""The compilation cache: a second compile of the same step is served from it (JAX's cache for this backend),
the row says so and keeps the same plan; off means off; the plan cache's keys and entries."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from conftest import default_cpu_codegen_env, run_cli

from jaxscale import compile_cache


def _plan_row(tmp: pathlib.Path, cache_dir: pathlib.Path, *flags: str) -> dict:
    # XLA's default CPU emitters: with the suite's legacy ones (conftest) the tiny step compiles in under JAX's one
    # second, below which JAX's cache does not keep a program
    env = {"JAXSCALE_CACHE_DIR": str(cache_dir), "JAXSCALE_COMPILATION_CACHE": "1",
           "XLA_FLAGS": default_cpu_codegen_env()["XLA_FLAGS"]}  # fmt: skip
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = run_cli("jaxscale.run", "--config", "configs/bf16_remat.py:tiny", "--plan", "--quiet",
                       "--output_root", str(tmp), *flags)  # fmt: skip
    finally:
        for key, value in old.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    assert proc.returncode == 0, proc.stderr
    return json.loads(pathlib.Path(proc.stdout.split("result: ")[-1].strip()).read_text())


def test_a_second_local_compile_is_served_from_the_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    first = _plan_row(tmp_path, cache_dir)
    entries = sorted(p.name for p in (cache_dir / "xla").iterdir())
    assert first["compile_cache_hit"] is False and first["compile_cache_saved_s"] is None
    assert any(name.startswith("jit_train_step-") for name in entries)
    second = _plan_row(tmp_path, cache_dir)
    assert second["compile_cache_hit"] is True and second["compile_cache_saved_s"] > 0
    assert second["compile_s"] > 0  # the cache read, timed as it happened
    for column in ("compiled_peak_bytes", "compiled_temp_bytes", "compiled_matmul_flops_per_step"):
        assert second[column] == first[column], column
    off = _plan_row(tmp_path, cache_dir, "--nocompilation_cache")
    assert off["compile_cache_hit"] is None and off["compiled_peak_bytes"] == first["compiled_peak_bytes"]
    assert sorted(p.name for p in (cache_dir / "xla").iterdir()) == entries  # nothing read or written


def test_the_switch_and_the_directory_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    for value, on in (("0", False), ("off", False), ("False", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("JAXSCALE_COMPILATION_CACHE", value)
        assert compile_cache.enabled() is on, value
    monkeypatch.delenv("JAXSCALE_COMPILATION_CACHE")
    assert compile_cache.enabled()  # on by default
    assert compile_cache.xla_dir() == tmp_path / "xla" and compile_cache.plan_dir() == tmp_path / "plans"
    monkeypatch.delenv("JAXSCALE_CACHE_DIR")
    assert compile_cache.cache_root() == pathlib.Path.home() / ".cache" / "jaxscale"


def test_a_hit_means_every_compile_in_the_block_was_served():
    assert compile_cache.CompileWatch().hit is None  # no compile asked the cache: off, or nothing compiled
    assert compile_cache.CompileWatch(requests=1, hits=1, saved_s=2.0).columns() == {
        "compile_cache_hit": True,
        "compile_cache_saved_s": 2.0,
    }
    assert compile_cache.CompileWatch(requests=2, hits=1, misses=1).hit is False
    assert compile_cache.CompileWatch(requests=1, misses=1).columns()["compile_cache_saved_s"] is None


def test_a_plan_key_changes_with_the_program_the_target_and_the_flags():
    key = compile_cache.plan_key("module @jit_train_step {}", "gpu_device_info {}", "--xla_gpu_enable_triton_gemm=true")
    assert len(key) == 64
    assert key == compile_cache.plan_key("module @jit_train_step {}", "gpu_device_info {}",
                                         "--xla_gpu_enable_triton_gemm=true")  # fmt: skip
    others = [
        ("module @jit_train_step {1}", "gpu_device_info {}", "--xla_gpu_enable_triton_gemm=true"),
        ("module @jit_train_step {}", "gpu_device_info {2}", "--xla_gpu_enable_triton_gemm=true"),
        ("module @jit_train_step {}", "gpu_device_info {}", "--xla_gpu_enable_triton_gemm=false"),
    ]
    assert len({key, *(compile_cache.plan_key(*parts) for parts in others)}) == 4


def test_plan_entries_round_trip_and_stay_out_when_the_cache_is_off(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSCALE_COMPILATION_CACHE", "1")
    assert compile_cache.read_plan("abc") is None
    compile_cache.write_plan("abc", {"compiled_peak_bytes": 7, "compile_s": 3.0}, "W xla warning\n")
    assert compile_cache.read_plan("abc")["stderr"] == "W xla warning\n"
    assert [p.name for p in (tmp_path / "plans").iterdir()] == ["abc.json"]  # no temporary file left
    (tmp_path / "plans" / "torn.json").write_text('{"result": ')
    assert compile_cache.read_plan("torn") is None  # unreadable: compiled again, not an error
    monkeypatch.setenv("JAXSCALE_COMPILATION_CACHE", "0")
    assert compile_cache.read_plan("abc") is None
    compile_cache.write_plan("def", {}, "")
    assert not (tmp_path / "plans" / "def.json").exists()


@pytest.mark.parametrize("entry", ["run", "sweep", "bench"])
def test_the_flags_default_follows_the_environment(entry, monkeypatch):
    """A process started with JAXSCALE_COMPILATION_CACHE=0 (as a sweep's variants and planning's children
    are when the sweep or run got --nocompilation_cache) keeps the cache off without being given the flag."""
    from jaxscale import bench, run
    from jaxscale.sweep import runner

    flag_values = {"run": lambda: run._flag_values(["run"]), "sweep": runner._flag_values, "bench": bench._flag_values}
    for value, default in (("0", False), ("1", True)):
        monkeypatch.setenv("JAXSCALE_COMPILATION_CACHE", value)
        assert flag_values[entry]()["compilation_cache"].default is default
    compile_cache.set_enabled(False)
    assert os.environ["JAXSCALE_COMPILATION_CACHE"] == "0" and not compile_cache.enabled()

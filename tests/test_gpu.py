"""The checks a user with a CUDA GPU runs once to trust the lab there: `pytest -m gpu` (skipped without one).

- the allocator's peak of a real run against the deviceless plan for this GPU's planning target;
- MFU against the datasheet peak of this GPU (jaxscale/measure/peaks.py);
- the trace analysis on a GPU trace: step times and category shares from GPU kernels and XLA ops;
- cuDNN attention against the reference einsum: tests/model/test_gpt.py (also marked gpu).

Runs happen in fresh processes where a peak must be the run's own (the allocator's peak is per process).
"""

from __future__ import annotations

import csv
import gzip
import json
import pathlib
import re

import jax
import pytest
from conftest import load_config, run_cli

from jaxscale import run
from jaxscale.measure import peaks, traces
from jaxscale.plan import gpu_plan, targets

pytestmark = pytest.mark.gpu

# The allocator's peak against the plan's Triton/cuBLAS band [low, high]. Below: 5%, because the GPU
# autotunes each GEMM (Triton or cuBLAS, per shape) and may fuse a little differently from either
# deviceless mode. Above: 10% + 256 MiB, because the allocator's peak covers the whole process, not one
# call of the step: the BFC allocator's rounding and fragmentation, the random batch and the initial state
# built before the first step donates it, and workspaces the GPU libraries take at run time.
PEAK_BELOW, PEAK_ABOVE, PEAK_SLACK_BYTES = 0.95, 1.10, 256 * 2**20
QUICK = ("--config.train.steps=2", "--config.train.warmup_steps=1", "--config.profile.steps=0")


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("result: ")][-1]
    return json.loads(pathlib.Path(line.removeprefix("result: ")).read_text())


def _this_gpus_target() -> targets.GpuTarget:
    kind = jax.devices()[0].device_kind
    target = targets.target_for_device_kind(kind)
    if target is None:
        pytest.skip(f"no planning target has this GPU's device_kind {kind!r}; add one to jaxscale/plan/targets.py")
    if gpu_plan.missing_extra() is not None:
        pytest.skip(gpu_plan.missing_extra())
    return target


@pytest.mark.parametrize("name", ["bf16_remat", "bf16_noscan"])
def test_the_allocators_peak_lies_in_the_band_of_the_plan_for_this_gpu(name, tmp_path):
    target = _this_gpus_target()
    row = _result(run_cli("jaxscale.run", "--config", f"configs/{name}.py:seed", *QUICK, "--quiet",
                          "--output_root", str(tmp_path), timeout=1800))  # fmt: skip
    assert row["status"] == "ok" and row["device_kind"] == target.device_kind
    measured = row["device_peak_bytes"]
    assert measured is not None, row["device_peak_note"]
    plan = gpu_plan.plan_for_target(load_config(name, "seed"), target.name)
    low, high = sorted((plan["compiled_triton_peak_bytes"], plan["compiled_cublas_peak_bytes"]))
    gib = 2**30
    assert PEAK_BELOW * low <= measured <= PEAK_ABOVE * high + PEAK_SLACK_BYTES, (
        f"{name} on {target.name}: allocator peak {measured / gib:.3f} GiB, plan band "
        f"{low / gib:.3f}-{high / gib:.3f} GiB"
    )


def test_mfu_divides_by_the_datasheet_peak_of_this_gpu(tmp_path):
    kind = jax.devices()[0].device_kind
    peak, source = peaks.peak_flops(kind, "bfloat16")
    if peak is None:
        pytest.skip(source)
    config = load_config("bf16_remat", "seed")
    config.train.update(steps=3, warmup_steps=1)
    config.profile.steps = 0
    row = run.run(config, tmp_path / "mfu", "mfu", progress=False)
    assert row["status"] == "ok", row["error"]
    assert row["peak_flops_per_s"] == peak and row["peak_flops_source"] == source
    achieved = row["analytic_model_flops_per_step"] / row["step_s_median"]
    assert row["mfu"] == pytest.approx(achieved / peak)
    assert 0.02 < row["mfu"] < 1.0  # a working bf16 step uses the tensor cores, and never beats the datasheet


def test_a_gpu_trace_gives_step_times_and_category_shares(tmp_path):
    rows = {}
    for name in ("bf16", "bf16_noscan"):  # scanned layers without remat copy their residuals, unrolled do not
        config = load_config(name, "cpu")
        config.train.update(steps=4, warmup_steps=1)
        config.profile.steps = 3
        row = rows[name] = run.run(config, tmp_path / name, name, progress=False)
        assert row["status"] == "ok" and "trace_analysis_error" not in row, row.get("trace_analysis_error")
        assert row["trace_op_source"].startswith("device:"), row["trace_op_source"]  # ops from the GPU plane
        assert row["trace_steps"] == 3 and 0 < row["trace_step_s"] <= 1.5 * row["step_s_median"]
        shares = {c: row[f"trace_{c}_share"] for c in ("matmul", "fusion", "dus", "copy", "control_flow", "other")}
        assert shares["matmul"] > 0, shares
        assert shares["other"] < 0.2, shares  # kernels and ops are recognised, not left uncategorised
        # The ops read as matmuls are GEMMs of the compiled step (Triton GEMM fusions or cuBLAS calls, read from the
        # HLO text here, not through jaxscale.measure.hlo), also from inside XLA's CUDA graphs. Not all of them by
        # name: XLA compiles identical fusions once (the unrolled layers' GEMMs) and the trace names the kernel after
        # the first (seen on an H200: bf16_noscan's read set was a subset), so every name read must be one of them.
        run_dir = pathlib.Path(row["trace_ops_csv"]).parent
        hlo_text = gzip.open(run_dir / traces.HLO_FILE, "rt").read()
        gemms = set(re.findall(r"%(\S+) = .*(?:custom_call_target=\"__cublas|\"kind\":\"__triton\w*gemm)", hlo_text))
        with open(row["trace_ops_csv"]) as handle:
            read = {op["op"] for op in csv.DictReader(handle) if op["category"] == "matmul"}
        assert read and {traces.kernel_name(op) for op in read} <= {traces.kernel_name(g) for g in gemms}
    assert rows["bf16"]["trace_dus_share"] > rows["bf16_noscan"]["trace_dus_share"]

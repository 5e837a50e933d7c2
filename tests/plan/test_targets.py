"""GPU target table: every target renders a text proto XLA accepts, with its device_kind and memory."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from jaxscale.plan import gpu_plan, targets

REQUIRED = ("a5000", "a100-40gb", "a100-80gb", "h100", "h200", "l4", "rtx4090")


def test_the_required_targets_exist_with_sources():
    for name in REQUIRED:
        target = targets.get_target(name)
        assert target.source, f"{name} records no source for its figures"
        assert target.device_kind.startswith("NVIDIA ")


@pytest.mark.parametrize("name", REQUIRED)
def test_text_proto_carries_the_targets_figures(name):
    target = targets.TARGETS[name]
    text = targets.target_config_text(target)
    assert f"device_memory_size: {target.device_memory_size}\n" in text
    assert f"core_count: {target.core_count}\n" in text
    assert f'device_description_str: "{target.device_kind}"' in text
    major, minor = target.compute_capability
    assert f"cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n  }}" in text


def test_zero_device_memory_is_rejected():
    broken = dataclasses.replace(targets.TARGETS["a5000"], device_memory_size=0)
    with pytest.raises(ValueError, match="device_memory_size must be a positive integer"):
        targets.target_config_text(broken)


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(targets.UnknownTargetError) as caught:
        targets.get_target("rtx3090")
    for name in REQUIRED:
        assert name in str(caught.value)


def test_a_users_txtpb_file_round_trips(tmp_path):
    path = tmp_path / "my_gpu.txtpb"
    path.write_text("# my card\n" + targets.target_config_text(targets.TARGETS["l4"]))
    target = targets.get_target(str(path))
    assert target.device_kind == "NVIDIA L4"
    assert target.device_memory_size == targets.TARGETS["l4"].device_memory_size
    assert "# my card" not in targets.target_config_text(target)


def test_a_users_file_without_device_memory_is_rejected(tmp_path):
    path = tmp_path / "no_memory.txtpb"
    path.write_text(targets.target_config_text(targets.TARGETS["l4"]).replace("device_memory_size", "#"))
    with pytest.raises(ValueError, match="device_memory_size"):
        targets.get_target(str(path))


_PROBE = """
import json, sys
from jaxscale.plan import target_compile, targets
kinds = {}
for name, target in targets.TARGETS.items():
    sharding = target_compile.target_sharding(targets.target_config_text(target))
    kinds[name] = next(iter(sharding.mesh.devices.flat)).device_kind
print(json.dumps(kinds))
"""


@pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")
def test_xla_accepts_every_target_and_reports_its_device_kind():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    kinds = json.loads(done.stdout.strip().splitlines()[-1])
    assert kinds == {name: t.device_kind for name, t in targets.TARGETS.items()}


def test_a_device_is_named_after_its_planning_target_or_its_kind():
    assert targets.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert targets.device_slug("NVIDIA RTX A5000") == "a5000"
    assert targets.device_slug("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert targets.device_slug("NVIDIA H100 PCIe") == "h100-pcie"  # no target of its own
    assert targets.device_slug("TPU v5 lite") == "tpu-v5-lite"
    assert targets.target_for_device_kind("NVIDIA H200").name == "h200"
    assert targets.target_for_device_kind("NVIDIA H100 PCIe") is None


# GPUs per NVLink domain, from the datasheets: the RTX A5000's bridge joins 2; DGX/HGX A100, H100 and H200
# baseboards join 8 SXM GPUs through NVSwitch; the L4 and RTX 4090 have no NVLink.
NVLINK_DOMAINS = {"a5000": 2, "a100-40gb": 8, "a100-80gb": 8, "h100": 8, "h100-96gb-500w": 8, "h200": 8, "l4": None,
                  "rtx4090": None}  # fmt: skip


@pytest.mark.parametrize("name", NVLINK_DOMAINS)
def test_each_target_knows_how_many_gpus_its_nvlink_joins_and_cites_it(name):
    target = targets.TARGETS[name]
    assert target.nvlink_domain == NVLINK_DOMAINS[name]
    if target.nvlink_domain is None:
        assert target.nvlink_bandwidth is None and "no NVLink" in target.interconnect_source
    else:
        assert f"NVLink domain of {target.nvlink_domain}" in target.interconnect_source


def test_nvlink_bandwidth_without_its_domain_is_rejected():
    broken = dataclasses.replace(targets.TARGETS["a5000"], nvlink_domain=None)
    with pytest.raises(ValueError, match="nvlink_bandwidth and nvlink_domain"):
        broken.validate()


def test_no_target_points_at_a_local_file_outside_the_project():
    """A user's clone has no shared/ workspace: sources cite datasheets and public repositories only."""
    for target in targets.TARGETS.values():
        assert "shared/" not in target.source + target.interconnect_source, target.name


def test_the_docs_table_of_targets_lists_every_target_with_its_fields():
    """docs/gpu_planning.md's table against targets.TARGETS: every target, its compute capability, SMs, memory bytes,
    bandwidth (GB/s, rounded down), L2 (MiB) and clock."""
    from conftest import doc_table

    rows = {row[0].strip("`"): row for row in doc_table("gpu_planning.md", "| `--target` |")}
    assert set(rows) == set(targets.TARGETS)
    for name, target in targets.TARGETS.items():
        _, _, cc, sms, memory, bandwidth, l2, ghz, _ = rows[name]
        assert cc == "{}.{}".format(*target.compute_capability) and int(sms) == target.core_count, name
        assert int(memory.replace(",", "")) == target.device_memory_size, name
        assert int(bandwidth) == target.memory_bandwidth // 10**9 and float(l2) == target.l2_cache_size / 2**20, name
        assert float(ghz) == target.clock_rate_ghz, name


def test_torchtitans_h100_target_holds_the_figures_its_benchmark_publishes():
    """The 96 GB HBM2e H100 at 500 W (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md): its memory and
    bandwidth as quoted, and its compute range from the H100 NVL's dense bf16 peak to the SXM5's, the two datasheet
    figures the benchmark bounds the card's peak by (NVIDIA: 1,671 and 1,979 TFLOP/s with sparsity, halved)."""
    from jaxscale.measure import peaks

    card = targets.TARGETS["h100-96gb-500w"]
    assert "96GB HBM2e with 2.4 TB/sec peak memory bandwidth" in card.source
    assert card.memory_bandwidth == 2.4e12 and card.device_memory_size == 96e9
    assert card.power_limit_w == 500 and "We used the default 500W power limit" in card.compute_scale_source
    assert "the actual peak TFLOPs number is between SXM and NVL" in card.compute_scale_source
    nvl, sxm = peaks.find_peak("NVIDIA H100 NVL").bfloat16, peaks.find_peak("NVIDIA H100 80GB HBM3").bfloat16
    assert nvl == pytest.approx(1671e12 / 2, rel=1e-3) and sxm == pytest.approx(1979e12 / 2, rel=1e-3)
    assert card.compute_scale == (nvl / sxm, 1.0)
    assert targets.TARGETS["h100"].compute_scale == (1.0, 1.0) and targets.TARGETS["h100"].power_limit_w is None


def test_a_power_limited_card_slows_compute_by_the_middle_of_its_range_and_memory_by_its_bandwidth():
    """Hand count on one compute-bound GEMM and one memory-bound fusion: on the 96 GB H100 at 500 W the GEMM takes the
    80 GB H100's time over the middle of (835.5 / 989.4, 1), the fusion its time x 3.35232 / 2.4 (the bandwidths)."""
    from jaxscale.measure import kernels
    from jaxscale.plan import predict

    gemm = kernels.Kernel(name="dot", category="matmul", detail="gemm", trips=(), times=1, flops=2 * 8192**3,
                          flop_dtype="bf16", bytes_read=2 * 2 * 8192**2, bytes_written=2 * 8192**2,
                          gemm=(1, 8192, 8192, 8192))  # fmt: skip
    fusion = kernels.Kernel(name="add", category="fusion", detail="loop", trips=(), times=1, flops=2**20,
                            flop_dtype="vector", bytes_read=2**30, bytes_written=2**30)  # fmt: skip
    full = predict.gpu_roofline(targets.TARGETS["h100"])
    capped = predict.gpu_roofline(targets.TARGETS["h100-96gb-500w"])
    middle = (835.5 / 989.4 + 1) / 2
    assert predict.kernel_seconds(gemm, capped)[0] == pytest.approx(predict.kernel_seconds(gemm, full)[0] / middle)
    assert predict.kernel_seconds(fusion, capped)[0] == pytest.approx(
        predict.kernel_seconds(fusion, full)[0] * 3_352_320_000_000 / 2.4e12)

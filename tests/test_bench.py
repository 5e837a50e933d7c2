"""python -m jaxscale.bench on a tiny setting: it runs and writes the table (a smoke test, not a timing)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_cli

from jaxscale import bench


def test_bench_writes_a_markdown_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSCALE_CACHE_DIR", str(tmp_path / "cache"))  # keep the user's roofline cache
    output = tmp_path / "bench.md"
    code = bench.main(
        [
            "bench",
            "--preset=tiny",
            "--variants=bf16_noscan",
            "--steps=2",
            "--matmul_size=128",
            "--set=model.dropout_rate=0.0",
            f"--configs_dir={REPO / 'configs'}",
            f"--output={output}",
            f"--trace_root={tmp_path / 'traces'}",
        ]
    )
    assert code == 0
    text = output.read_text()
    assert text in capsys.readouterr().out  # printed as well as saved
    assert "| float32 |" in text and "| bfloat16 |" in text  # the matmul rooflines
    row = [line for line in text.splitlines() if line.startswith("| bf16_noscan |")]
    assert len(row) == 1 and "%" in row[0]  # MFU and runner overhead
    assert list((tmp_path / "traces").glob("*/ops.csv"))
    assert "overrides: model.dropout_rate=0.0" in text
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["config.model.dropout_rate"] == 0.0
    # One MFU: the saved row's is the table's, against the session's best roofline of its dtype.
    roofline = next(line for line in text.splitlines() if line.startswith("| bfloat16 |")).split("|")[2]
    assert rows[0]["peak_flops_per_s"] / 1e9 == pytest.approx(float(roofline), abs=0.05)
    assert rows[0]["mfu"] == pytest.approx(rows[0]["achieved_model_flops_per_s"] / rows[0]["peak_flops_per_s"])
    assert f"| {rows[0]['mfu']:.1%} |" in row[0]


def test_bench_rejects_an_unknown_variant_and_preset(tmp_path):
    proc = run_cli("jaxscale.bench", "--preset=tiny", "--variants=no_such_config", f"--output={tmp_path / 'b.md'}")
    assert proc.returncode == 2  # as a user sees it: one line, no traceback
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxscale: error: --variants:")
    assert "Traceback" not in proc.stderr
    assert bench.main(["bench", "--preset=huge"]) == 2
    assert bench.main(["bench", "--preset=tiny", "--set=model.no_such_field=3"]) == 2
    assert not (tmp_path / "b.md").exists()

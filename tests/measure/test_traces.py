"""jaxscale.traces on traces captured here: step time against the wall clock, dynamic-update-slice share of
scanned vs unrolled layers, remat share, ops.csv and the command line."""

from __future__ import annotations

import csv
import pathlib

import pytest
from conftest import load_config

from jaxscale import run
from jaxscale.measure import flops, hlo, traces


def _row(name: str, tmp: pathlib.Path) -> dict:
    config = load_config(name)
    # Ops of a few milliseconds, so that the profiler's cost per op event stays small beside them.
    config.model.update(hidden_size=256, head_dim=64, max_seq_len=128)
    config.data.update(seq_len=128, batch_size=16)
    config.train.update(steps=4, warmup_steps=1)
    config.profile.steps = 3
    row = run.run(config, tmp / name, name, progress=False)
    assert row["status"] == "ok", row["error"]
    return row


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as patch:  # MFU is not under test here: skip measuring a roofline
        patch.setattr(flops.peaks, "resolve_peak", lambda dtype, device=None: (None, "not measured in this test"))
        return {name: _row(name, tmp) for name in ("bf16", "bf16_noscan")}


def test_scanned_layers_spend_more_time_in_dynamic_update_slice_than_unrolled(rows):
    scanned, unrolled = rows["bf16"]["trace_dus_share"], rows["bf16_noscan"]["trace_dus_share"]
    assert scanned > 0.02 and scanned > 3 * unrolled  # the notebook's finding: stacking residuals costs copies


def test_trace_step_time_is_close_to_the_wall_clock(rows):
    for name, row in rows.items():
        assert row["trace_steps"] == 3, name
        assert row["trace_step_s"] == pytest.approx(row["step_s_median"], rel=0.35), name


def test_shares_cover_the_op_time(rows):
    for row in rows.values():
        shares = [
            row[f"trace_{c}_share"] for c in ("matmul", "fusion", "dus", "copy", "control_flow", "collective", "other")
        ]
        assert sum(shares) == pytest.approx(1.0)
        assert row["trace_matmul_share"] > 0.05
        assert row["trace_remat_share"] == 0  # no remat here (the flag itself: tests/test_flops.py)


def test_ops_csv_beside_the_trace(rows):
    path = pathlib.Path(rows["bf16"]["trace_ops_csv"])
    assert path.parent == pathlib.Path(rows["bf16"]["trace_dir"])
    with open(path) as handle:
        ops = list(csv.DictReader(handle))
    assert ops and {op["category"] for op in ops} <= set(hlo.CATEGORIES)
    times = [float(op["self_s_per_step"]) for op in ops]
    assert times == sorted(times, reverse=True)


def test_command_line_summarises_a_run_directory(rows, capsys):
    assert traces.main(["traces", rows["bf16_noscan"]["trace_dir"], "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "trace_step_s" in out and "trace_matmul_share" in out
    assert traces.main(["traces", "/nonexistent/run"]) == 2
    assert "jaxscale: error: RUN_DIR" in capsys.readouterr().err

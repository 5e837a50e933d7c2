"""jaxscale.report.frontier_report: the frontier's figure joins exactly the rows on the frontier and names what it
cannot draw; the docs table holds the rows' numbers in walk order."""

from __future__ import annotations

import json

import pandas as pd

from jaxscale.report import frontier_report

GIB = 2**30


def _rows() -> list[dict]:
    """A made-up walk: step 1 is beaten by step 0 (as large, faster), step 3 fits nothing."""
    made = [(0, "all remat", 4, 1000.0, True), (1, "a=offload", 4, 900.0, False), (2, "a=device", 3, 1200.0, True),
            (3, "a=device, b=device", None, None, False)]  # fmt: skip
    return [
        {"variant": f"p{step}", "frontier_step": step, "frontier_policy": policy, "fit_largest_minibatch": largest,
         "status": "ok", "predicted_tokens_per_s": speed, "predicted_step_s": 0.5 if speed else None, "frontier_on": on,
         "frontier_fastest": step == 2, "compiled_peak_bytes": (10 + step) * GIB, "plan_fits": largest is not None,
         "fit_compiles": 2, "frontier_policies": 7, "frontier_stopped": "policy 3 fits no minibatch",
         "frontier_order": ["a", "b"]}
        for step, policy, largest, speed, on in made
    ]  # fmt: skip


def test_the_figure_joins_the_frontier_points_and_stars_the_fastest():
    figure = frontier_report.plot_frontier(pd.DataFrame(_rows()))
    ax = figure.axes[0]
    (line,) = ax.lines
    assert list(line.get_xdata()) == [3, 4] and list(line.get_ydata()) == [1200.0, 1000.0]  # by minibatch
    starred = ax.collections[-1].get_offsets()
    assert [tuple(point) for point in starred] == [(3.0, 1200.0)]
    assert "plan, not measured" in figure.get_suptitle()


def test_the_figure_names_what_it_cannot_draw():
    figure = frontier_report.plot_frontier(pd.DataFrame([{"variant": "block", "status": "ok"}]))
    assert "not drawn: the rows lack" in figure.axes[0].texts[0].get_text()


def test_the_docs_table_holds_the_rows_in_walk_order(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in reversed(_rows())))
    lines = frontier_report.frontier_table(path).splitlines()
    assert lines[2] == "| 0 | all remat | 4 (10.00) | 0.500 | 1,000 | yes |"
    assert lines[4] == "| 2 | `a=device` | 3 (12.00) | 0.500 | 1,200 | **yes, the fastest** |"
    assert lines[5] == "| 3 | `a=device, b=device` | none (minibatch 1 plans 13.00: XLA's limit) | – | – | no |"
    assert lines[-1].startswith("Walk: 4 of 7 policies searched (8 probes); stopped: policy 3 fits no minibatch")

"""The docs' generated tables (`python -m jaxscale.report.docs_tables`): the docs hold what the command writes from
the committed rows, --check names a stale table, and a table's cells are the rows' figures."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from jaxscale.report import docs_tables

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_every_docs_table_is_what_the_command_writes_from_the_committed_rows():
    _, stale = docs_tables.updated_docs()
    assert not stale, f"stale docs tables {stale}: run python -m jaxscale.report.docs_tables"


@pytest.fixture
def root(tmp_path) -> pathlib.Path:
    """A repository of the docs with tables (copied) and the committed rows and sweep files (linked)."""
    (tmp_path / "docs").mkdir()
    for doc in {table.doc for table in docs_tables.TABLES}:
        shutil.copy(REPO / doc, tmp_path / doc)
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    return tmp_path


def test_check_names_the_stale_table_exits_1_and_the_command_rewrites_it(root, capsys):
    mesh = root / "docs" / "mesh.md"
    text = mesh.read_text()
    block = text.index("<!-- table:layouts-8xh100 -->")
    row = text.index("| fsdp_whole (", block)
    cell = text.index(" | ", text.index(" | ", row + 1) + 1) + 3  # the plan GiB cell of fsdp_whole
    mesh.write_text(text[:cell] + "1" + text[cell:])  # one digit more in one cell
    assert docs_tables.main(["docs_tables", "--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "docs/mesh.md: table layouts-8xh100 is stale" in out, out
    assert docs_tables.main(["docs_tables", "--root", str(root)]) == 0
    assert mesh.read_text() == text
    assert docs_tables.main(["docs_tables", "--check", "--root", str(root)]) == 0


def test_missing_markers_or_docs_are_one_line_exit_2_and_nothing_is_written(root, tmp_path, capsys):
    mesh, published = root / "docs" / "mesh.md", root / "docs" / "published.md"
    published.write_text(published.read_text().replace("| 0.", "| 9.", 1))  # stale, so a write would change it
    before = published.read_text()
    mesh.write_text(mesh.read_text().replace("<!-- /table:mesh-cpu -->\n", ""))
    assert docs_tables.main(["docs_tables", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxscale: error: docs/mesh.md: holds 0 '<!-- table:mesh-cpu -->")
    assert published.read_text() == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert docs_tables.main(["docs_tables", "--check", "--root", str(empty)]) == 2
    assert capsys.readouterr().err.startswith(f"jaxscale: error: --root: {empty} has no docs/mesh.md")


def _cells(table: str) -> list[list[str]]:
    """The body cells (bold marks stripped) of docs/mesh.md's table between the markers of `table`."""
    text = (REPO / "docs" / "mesh.md").read_text()
    block = text.split(f"<!-- table:{table} -->\n")[1].split(f"<!-- /table:{table} -->")[0]
    return [[cell.strip().strip("*") for cell in line.strip("|").split("|")] for line in block.splitlines()[2:]]


def _rows(name: str) -> dict[str, dict]:
    path = REPO / "experiments" / "results" / name / "results.jsonl"
    return {row["variant"]: row for row in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("index, name", [(0, "layouts_llama3.1-8b_plan_h100_triton_x8"),
                                         (1, "layouts_x64_llama3.1-8b_plan_h100_triton_x64")])  # fmt: skip
def test_the_layout_tables_show_each_committed_row_and_its_fastest_fit(index, name):
    """Read back from the doc: one line per committed variant with its peak and fit; the answer is the fitting row
    with the most predicted tokens/s per GPU (the row's own predicted_tokens_per_s over its plan's GPUs)."""
    rows = _rows(name)
    table = _cells(f"layouts-{8 if index == 0 else 64}xh100")
    assert sorted(line[0].split(" (")[0] for line in table) == sorted(rows)
    for line in table:
        row = rows[line[0].split(" (")[0]]
        assert float(line[2]) == pytest.approx(row["compiled_peak_bytes"] / 1024**3, abs=0.005)
        assert line[4] == ("yes" if row["plan_fits"] else "no")
    fits = {variant: row for variant, row in rows.items() if row["plan_fits"]}
    best = max(fits, key=lambda variant: fits[variant]["predicted_tokens_per_s"] / fits[variant]["plan_devices"])
    answer = _cells("layout-answers")[index]
    assert answer[0] == str(rows[best]["plan_devices"]) and answer[1] == f"`{best}`"
    assert sorted(answer[4].replace("`", "").split(", ")) == sorted(set(rows) - set(fits))


def test_the_long_context_answers_are_the_largest_fitting_sequence_of_each_layout():
    rows = _rows("long_context_llama3.1-8b_plan_h100_triton_x8")
    largest: dict[str, int] = {}
    for variant, row in rows.items():  # variants are <layout>_<sequence>, e.g. fsdp4_cp2_64k
        if row["plan_fits"]:
            layout = variant.rsplit("_", 1)[0]
            largest[layout] = max(largest.get(layout, 0), row["config.data.seq_len"])
    shown = {line[0].strip("`"): int(line[1].replace(",", "")) for line in _cells("long-context-answers")}
    assert shown == largest


def _doc_cells(doc: str, table: str) -> list[list[str]]:
    """The body cells (bold marks stripped) of a doc's table between the markers of `table`."""
    text = (REPO / "docs" / doc).read_text()
    block = text.split(f"<!-- table:{table} -->\n")[1].split(f"<!-- /table:{table} -->")[0]
    return [[cell.strip().strip("*") for cell in line.strip("|").split("|")] for line in block.splitlines()[2:]]


def test_the_notebook_table_shows_the_sweep_files_notebook_steps_and_their_ratio():
    """The notebook's steps come from the sweep file (NOTEBOOK_STEP_S), not the rows the table is written from;
    the ratio column is the shown predicted step over the shown notebook step, to its rounding."""
    import runpy

    notebook = runpy.run_path(str(REPO / "experiments" / "seed_table.py"))["NOTEBOOK_STEP_S"]["seed"]
    lines = _doc_cells("predict.md", "notebook-a5000")
    timed = {line[0]: line for line in lines if line[1] != "not timed"}
    assert {name: float(line[1]) for name, line in timed.items()} == notebook
    for line in timed.values():
        assert float(line[3]) == pytest.approx(float(line[2]) / float(line[1]), abs=0.005 + 0.0005 / float(line[1]))


def test_the_xla_limit_column_is_the_limit_xlas_refusals_name():
    """The A5000 / L4 Adam fits refuse every choice; each row's error quotes XLA's limit in bytes."""
    import re

    limits = []
    for gpu in ("a5000", "l4"):
        path = REPO / "experiments" / "results" / f"fit_bf16_remat_llama3.2-1b_{gpu}" / "results.jsonl"
        errors = [json.loads(line)["error"] for line in path.read_text().splitlines()]
        quoted = {int(re.search(r"its limit of (\d+) bytes", error).group(1)) for error in errors}
        assert len(quoted) == 1
        limits.append(f"{quoted.pop() / 2**30:.2f}")
    adam = [line for line in _doc_cells("models.md", "fit-llama3.2-1b") if line[0] == "Adam"]
    assert adam and {line[4] for line in adam} == {" / ".join(limits)}

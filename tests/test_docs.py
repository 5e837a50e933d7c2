"""User-facing text points only inside the repository: a user's clone has no project workspace beside it.

Scanned: README.md, docs/**/*.md, experiments/*.md and notebooks, and every string literal (docstrings,
messages, help texts, row values) of the Python files under jaxscale/, configs/ and experiments/.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest
from conftest import REPO

# Paths of the workspace the project was built in, which a clone does not have.
OUTSIDE = ("../shared", "shared/DESIGN", "shared/gpu_targets", "/work/", "project workspace")


def outside_references(text: str) -> list[str]:
    """The references in `text` to something outside the repository (a DESIGN.md only if the repo has none)."""
    found = [pattern for pattern in OUTSIDE if pattern in text]
    if not (REPO / "DESIGN.md").exists():
        found += re.findall(r"\bDESIGN\.md\b", text)
    return found


def python_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in a Python file, f-strings' literal parts included."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]  # fmt: skip


def notebook_text(path: pathlib.Path) -> str:
    """The cells' sources and the outputs' text of a notebook."""
    cells = json.loads(path.read_text())["cells"]
    parts = []
    for cell in cells:
        parts.append("".join(cell.get("source", [])))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", [])))
            parts += ["".join(v) if isinstance(v, list) else str(v) for v in output.get("data", {}).values()]
    return "\n".join(parts)


def user_facing_files() -> list[pathlib.Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    files += sorted((REPO / "experiments").glob("*.md")) + sorted((REPO / "experiments").glob("*.ipynb"))
    files += sorted((REPO / "jaxscale").rglob("*.py")) + sorted((REPO / "configs").glob("*.py"))
    files += sorted((REPO / "experiments" / "results").rglob("*.jsonl"))  # curated rows the docs cite
    files += sorted((REPO / "experiments" / "results").rglob("*.md"))
    return files + sorted((REPO / "experiments").glob("*.py"))


def findings(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    """`file:line: reference` for each outside reference in a file (named relative to `root`)."""
    where = path.relative_to(root)
    if path.suffix == ".py":
        return [f"{where}:{line}: {ref}" for line, text in python_strings(path) for ref in outside_references(text)]
    if path.suffix == ".ipynb":
        return [f"{where}: {ref}" for ref in outside_references(notebook_text(path))]
    lines = path.read_text().splitlines()
    return [f"{where}:{i}: {ref}" for i, line in enumerate(lines, 1) for ref in outside_references(line)]


def test_the_scan_covers_the_docs_the_code_and_the_notebook():
    names = {str(path.relative_to(REPO)) for path in user_facing_files()}
    assert {"README.md", "docs/architecture.md", "experiments/README.md", "experiments/compare_sweeps.ipynb"} <= names
    assert {"jaxscale/plan/targets.py", "jaxscale/cli.py", "configs/bf16_remat.py"} <= names
    assert "experiments/results/fit_bf16_remat_seed_a5000/results.jsonl" in names  # committed rows too


def test_user_facing_text_points_only_inside_the_repository():
    found = [finding for path in user_facing_files() for finding in findings(path)]
    assert not found, "references outside the repository (move what they point to into docs/):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    ["see `../shared/DESIGN.md` in the project workspace", "as in shared/gpu_targets/a5000.txtpb",
     "/work/wt/x/experiments/results/data", "(DESIGN.md's recipe)"],
)  # fmt: skip
def test_the_scan_catches_a_reference_in_markdown_python_and_a_notebook(tmp_path, text):
    markdown = tmp_path / "page.md"
    markdown.write_text(f"# A page\n\nFine text.\n{text}\n")
    assert findings(markdown, tmp_path) and findings(markdown, tmp_path)[0].startswith("page.md:4: ")
    source = tmp_path / "module.py"
    source.write_text(f'"""Doc."""\n\nX = 1  # {text}: a comment is not user-facing\nMESSAGE = f"{{X}} {text}"\n')
    assert {f.split(": ")[0] for f in findings(source, tmp_path)} == {"module.py:4"}  # the string, not the comment
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": ["ok\n", text]}]}))
    assert findings(notebook, tmp_path)


def test_in_repository_references_pass():
    assert outside_references("see docs/architecture.md and experiments/results/input_pipeline_cpu/") == []
    assert outside_references("python -m jaxscale.run --config configs/bf16_remat.py:cpu") == []

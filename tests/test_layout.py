"""The package's floors: a module imports from its own floor or below, never above, and no modules import each other,
directly or round a cycle (see README, Layout)."""

from __future__ import annotations

import ast
import pathlib

import jaxscale

PACKAGE = pathlib.Path(jaxscale.__file__).resolve().parent

# Bottom up. A module is placed by its longest matching prefix; the package root's __init__/__main__ sit on top.
FLOORS: dict[str, int] = {
    "jaxscale._env": 0,
    "jaxscale.config": 0,
    "jaxscale.cli": 0,
    "jaxscale.compile_cache": 0,
    "jaxscale.hosts": 0,
    "jaxscale.measure": 0,
    "jaxscale.model": 1,
    "jaxscale.train": 2,
    "jaxscale.data": 2,
    "jaxscale.plan": 3,
    "jaxscale.run": 4,
    "jaxscale.run_checks": 4,
    "jaxscale.run_row": 4,
    "jaxscale.run_steps": 4,
    "jaxscale.run_summary": 4,
    "jaxscale.sweep": 5,
    "jaxscale.bench": 6,
    "jaxscale.fit": 6,
    "jaxscale.published": 6,
    "jaxscale.report": 6,
    "jaxscale.tensorboard": 6,
    "jaxscale": 7,
}


def floor(module: str) -> int:
    """The floor of a dotted module name (its longest prefix in FLOORS)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in FLOORS:
            return FLOORS[prefix]
    raise AssertionError(f"{module} has no floor; add it to FLOORS")


def module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every jaxscale module a file imports (`from jaxscale.x import y` counts y when it is a submodule)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("jaxscale")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxscale"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / sub.replace(".", "/")
                ).is_dir()
                found.append(sub if is_module else node.module)
    return found


def test_imports_point_down_only():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30  # the walk sees the subpackages
    upward = []
    for path in files:
        name = module_name(path)
        if name in ("jaxscale", "jaxscale.__main__"):
            continue
        for imported in imported_modules(path):
            if floor(imported) > floor(name):
                upward.append(f"{name} (floor {floor(name)}) imports {imported} (floor {floor(imported)})")
    assert not upward, "\n".join(upward)


def import_graph(files: list[pathlib.Path]) -> dict[str, set[str]]:
    """module -> the jaxscale modules it imports (imported_modules: every import in the file, those under
    `if TYPE_CHECKING:` and inside functions too), for the modules of `files`."""
    return {module_name(path): set(imported_modules(path)) for path in files}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module, or one that imports itself (Tarjan's
    algorithm, iterative): each a set of modules that import each other, directly or round a cycle.

    Args:
      graph: module -> the modules it imports (those not in the graph are left out).

    Returns:
      Each cycle's modules, sorted; the cycles sorted.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]  # the depth-first path: a module and its imports left to visit
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, imports = work[-1]
            for imported in imports:
                if imported not in graph:
                    continue
                if imported not in index:
                    index[imported] = low[imported] = len(index)
                    stack.append(imported)
                    work.append((imported, iter(sorted(graph[imported]))))
                    break
                if imported in stack:
                    low[module] = min(low[module], index[imported])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = stack[stack.index(module) :]
                    del stack[stack.index(module) :]
                    if len(component) > 1 or module in graph[module]:
                        cycles.append(sorted(component))
    return sorted(cycles)


def test_no_modules_import_each_other():
    # A cycle is one concern split over two rooms (jaxscale.measure.memory and moe_memory imported each other, one
    # way under TYPE_CHECKING): each concern in one module, its imports pointing down. The package's __init__ files
    # count too: `from jaxscale.config import X` imports jaxscale/config/__init__.py and what it imports.
    cycles = import_cycles(import_graph(sorted(PACKAGE.rglob("*.py"))))
    assert not cycles, "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_cycle_check_catches_modules_that_import_each_other(tmp_path):
    # The check itself can fail: memory and moe_memory as they were (one import only for type hints), three modules
    # round a cycle, and one importing itself are flagged; a module that imports a cycle's without being imported
    # back is not.
    type_hints = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from jaxscale.measure.memory import Dims\n"
    sources = {
        "memory": "from jaxscale.measure import moe_memory\n",
        "moe_memory": type_hints,
        "a": "import jaxscale.measure.b\n",
        "b": "import jaxscale.measure.c\n",
        "c": "import jaxscale.measure.a\nfrom jaxscale.measure import memory\n",
        "itself": "import jaxscale.measure.itself\n",
    }
    graph = {}
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        graph[f"jaxscale.measure.{name}"] = set(imported_modules(tmp_path / f"{name}.py"))
    assert graph["jaxscale.measure.moe_memory"] == {"jaxscale.measure.memory"}  # counted under TYPE_CHECKING too
    assert import_cycles(graph) == [
        ["jaxscale.measure.a", "jaxscale.measure.b", "jaxscale.measure.c"],
        ["jaxscale.measure.itself"],
        ["jaxscale.measure.memory", "jaxscale.measure.moe_memory"],
    ]
    del graph["jaxscale.measure.itself"]
    graph["jaxscale.measure.moe_memory"] = set()  # the cut this package made: the sizes in a module of their own
    graph["jaxscale.measure.b"] = set()
    assert import_cycles(graph) == []


def test_every_module_has_a_floor_and_a_docstring():
    for path in PACKAGE.rglob("*.py"):
        floor(module_name(path))
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no module docstring"


def test_floor_check_catches_an_upward_import(tmp_path):
    # The check itself can fail: a measurement module importing the sweep runner would be flagged.
    source = tmp_path / "flops.py"
    source.write_text("from jaxscale.sweep import runner\nfrom jaxscale.measure.hlo import parse\n")
    imported = imported_modules(source)
    assert imported == ["jaxscale.sweep.runner", "jaxscale.measure.hlo"]
    assert floor(imported[0]) > floor("jaxscale.measure.flops") == floor(imported[1])


def test_every_module_is_under_600_lines():
    # docs/architecture.md: files under about 400 lines, a few longer, none reaching 600 (run.py had 601 before it
    # was split by concern).
    lengths = {path.relative_to(PACKAGE): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    long = [f"{path}: {n} lines" for path, n in lengths.items() if n >= 600]
    assert not long, long

"""--help on every entry point (usage, what it does, examples, every flag with its default), and
--show_config: a config's fields with their current values and their descriptions from jaxscale/config/defaults.py.

The entry points are found in the package's files, not listed by hand: every module `python -m` can run (a
package's `__main__.py`, or a module with an `if __name__ == "__main__":` guard)."""

from __future__ import annotations

import ast
import dataclasses
import runpy
import sys
import warnings

import pytest
from absl import flags
from conftest import REPO, run_cli

from jaxscale import cli, run
from jaxscale.config import base_config, field_comments, flatten
from jaxscale.sweep import runner

_NO_LITERAL = object()


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either way round)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.comparators) != 1:
        return False
    sides = {ast.unparse(node.test.left), ast.unparse(node.test.comparators[0])}
    return isinstance(node.test.ops[0], ast.Eq) and sides == {"__name__", "'__main__'"}


def _main_source(module: str, tree: ast.Module) -> str:
    """The module whose main() `python -m module` runs: itself, or the one its main is imported from."""
    if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
        return module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(alias.name == "main" for alias in node.names):
            return node.module
    return module


def find_entry_points() -> dict[str, str]:
    """{module that `python -m` runs: the module defining the main() it calls}, from jaxscale/**/*.py."""
    found = {}
    for path in sorted((REPO / "jaxscale").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parts = path.relative_to(REPO).with_suffix("").parts
        if path.name == "__main__.py":
            module = ".".join(parts[:-1])
            found[module] = _main_source(f"{module}.__main__", tree)
        elif path.name != "__init__.py" and any(_is_main_guard(node) for node in tree.body):
            found[".".join(parts)] = _main_source(".".join(parts), tree)
    return found


ENTRY_POINTS = find_entry_points()


def _same_command(module: str) -> set[str]:
    """The entry points that run the same main (`python -m jaxscale` runs jaxscale.run's): any may be shown."""
    return {other for other, source in ENTRY_POINTS.items() if source == ENTRY_POINTS[module]}


def test_entry_points_are_found_in_the_package_files():
    """The walk finds both kinds; the commands the README and docs name are among them."""
    named = {"jaxscale", "jaxscale.run", "jaxscale.sweep", "jaxscale.report", "jaxscale.fit", "jaxscale.bench"}
    named |= {"jaxscale.tensorboard", "jaxscale.measure.traces", "jaxscale.data", "jaxscale.plan.target_compile"}
    assert named <= set(ENTRY_POINTS), sorted(named - set(ENTRY_POINTS))
    assert ENTRY_POINTS["jaxscale"] == "jaxscale.run" and ENTRY_POINTS["jaxscale.report"] == "jaxscale.report.markdown"
    assert ENTRY_POINTS["jaxscale.fit"] == "jaxscale.fit" and ENTRY_POINTS["jaxscale.data"] == "jaxscale.data.__main__"
    assert "jaxscale.cli" not in ENTRY_POINTS and "jaxscale.config" not in ENTRY_POINTS  # no guard: not runnable
    # A package's __main__ is the door to its main module, which keeps no guard of its own: its package imports
    # it first, so `python -m jaxscale.report.markdown` printed runpy's RuntimeWarning before the help.
    assert "jaxscale.report.markdown" not in ENTRY_POINTS and "jaxscale.sweep.runner" not in ENTRY_POINTS


@pytest.mark.parametrize(
    ("text", "expected"),
    [('if __name__ == "__main__":\n    pass', True), ("if '__main__' == __name__:\n    pass", True),
     ('if __name__ != "__main__":\n    pass', False), ('if name == "__main__":\n    pass', False)],
)  # fmt: skip
def test_main_guard_is_recognized_either_way_round(text, expected):
    assert _is_main_guard(ast.parse(text).body[0]) is expected


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_from_a_real_process(module):
    for asked in ("--help", "-h") if module == "jaxscale.fit" else ("--help",):  # fit: the review's case, both
        proc = run_cli(module, asked, timeout=120)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-500:]  # nothing before the lab's output
        usage = proc.stdout.splitlines()[0]
        shown = next((m for m in _same_command(module) if usage.startswith(f"usage: python -m {m} ")), None)
        assert shown is not None, usage
        assert "\nexamples:\n  python -m " + shown in proc.stdout
        assert ("\nflags:\n" in proc.stdout or "\noptions:\n" in proc.stdout) and "-h, --help" in proc.stdout


def _literal(node: ast.expr | None) -> object:
    try:
        return _NO_LITERAL if node is None else ast.literal_eval(node)
    except ValueError:  # a name, a call, an f-string: not known from the source alone
        return _NO_LITERAL


def _argument(call: ast.Call, keyword: str, index: int | None = None) -> object:
    """The literal value of a call's argument (by keyword, or at a position), or _NO_LITERAL."""
    found = [k.value for k in call.keywords if k.arg == keyword]
    if not found and index is not None and len(call.args) > index:
        found = [call.args[index]]
    return _literal(found[0]) if found else _NO_LITERAL


@dataclasses.dataclass
class DefinedFlag:
    name: str
    kind: str  # absl | alias | argparse
    default: object = _NO_LITERAL  # _NO_LITERAL where the source computes it
    help: object = _NO_LITERAL
    needs_default: bool = True  # argparse: a required flag or a switch shows none


def defined_flags(module: str) -> list[DefinedFlag]:
    """The flags a module defines, read from its source (not from the FlagValues its help is drawn from).

    absl: flags.DEFINE_*(name, default, [enum values,] help), DEFINE_alias, define_config_flag (--config),
    define_cache_flag (--compilation_cache); argparse: add_argument("--name", default=, help=, ...).
    """
    found = []
    for call in ast.walk(ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())):
        if not isinstance(call, ast.Call):
            continue
        function = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        name = _argument(call, "name", 0)
        if function == "DEFINE_alias":
            found.append(DefinedFlag(name, "alias"))
        elif function.startswith("DEFINE_"):
            help_text = _argument(call, "help", 3 if function == "DEFINE_enum" else 2)
            found.append(DefinedFlag(name, "absl", _argument(call, "default", 1), help_text))
        elif function == "define_config_flag":
            found.append(DefinedFlag("config" if name is _NO_LITERAL else name, "absl", None))
        elif function == "define_cache_flag":
            found.append(DefinedFlag("compilation_cache", "absl"))
        elif function == "add_argument" and str(name).startswith("--"):
            switch = _argument(call, "action") in ("store_true", "store_false")
            needs_default = not switch and _argument(call, "required") is not True
            found.append(DefinedFlag(name[2:], "argparse", _NO_LITERAL, _argument(call, "help"), needs_default))
    return found


def _flag_entry(out: str, name: str) -> str | None:
    """A flag's line in the help page and the lines of its help below it (absl: `  --name  (default: ..)`)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        spelled = line.strip().split(" ")[0]
        if line.startswith("  -") and spelled in (f"--{name}", f"--[no]{name}"):
            rest = lines[i + 1 :]
            tail = next(
                (j for j, ln in enumerate(rest) if not ln.startswith("    ") or ln.lstrip().startswith("-")), len(rest)
            )
            return " ".join(" ".join([line, *rest[:tail]]).split())
    return None


def _default_shown(value: object) -> str:
    """How a default reads on the page, by hand: none for None and [], false/true, a string quoted."""
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_lists_every_flag_with_its_default(module, capsys, monkeypatch):
    """In-process, as `python -m` runs it (runpy, the guard included): every flag its source defines, and every
    flag of the FlagValues its help is drawn from, is on the page with its default and the start of its help."""
    pages = []
    monkeypatch.setattr(cli, "help_text", lambda usage, fv, real=cli.help_text: pages.append(fv) or real(usage, fv))
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exited:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before (by this test)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exited.value.code in (0, None)
    out = capsys.readouterr().out
    summary = out.split("\n\n")[1]
    assert summary and not summary.startswith(("examples", "flags", "options"))  # what it does, first
    expected = defined_flags(ENTRY_POINTS[module])
    text = " ".join(out.split())
    for flag in expected:
        entry = _flag_entry(out, flag.name)
        assert entry is not None, (module, flag.name)
        if flag.kind != "alias" and flag.needs_default:
            assert "default" in entry, (module, flag.name, entry)
        if flag.kind == "absl" and flag.default is not _NO_LITERAL:
            assert f"(default: {_default_shown(flag.default)}" in entry, (module, flag.name, entry)
        if isinstance(flag.help, str):
            assert " ".join(flag.help.split()[:3]) in text, (module, flag.name)  # its help text follows
    for fv in pages:  # absl: the FlagValues the page was drawn from holds no flag the page leaves out
        for name in fv:
            assert _flag_entry(out, name) is not None and "(default: " in _flag_entry(out, name), (module, name)
    assert pages or any(flag.kind == "argparse" for flag in expected), module  # the shared page, or argparse's


@pytest.mark.parametrize("main", [run.main, runner.main])
def test_run_and_sweep_help_say_where_config_fields_are_described(main, capsys):
    assert main(["prog", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "jaxscale/config/defaults.py" in text and "--show_config" in text


def test_every_config_field_has_a_description():
    """config.py promises a comment on every field; --show_config prints them."""
    comments = field_comments()
    fields = flatten(base_config("tiny", "x"), prefix="")
    assert set(fields) <= set(comments), sorted(set(fields) - set(comments))
    assert comments["model.hidden_size"] == "width of the residual stream"


def test_show_config_lists_values_after_overrides_and_marks_changes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = ["run", "--config", "configs/bf16_remat.py:tiny", "--config.model.num_layers=3", "--show_config",
            "--output_root", str(tmp_path)]  # fmt: skip
    assert run.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    by_field = {line.split(" = ")[0]: line for line in lines}
    assert set(by_field) == set(flatten(base_config("tiny", "x"), prefix=""))
    layers = by_field["model.num_layers"]
    assert layers.startswith("model.num_layers = 3 ") and "# transformer blocks" in layers and "[base: 2]" in layers
    assert "model.remat = ('MLP', 'Attn')" in by_field["model.remat"] and "[base: ()]" in by_field["model.remat"]
    assert "[base:" not in by_field["model.hidden_size"]  # as the preset has it
    assert not (tmp_path / "traces").exists()  # nothing compiled or written


def test_sweep_show_config_lists_the_base_and_each_variants_overrides(capsys):
    assert runner.main(["sweep", "--config", f"{REPO / 'experiments' / 'seed_table.py'}:tiny", "--show_config"]) == 0
    out = capsys.readouterr().out
    assert "model.scan_layers = True" in out and "# stack the blocks with nn.scan" in out
    assert "  bf16_scan_remat_block: model.dtype=bfloat16, model.scan_layers=True, model.remat=('Block',)" in out


def test_help_is_asked_for_only_before_a_double_dash():
    assert cli.wants_help(["run", "-h"]) and cli.wants_help(["run", "--config", "x.py", "--help"])
    assert not cli.wants_help(["run", "--", "--help"]) and not cli.wants_help(["run", "--config", "help.py"])


def test_one_argument_returns_it_or_says_what_to_give():
    fv = flags.FlagValues()
    flags.DEFINE_integer("top", 15, "How many.", flag_values=fv)
    assert cli.one_argument(fv, ["prog", "runs/a", "--top", "3"], "give one RUN_DIR") == "runs/a" and fv.top == 3
    for argv in (["prog"], ["prog", "runs/a", "runs/b"]):
        with pytest.raises(cli.UsageError, match="^give one RUN_DIR$"):
            cli.one_argument(fv, argv, "give one RUN_DIR")
    with pytest.raises(cli.UsageError, match="top"):
        cli.one_argument(fv, ["prog", "runs/a", "--top=many"], "give one RUN_DIR")


@pytest.mark.parametrize(
    "module, hint",
    [
        ("jaxscale.tensorboard", "use --logdir DIR"),
        ("jaxscale.published", "flags only (--only, --rerun, --runs, --output_root)"),
    ],
)
def test_a_flags_only_command_refuses_a_positional_argument_in_one_line(module, hint, capsys):
    import importlib

    assert importlib.import_module(module).main([module, "stray"]) == 2
    assert capsys.readouterr().err == f"jaxscale: error: unexpected argument 'stray'; {hint}\n"

"""--help on every entry point (usage, what it does, an example, every flag with its default), and
--show_config: a config's fields with their current values and their descriptions from jaxscale/config/defaults.py."""

from __future__ import annotations

import pytest
from absl import flags
from conftest import REPO, run_cli

from jaxscale import bench, cli, run, tensorboard
from jaxscale.config import base_config, field_comments, flatten
from jaxscale.measure import traces
from jaxscale.plan import target_compile
from jaxscale.report import markdown
from jaxscale.sweep import runner

# (module run with python -m, its main, the flags it defines)
ENTRY_POINTS = {
    "jaxscale.run": (run.main, lambda: run._flag_values(["run"])),
    "jaxscale.sweep": (runner.main, runner._flag_values),
    "jaxscale.report": (markdown.main, markdown._flag_values),
    "jaxscale.bench": (bench.main, bench._flag_values),
    "jaxscale.tensorboard": (tensorboard.main, tensorboard._flag_values),
    "jaxscale.measure.traces": (traces.main, traces._flag_values),
}


@pytest.mark.parametrize("module", [*ENTRY_POINTS, "jaxscale"])
def test_help_from_a_real_process(module):
    proc = run_cli(module, "--help", timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""  # exit 0, and nothing before the lab's own output
    shown = "jaxscale.run" if module == "jaxscale" else module
    assert proc.stdout.startswith(f"usage: python -m {shown} ")
    assert "\nexamples:\n  python -m " + shown in proc.stdout
    assert "\nflags:\n" in proc.stdout and "-h, --help" in proc.stdout


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_lists_every_flag_with_its_default(module, capsys):
    main, flag_values = ENTRY_POINTS[module]
    assert main([module, "-h"]) == 0
    out = capsys.readouterr().out
    summary = out.split("\n\n")[1]
    assert summary and not summary.startswith(("examples", "flags"))  # what it does, before the examples
    fv = flag_values()
    for name in fv:
        flag = fv[name]
        spelled = f"--[no]{name}" if flag.flag_type() == "bool" else f"--{name}"
        line = next((ln for ln in out.splitlines() if ln.startswith(f"  {spelled} ")), None)
        assert line is not None and "(default: " in line, (module, name)
        words = [w for w in str(flag.help).split() if not w.startswith("<")]  # absl puts enum choices first
        assert " ".join(words[:3]) in " ".join(out.split()), (module, name)  # its help text follows


@pytest.mark.parametrize("module", ["jaxscale.run", "jaxscale.sweep"])
def test_run_and_sweep_help_say_where_config_fields_are_described(module, capsys):
    main, _ = ENTRY_POINTS[module]
    assert main([module, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "jaxscale/config/defaults.py" in text and "--show_config" in text


def test_target_compile_child_has_help():
    assert target_compile.main(["target_compile", "--help"]) == 0


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

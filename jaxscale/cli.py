"""Command-line plumbing shared by the entry points: config flags, one-line errors and exit codes."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from collections.abc import Sequence

from absl import flags
from ml_collections import config_flags

from jaxscale import compile_cache
from jaxscale.config import ConfigError, check_backend, load_config_file, validate
from jaxscale.config.defaults import UsageError as UsageError  # defined below the command line: config raises it too

EXIT_BAD_INPUT = 2


HELP_FLAGS = ("-h", "--help", "-help", "--helpfull", "--helpshort")
CONFIG_FIELDS_NOTE = (
    "Config fields: every field, with what it means, is in jaxscale/config/defaults.py (base_config); --show_config "
    "lists them for the given config and preset with their current values (after --config.* overrides). "
    "Override any field as --config.GROUP.FIELD=VALUE, e.g. --config.model.remat='(\"Block\",)'."
)


@dataclasses.dataclass(frozen=True)
class Usage:
    """What `--help` prints for one entry point, besides its flags."""

    command: str  # the synopsis, e.g. "python -m jaxscale.report RESULTS_DIR [flags]"
    summary: str  # what it does, one line
    examples: tuple[str, ...]
    notes: tuple[str, ...] = ()  # paragraphs after the flags


def wants_help(argv: Sequence[str] | None) -> bool:
    """Whether the command line asks for help (-h, --help, ...) before any `--`."""
    args = list(sys.argv if argv is None else argv)[1:]
    if "--" in args:
        args = args[: args.index("--")]
    return any(arg in HELP_FLAGS for arg in args)


def _default_text(value: object) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _flag_lines(flag_values: flags.FlagValues) -> list[str]:
    lines = []
    for name in flag_values:
        flag = flag_values[name]
        if flag.name != name:  # a short name of a flag listed under its long one
            continue
        spelled = f"--[no]{name}" if flag.flag_type() == "bool" else f"--{name}"
        choices = getattr(flag.parser, "enum_values", None)
        if choices:
            spelled += f" <{'|'.join(choices)}>"
        text = " ".join(str(flag.help).split())
        if choices:  # absl puts the choices in front of an enum's help; they are shown beside the name
            text = text.removeprefix(f"<{'|'.join(choices)}>: ")
        lines.append(f"  {spelled}  (default: {_default_text(flag.default)})")
        lines += textwrap.wrap(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def help_text(usage: Usage, flag_values: flags.FlagValues) -> str:
    """The `--help` page: usage, the one-line summary, examples, every flag with its default and help, notes."""
    lines = [f"usage: {usage.command}", "", *textwrap.wrap(usage.summary, 104), "", "examples:"]
    lines += [f"  {example}" for example in usage.examples]
    lines += ["", "flags:", *_flag_lines(flag_values), "  -h, --help", "      Show this help and exit."]
    for note in usage.notes:
        lines += ["", *textwrap.wrap(note, 104)]
    return "\n".join(lines)


def print_help(usage: Usage, flag_values: flags.FlagValues) -> int:
    """Prints help_text to stdout; returns exit code 0."""
    print(help_text(usage, flag_values))
    return 0


def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    """Prints `jaxscale: error: <message>` on one line to stderr and returns the exit code."""
    one_line = " ".join(str(message).split())
    print(f"jaxscale: error: {one_line}", file=sys.stderr)
    return code


def define_config_flag(
    flag_values: flags.FlagValues, argv: Sequence[str], name: str = "config", help_text: str = ""
) -> None:
    """Defines --<name> (a config file with an optional :preset) and its --<name>.field overrides.

    The overrides are found in `argv` (not sys.argv), so main(argv) works in-process as well.
    """
    config_flags.DEFINE_config_file(
        name,
        None,
        help_text or "Config file, optionally with a preset: configs/bf16_remat.py:cpu (seed | cpu | tiny).",
        flag_values=flag_values,
        lock_config=True,
        sys_argv=list(argv),
    )


def define_cache_flag(flag_values: flags.FlagValues) -> None:
    """Defines --[no]compilation_cache; its default follows JAXSCALE_COMPILATION_CACHE (on unless 0)."""
    flags.DEFINE_bool(
        "compilation_cache",
        compile_cache.enabled(),
        "Reuse compiled programs: JAX's persistent compilation cache and the GPU-target plan cache, in "
        "$JAXSCALE_CACHE_DIR (default ~/.cache/jaxscale) under xla/ and plans/. --nocompilation_cache "
        "compiles afresh, as does the environment variable JAXSCALE_COMPILATION_CACHE=0; child processes "
        "follow.",
        flag_values=flag_values,
    )


def define_cost_flags(flag_values: flags.FlagValues) -> None:
    """Defines --train_tokens and --gpu_hour_usd: the cost of a whole training at a row's speed
    (jaxscale.plan.cost)."""
    flags.DEFINE_float(
        "train_tokens", None, "Price a whole training of this many tokens (e.g. 15e12) at the row's speed "
        "(measured, else predicted): device-hours, wall-clock days on its devices and, with --gpu_hour_usd, dollars.",
        lower_bound=1.0, flag_values=flag_values,
    )  # fmt: skip
    flags.DEFINE_float(
        "gpu_hour_usd", None, "With --train_tokens: the price of one device-hour in US dollars (e.g. 2).",
        lower_bound=0.0, flag_values=flag_values,
    )  # fmt: skip


def define_calibrate_flag(flag_values: flags.FlagValues) -> None:
    """Defines --calibrate RUN_DIR: predict the step calibrated on a run measured on this device
    (jaxscale.plan.calibrate); the main job and the sweep share it."""
    flags.DEFINE_string(
        "calibrate", None, "A run directory measured on this device with a trace (profile.steps >= 1), e.g. "
        "traces/seed_table_cpu/bf16_scan: fit the predictor's per-group efficiencies and launch cost to its "
        "trace and predict this step with them (the row's prediction_calibrated_on names the run; "
        "docs/predict.md, 'Calibration'). Default: the uncalibrated prediction.", flag_values=flag_values,
    )  # fmt: skip


def check_cost_flags(flag_values: flags.FlagValues) -> None:
    """Raises UsageError for --gpu_hour_usd without --train_tokens (a price with nothing to price)."""
    if flag_values.gpu_hour_usd is not None and flag_values.train_tokens is None:
        raise UsageError("--gpu_hour_usd: prices a whole training; add --train_tokens (e.g. --train_tokens 15e12)")


def parse_flags(flag_values: flags.FlagValues, argv: Sequence[str] | None) -> list[str]:
    """Parses argv (sys.argv when None) into flag_values; returns the positional arguments, program first.

    Raises:
      UsageError: absl's message for an unknown flag or a bad value, on one line.
    """
    try:
        return flag_values(list(sys.argv if argv is None else argv))
    except flags.Error as error:
        raise UsageError(str(error)) from None


def no_arguments(flag_values: flags.FlagValues, argv: Sequence[str] | None, hint: str) -> None:
    """Parses argv into flag_values for a command that takes flags only.

    Raises:
      UsageError: a bad flag (absl's message), or a positional argument: "unexpected argument 'X'; <hint>".
    """
    rest = parse_flags(flag_values, argv)
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r}; {hint}")


def one_argument(flag_values: flags.FlagValues, argv: Sequence[str] | None, hint: str) -> str:
    """Parses argv into flag_values and returns its one positional argument (a directory, a file).

    Args:
      flag_values: the command's flags.
      argv: the command line, program first (sys.argv when None).
      hint: the error when there is not exactly one argument, e.g. "give one RUN_DIR, e.g. ...".
    Raises:
      UsageError: a bad flag (absl's message), or not exactly one positional argument (`hint`).
    """
    rest = parse_flags(flag_values, argv)
    if len(rest) != 2:
        raise UsageError(hint)
    return rest[1]


def config_path(argv: Sequence[str], name: str = "config") -> str | None:
    """The value of --<name> in argv (path[:preset]), or None when it is not given."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def _explain_unknown_field(argv: Sequence[str], name: str) -> str:
    path, _, preset = config_path(argv, name).partition(":")
    config = load_config_file(path, preset)  # without the overrides, to see which one names no field
    for arg in argv:
        if not arg.startswith(f"--{name}."):
            continue
        path = arg[len(name) + 3 :].split("=", 1)[0]
        node, walked = config, []
        for key in path.split("."):
            if not hasattr(node, "keys") or key not in node:
                group = ".".join(walked) or "the config"
                allowed = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(none: not a group)"
                return f"--{name}.{path}: no field {key!r} in {group}; allowed: {allowed}"
            node, walked = node[key], [*walked, key]
    return "an override names an unknown config field"


def _explain(error: Exception, argv: Sequence[str], name: str) -> str:
    text = str(error)
    missing = re.search(r"No such file or directory: '([^']*)'", text)
    if missing:
        return f"--{name}: config file {missing.group(1)!r} not found"
    found = re.search(r"ConfigError: (.*)", text)
    if found:
        return found.group(1).strip()
    if isinstance(error, (AttributeError, KeyError)) or f"Unknown command line flag '{name}." in text:
        return _explain_unknown_field(argv, name)
    if "Error whilst parsing config file" in text:  # an exception inside get_config: keep its last line
        return f"--{name}: " + text.strip().splitlines()[-1]
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def parse_config_flags(flag_values: flags.FlagValues, argv: Sequence[str], name: str = "config"):
    """Parses argv into flag_values and returns the validated config.

    Raises:
      UsageError: with a one-line message naming the flag or field at fault.
    """
    try:
        flag_values(list(argv))
        config = flag_values[name].value
        if config is not None:
            config.get("name")  # a file that failed to load raises only when first read
    except Exception as error:  # absl and ml_collections raise many types; all mean bad input here
        raise UsageError(_explain(error, argv, name)) from None
    if config is None:
        raise UsageError(f"--{name} is required, e.g. --{name} configs/bf16_remat.py:cpu")
    try:
        validate(config)
        check_backend(config, gpu_target="target" in flag_values and bool(flag_values["target"].value))
    except ConfigError as error:
        raise UsageError(str(error)) from None
    return config


_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str, flag: str) -> int:
    """Parses a memory size such as `24GiB`, `24GB`, `512MiB` or `1e9` into bytes.

    Raises:
      UsageError: naming `flag` and the units allowed.
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if unit not in _BYTE_UNITS or float(found.group(1)) <= 0:
        raise UsageError(
            f"{flag}: {text!r} is not a positive memory size; use a number with a unit such as 24GiB, 24GB, "
            "512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(found.group(1)) * _BYTE_UNITS[unit])

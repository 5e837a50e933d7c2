"""A sweep file: its base config, named variants (dotted overrides), baseline and measured peaks, loaded and checked.

A sweep file holds `get_config(preset)` (the base config), `get_variants(config)` (named variants as dotted
overrides, e.g. {"name": "bf16_scan_remat_block", "model.remat": ("Block",)}), `BASELINE` (the variant the
others are compared with) and optionally `NOTEBOOK_PEAK_GIB` ({preset: {variant: GiB}}: peaks measured
elsewhere, which the sweep joins into its rows beside the plan). Loading builds every variant's config
without touching any accelerator; any mistake is a one-line UsageError.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import itertools
import os
import pathlib
import re
from collections.abc import Sequence

import ml_collections

from jaxscale.cli import UsageError
from jaxscale.config import ConfigError, import_file
from jaxscale.config.overrides import apply_overrides, cli_value
from jaxscale.plan import targets

__all__ = ["Sweep", "Variant", "apply_overrides", "cli_value", "expand_grid", "load_sweep", "plan_suffix",
           "select_variants"]  # fmt: skip

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Variant:
    """One named variant: its dotted overrides and the full config they give."""

    name: str
    overrides: dict[str, object]
    config: ml_collections.ConfigDict


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A loaded sweep file at one preset."""

    name: str
    path: pathlib.Path
    preset: str
    baseline: str
    variants: tuple[Variant, ...]
    notebook_peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # variant -> measured peak
    base: ml_collections.ConfigDict | None = None  # get_config(preset), before any variant's overrides
    notebook_step_s: dict[str, float] = dataclasses.field(default_factory=dict)  # variant -> measured step time
    notebook_device: str | None = None  # the targets-table name of the GPU those step times were measured on

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]


def expand_grid(axes: dict[str, dict[str, object]]) -> list[dict[str, object]]:
    """Every combination of the axes as named variants.

    Args:
      axes: dotted field -> {label: value}, e.g. {"model.dtype": {"fp32": "float32", "bf16": "bfloat16"},
        "model.remat": {"noremat": (), "block": ("Block",)}}.

    Returns:
      Variants named by their labels joined with "_" (fp32_noremat, fp32_block, bf16_noremat, bf16_block).
    """
    variants = []
    for combo in itertools.product(*(list(choices.items()) for choices in axes.values())):
        variant: dict[str, object] = {"name": "_".join(label for label, _ in combo)}
        variant.update({field: value for field, (_, value) in zip(axes, combo, strict=True)})
        variants.append(variant)
    return variants


def _import_sweep_file(path: pathlib.Path):
    if not path.is_file():
        raise UsageError(f"--config: sweep file {str(path)!r} not found")
    try:
        module = import_file(path)
    except Exception as error:  # any error in the user's file is bad input
        raise UsageError(f"--config: {path}: {type(error).__name__}: {error}") from None
    missing = [attr for attr in ("get_config", "get_variants", "BASELINE") if not hasattr(module, attr)]
    if missing:
        raise UsageError(f"--config: {path} is not a sweep file: it lacks {', '.join(missing)} (see experiments/)")
    return module


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise UsageError(f"{what}: {name!r} is not a valid name; use letters, digits, '_', '-' and '.'")
    return name


def _notebook_values(module, path: pathlib.Path, preset: str, names: list[str], attribute: str) -> dict[str, float]:
    """The sweep file's `attribute` table ({preset: {variant: positive number}}) at this preset; {} if none."""
    table = getattr(module, attribute, {})
    values = table.get(preset, {}) if isinstance(table, dict) else None
    if not isinstance(values, dict):
        raise UsageError(f"{path}: {attribute} must be {{preset: {{variant: number}}}}, got {table!r}")
    for variant, value in values.items():
        if variant not in names:
            raise UsageError(f"{path}: {attribute}[{preset!r}]: {variant!r} is not a variant at {preset}; "
                             f"variants: {', '.join(names)}")  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UsageError(f"{path}: {attribute}[{preset!r}][{variant!r}]: must be a positive number")
    return dict(values)


def _notebook_peaks(module, path: pathlib.Path, preset: str, names: list[str]) -> dict[str, int]:
    """The sweep file's NOTEBOOK_PEAK_GIB at this preset, in bytes; {} when it defines none for the preset."""
    return {
        v: round(gib * GIB) for v, gib in _notebook_values(module, path, preset, names, "NOTEBOOK_PEAK_GIB").items()
    }


def plan_suffix(plan: bool, target: str | None, gemm: str = "both", devices: int | None = None) -> str:
    """What a plan adds to the sweep's default name: "", "_plan", "_plan_a5000", "_plan_a5000_triton" or, on
    several target GPUs, "_plan_a5000_x8"."""
    if not plan:
        return ""
    target_part = f"_{pathlib.Path(target).stem}" if target else ""
    gemm_part = f"_{gemm}" if target and gemm != "both" else ""
    return f"_plan{target_part}{gemm_part}" + (f"_x{devices}" if target and devices else "")


def load_sweep(
    config: str | os.PathLike, preset: str | None = None, name: str | None = None, name_suffix: str = ""
) -> Sweep:
    """Loads a sweep file and builds every variant's config (without touching any accelerator).

    Args:
      config: the sweep file, optionally with the preset after a colon (experiments/seed_table.py:cpu).
      preset: the preset, when not given after the colon (required one way or the other).
      name: the sweep's name (default: <file stem>_<preset><name_suffix>); it names the results and
        traces directories.
      name_suffix: added to the default name (see plan_suffix), not to a given `name`.

    Raises:
      UsageError: a one-line message naming the file, variant or field at fault.
    """
    path_text, _, spec_preset = str(config).partition(":")
    preset = preset or spec_preset
    if not preset:
        raise UsageError(f"--config: add a preset after the colon, e.g. {path_text}:cpu (seed | cpu | tiny); "
                         "a sweep keeps its results per preset")  # fmt: skip
    path = pathlib.Path(path_text)
    module = _import_sweep_file(path)
    try:
        base = module.get_config(preset)
        specs = module.get_variants(copy.deepcopy(base))
    except ConfigError as error:
        raise UsageError(f"--config: {path}: {error}") from None
    except Exception as error:  # an error in the user's get_config / get_variants is bad input
        raise UsageError(f"--config: {path}: {type(error).__name__}: {error}") from None
    variants = []
    for spec in specs:
        variant_name = _check_name(spec.get("name"), f"{path}: variant name")
        overrides = {k: v for k, v in spec.items() if k != "name"}
        variant_config = copy.deepcopy(base)
        apply_overrides(variant_config, overrides, f"{path}: variant {variant_name}")
        variant_config.name = variant_name
        variants.append(Variant(variant_name, overrides, variant_config))
    names = [v.name for v in variants]
    if not names or len(set(names)) != len(names):
        raise UsageError(f"{path}: get_variants must give variants with distinct names, got {names}")
    if module.BASELINE not in names:
        raise UsageError(f"{path}: BASELINE {module.BASELINE!r} is not a variant; variants: {', '.join(names)}")
    sweep_name = _check_name(name or f"{path.stem}_{preset}{name_suffix}", "--name")
    peaks = _notebook_peaks(module, path, preset, names)
    steps = _notebook_values(module, path, preset, names, "NOTEBOOK_STEP_S")
    device = getattr(module, "NOTEBOOK_DEVICE", None)
    if steps and device not in targets.TARGETS:
        raise UsageError(f"{path}: NOTEBOOK_STEP_S needs NOTEBOOK_DEVICE, the GPU they were measured on: one of "
                         f"{', '.join(targets.TARGETS)}; got {device!r}")  # fmt: skip
    return Sweep(sweep_name, path, preset, module.BASELINE, tuple(variants), peaks, base, steps, device)


def select_variants(names: Sequence[str], only: Sequence[str] = (), skip: Sequence[str] = ()) -> list[str]:
    """The names kept by --only (if given) and not dropped by --skip; both take shell patterns (bf16_*)."""

    def matching(patterns: Sequence[str], flag: str) -> set[str]:
        chosen: set[str] = set()
        for pattern in patterns:
            hits = fnmatch.filter(names, pattern)
            if not hits:
                raise UsageError(f"{flag}: {pattern!r} matches no variant; variants: {', '.join(names)}")
            chosen.update(hits)
        return chosen

    kept, dropped = matching(only, "--only") if only else set(names), matching(skip, "--skip")
    selected = [n for n in names if n in kept and n not in dropped]
    if not selected:
        raise UsageError("--only/--skip: no variant left to run")
    return selected

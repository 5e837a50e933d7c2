"""Dotted config overrides ({"model.remat": ("Block",)}) set on a config in place, names and types checked."""

from __future__ import annotations

import ml_collections

from jaxscale.config.defaults import UsageError

__all__ = ["RESERVED_FIELDS", "apply_overrides", "cli_value"]

# Top-level fields a caller sets itself (a sweep names its variants and presets), never an override.
RESERVED_FIELDS = ("name", "preset", "preset_source")


def cli_value(value: object, where: str) -> str:
    """The command-line text ml_collections parses back into `value` (str, bool, int, float or a tuple)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)) or (
        isinstance(value, tuple) and all(isinstance(v, (str, bool, int, float)) for v in value)
    ):
        return repr(value)
    raise UsageError(f"{where}: {value!r} is a {type(value).__name__}; use a str, bool, int, float or a tuple of them")


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, object], where: str) -> None:
    """Sets dotted fields of `config` in place; raises UsageError naming an unknown field or a wrong type."""
    for dotted, value in overrides.items():
        *groups, field = dotted.split(".")
        node = config
        for depth, group in enumerate(groups):
            if group not in node or not isinstance(node[group], ml_collections.ConfigDict):
                allowed = ", ".join(k for k, v in node.items() if isinstance(v, ml_collections.ConfigDict))
                raise UsageError(f"{where}: {dotted}: no group {'.'.join(groups[: depth + 1])!r}; allowed: {allowed}")
            node = node[group]
        if not groups and field in RESERVED_FIELDS:
            raise UsageError(f"{where}: {dotted}: set by the sweep, not by a variant")
        if field not in node or isinstance(node[field], ml_collections.ConfigDict):
            fields = ", ".join(sorted(k for k, v in node.items() if not isinstance(v, ml_collections.ConfigDict)))
            raise UsageError(f"{where}: {dotted}: no field {field!r} in {'.'.join(groups) or 'the config'}; "
                             f"allowed: {fields}")  # fmt: skip
        cli_value(value, f"{where}: {dotted}")
        try:
            node[field] = value
        except TypeError as error:
            raise UsageError(f"{where}: {dotted}: {error}") from None

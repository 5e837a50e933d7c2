"""The run configuration: fields and presets (defaults), validation, and typed views of derived sizes (spec).

`configs/*.py` call `base_config(preset, name)` and change the fields of their variant; every front door
loads a config file, applies `--config.*` overrides and calls `validate` before anything compiles.
"""

from jaxscale.config.defaults import (
    ACCUMULATE_METHODS,
    ATTENTION_IMPLS,
    DATA_SOURCES,
    DTYPES,
    FAMILIES,
    OPTIMIZERS,
    PRESETS,
    REMAT_POLICIES,
    REMAT_TARGETS,
    ConfigError,
    all_presets,
    base_config,
    default_preset,
    describe,
    field_comments,
    flatten,
    import_file,
    load_config_file,
)
from jaxscale.config.spec import (
    MESH_AXES,
    MeshShape,
    ModelConfig,
    accumulates_locally,
    mesh_shape,
    mesh_text,
    minibatch_per_device,
    sequence_parallel,
    step_model,
    zero_stage,
)
from jaxscale.config.validation import check_backend, check_mesh_devices, validate

__all__ = [
    "ACCUMULATE_METHODS",
    "ATTENTION_IMPLS",
    "DATA_SOURCES",
    "DTYPES",
    "FAMILIES",
    "MESH_AXES",
    "OPTIMIZERS",
    "PRESETS",
    "REMAT_POLICIES",
    "REMAT_TARGETS",
    "ConfigError",
    "MeshShape",
    "ModelConfig",
    "accumulates_locally",
    "all_presets",
    "base_config",
    "check_backend",
    "check_mesh_devices",
    "default_preset",
    "describe",
    "field_comments",
    "flatten",
    "import_file",
    "load_config_file",
    "mesh_shape",
    "mesh_text",
    "minibatch_per_device",
    "sequence_parallel",
    "step_model",
    "validate",
    "zero_stage",
]

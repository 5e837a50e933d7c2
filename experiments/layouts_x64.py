"""experiments/layouts.py for 64 GPUs (8 hosts of 8): the same model, kernel and two sequences per GPU.

python -m jaxscale.sweep --config experiments/layouts_x64.py:llama3.1-8b --plan --target h100 --devices 64
"""

import pathlib

from jaxscale.config import import_file

_LAYOUTS = import_file(pathlib.Path(__file__).with_name("layouts.py"))

BASELINE = "fsdp"
DEVICES = 64
# name: (data, fsdp, tensor, context, ZeRO stage of fsdp, sequence parallel)
LAYOUTS = {
    "dp": (64, 1, 1, 1, 3, False),
    "zero1": (1, 64, 1, 1, 1, False),
    "zero2": (1, 64, 1, 1, 2, False),
    "fsdp": (1, 64, 1, 1, 3, False),
    "hsdp_dp8_fsdp8": (8, 8, 1, 1, 3, False),  # FSDP inside a host, data parallel across hosts
    "fsdp32_tp2_sp": (1, 32, 2, 1, 3, True),
    "fsdp8_tp8_sp": (1, 8, 8, 1, 3, True),  # tensor parallel over a host's 8 NVLinked GPUs
    "fsdp32_cp2": (1, 32, 1, 2, 3, False),
    "fsdp16_tp2_sp_cp2": (1, 16, 2, 2, 3, True),
}


def get_config(preset=None):
    return _LAYOUTS.config_for(preset, DEVICES)


def get_variants(config):
    return _LAYOUTS.variants_for(config, LAYOUTS)

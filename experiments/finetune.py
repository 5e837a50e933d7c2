"""Fine-tuning an English model on Python code: full, bf16 first moment, LoRA (attention, all), the top block.

    python -m jaxscale.sweep --config experiments/finetune.py:cpu-llama     # about 25 minutes on 2 cores

The two texts are prepared on first use, as these commands would (into data/, git-ignored):

    python -m jaxscale.data pydoc-text --out data/pydoc.txt
    python -m jaxscale.data prepare --text data/pydoc.txt --out data/pydoc_bytes
    python -m jaxscale.data python-source --out data/python.txt
    python -m jaxscale.data prepare --text data/python.txt --out data/python_bytes

The first variant, `pretrain_english`, trains the model from scratch on Python's English documentation (pydoc
topics) and checkpoints it; every other variant starts from that checkpoint (`finetune.init_from`), measures the
loaded model's validation loss on Python source (the standard library's asyncio, email, json and logging) before
its first step, and fine-tunes on that code the same number of steps with the same learning rate. Rows: the
validation loss before and after, the trained and frozen parameters, the compiled plan's peak and the analytic
model's breakdown (docs/finetune.md). Run it from the repository root (the data and trace paths are relative).

Both texts are bytes-tokenized (vocabulary 256), so one model reads both. `:tiny-llama` is the same in seconds,
for checking the plumbing.
"""

from jaxscale.config import base_config
from jaxscale.data import corpus, prepared_bytes

BASELINE = "full"
PRETRAIN = "pretrain_english"
ENGLISH, CODE = "data/pydoc_bytes", "data/python_bytes"
# (steps of pre-training, steps of each fine-tuning, validation every) per preset.
STEPS = {"cpu-llama": (300, 100, 50), "tiny-llama": (4, 4, 2)}


def get_config(preset=None):
    """Llama blocks (unrolled: finetune.train=last_blocks needs them), bf16, remat Block, text of 256 byte ids."""
    preset = preset or "cpu-llama"
    if preset not in STEPS:
        raise ValueError(f"preset: {preset!r}; allowed: {', '.join(STEPS)}")
    prepared_bytes(ENGLISH, "data/pydoc.txt", corpus.write_pydoc_text)
    prepared_bytes(CODE, "data/python.txt", lambda path: corpus.write_text(path, corpus.python_source_text()))
    config = base_config(preset, name="finetune")
    config.model.update(vocab_size=256, scan_layers=False, remat=("Block",), dropout_rate=0.0)
    _, steps, every = STEPS[preset]
    config.data.update(source="text", path=CODE)
    config.train.update(steps=steps, warmup_steps=0, eval_every=every, eval_batches=4)
    config.profile.steps = 0
    config.finetune.init_from = f"traces/finetune_{preset}/{PRETRAIN}"
    config.model.lora_rank = 16 if preset == "cpu-llama" else 4
    return config


def get_variants(config):
    """Pre-training on English first (it writes the checkpoint the others load), then each fine-tuning method."""
    pretrain_steps = STEPS[config.preset][0]
    return [
        {"name": PRETRAIN, "data.path": ENGLISH, "finetune.init_from": "", "model.lora_rank": 0,
         "train.steps": pretrain_steps, "train.eval_every": pretrain_steps // 3,
         "train.checkpoint_every": pretrain_steps},
        {"name": "full", "model.lora_rank": 0},
        {"name": "full_bf16_state", "model.lora_rank": 0, "optimizer.state_dtype": "bfloat16"},
        {"name": "lora_attention", "finetune.train": "adapters", "model.lora_targets": ("attention",)},
        {"name": "lora_all", "finetune.train": "adapters", "model.lora_targets": ("all",)},
        {"name": "last_block", "model.lora_rank": 0, "finetune.train": "last_blocks", "finetune.last_blocks": 1},
    ]  # fmt: skip

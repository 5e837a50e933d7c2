"""Input-bound against compute-bound, and how worker processes and prefetch close the gap (docs/data.md).

    python -m jaxscale.sweep --config experiments/input_pipeline.py:cpu     # 6 variants, minutes on 2 cores
    python -m jaxscale.sweep --config experiments/input_pipeline.py:tiny    # seconds per variant (plumbing)
    python -m jaxscale.sweep --config experiments/input_pipeline.py:seed    # on a GPU

The same model trains on random tokens (compute-bound: its batch never leaves the device) and on real text
(Python's pydoc topics, bytes tokenizer), first with a fast host, then with a host made slow on purpose
(`data.host_delay_s` of sleep per batch, longer than a step): synchronously (the step waits for the whole
delay), with prefetch alone (host work overlaps one step of compute), and with 2 and 4 worker processes
(batches prepared in parallel). The row's `input_wait_s_median` is the time a step waited for its batch;
`step_with_input_wait_s_median` what a step costs in wall time with that wait.

The text is prepared on first use into experiments/results/data/ (git-ignored): the pydoc topics written as
text, then `python -m jaxscale.data prepare --tokenizer bytes`.
"""

import pathlib

from jaxscale.config import base_config
from jaxscale.data import corpus, prepared_bytes

BASELINE = "synthetic"

DATA_DIR = pathlib.Path(__file__).resolve().parent / "results" / "data"

# Seconds of host delay per batch, per preset: longer than a step, so prefetch alone cannot hide it, and not
# much more than 4 steps, so 4 workers can keep up. At :cpu the 2-layer step measured 2.4 s on 2 cores shared
# with other work (experiments/results/input_pipeline_cpu); on quiet cores it is shorter (the 4-layer :cpu
# preset takes about a second), so the gap workers must close is larger there.
HOST_DELAY_S = {"cpu": 3.0, "tiny": 0.05, "seed": 1.0}


def pydoc_bytes() -> pathlib.Path:
    """The pydoc topics as a bytes-tokenized directory (vocab 256), prepared here if missing."""
    return prepared_bytes(DATA_DIR / "pydoc_bytes", DATA_DIR / "pydoc.txt", corpus.write_pydoc_text)


def get_config(preset=None):
    """bf16, layers scanned, remat MLP+Attn (the main example), on the pydoc bytes: vocab 256, 2 layers at :cpu."""
    config = base_config(preset, name="input_pipeline")
    config.model.scan_layers = True
    config.model.remat = ("MLP", "Attn")
    config.model.vocab_size = 256
    config.data.path = str(pydoc_bytes())
    # Warm-up steps absorb the pipeline's start: each worker process imports JAX when it starts (seconds on
    # shared cores) and hands out every workers-th batch, so batch k waits for worker k's start; at 2 warm-up
    # steps the first timed steps of the 4-worker variant still waited for workers 3 and 4. Then enough timed
    # steps that the median is the steady state, not the batches prefetched before the first timed one.
    config.train.warmup_steps = 5
    config.profile.steps = 1
    if config.preset == "cpu":
        config.model.num_layers = 2  # 6 variants of 8 timed steps within a few minutes on 2 shared cores
        config.train.steps = 8
    elif config.preset == "tiny":
        config.train.steps = 20
    return config


def get_variants(config):
    """Compute-bound (synthetic), text with a fast host, then a slow host: sync, prefetch, 2 and 4 workers."""
    slow = {"data.source": "text", "data.host_delay_s": HOST_DELAY_S[config.preset]}
    return [
        {"name": "synthetic", "data.source": "synthetic"},
        {"name": "text", "data.source": "text", "data.workers": 0, "data.prefetch": 0},
        {"name": "slow_sync", **slow, "data.workers": 0, "data.prefetch": 0},
        {"name": "slow_prefetch2", **slow, "data.workers": 0, "data.prefetch": 2},
        {"name": "slow_workers2_prefetch2", **slow, "data.workers": 2, "data.prefetch": 2},
        {"name": "slow_workers4_prefetch4", **slow, "data.workers": 4, "data.prefetch": 4},
    ]

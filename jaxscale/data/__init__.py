"""Real text for training: token files prepared here (prepare.py), loaded with grain (loader.py), fed to a run.

`python -m jaxscale.data prepare --text PATH... --out DIR` writes the token files (see docs/data.md); a run
with `data.source=text` and `data.path=DIR` trains on them through `make_source`.
"""

from jaxscale.data.batch import Batch, make_batch, windows_to_batch
from jaxscale.data.manifest import DataError, Manifest, read
from jaxscale.data.prepare import prepare_tokens, prepared_bytes
from jaxscale.data.source import (
    BatchPlacement,
    DataSource,
    SyntheticSource,
    TextSource,
    check,
    data_columns,
    make_source,
    validation_batches,
)
from jaxscale.data.stats import unigram_entropy_nats

__all__ = [
    "Batch",
    "BatchPlacement",
    "DataError",
    "DataSource",
    "Manifest",
    "SyntheticSource",
    "TextSource",
    "check",
    "data_columns",
    "make_batch",
    "make_source",
    "prepare_tokens",
    "prepared_bytes",
    "read",
    "unigram_entropy_nats",
    "validation_batches",
    "windows_to_batch",
]

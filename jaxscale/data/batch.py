"""A batch of tokens: the type every data source hands the train step, the reference's random batch, and
windows of token ids turned into inputs and next-token labels.

Where a batch goes on the device(s) is the placement's concern (jaxscale.train.sharding.place_batch), not
this package's: data sources take the run's placement and hand it their host batches.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Batch:
    """inputs: [batch, seq] tokens shifted right by one with 0 in front; labels: [batch, seq] tokens."""

    inputs: jax.Array
    labels: jax.Array


def make_batch(key: jax.Array, batch_size: int, seq_len: int, vocab_size: int) -> Batch:
    """Random tokens as data, as in the reference: the model learns next-token prediction on them."""
    tokens = jax.random.randint(key, (batch_size, seq_len), 1, vocab_size)  # [B, T]
    inputs = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))  # [B, T]: 0, t_0, ..., t_{T-2}
    return Batch(inputs=inputs, labels=tokens)


def windows_to_batch(windows: np.ndarray) -> Batch:
    """[B, T + 1] token ids -> Batch(inputs=[B, T] the first T, labels=[B, T] the last T), int32 on the host."""
    windows = np.asarray(windows, dtype=np.int32)  # a fresh array: grain's shared memory is not kept alive
    return Batch(inputs=windows[:, :-1], labels=windows[:, 1:])

"""Statistics of a token split: the unigram entropy, the loss of a model that ignores all context."""

from __future__ import annotations

import numpy as np


def unigram_entropy_nats(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> float:
    """Entropy of the split's own token frequencies, in nats per token: -sum p log p.

    A model that predicts every token from these frequencies alone (no context) reaches this cross-entropy on
    the split itself; a validation loss clearly below it means the model uses context.

    Args:
      tokens: [n] token ids below vocab_size (a memory map is read in chunks of `chunk` tokens).
      vocab_size: the size of the id space.
    """
    counts = np.zeros(vocab_size, np.int64)
    for start in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[start : start + chunk]), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

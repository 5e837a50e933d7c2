"""Tokenizers for prepare: raw UTF-8 bytes (256 ids, no training) or a byte-level BPE trained here.

The BPE tokenizer is Hugging Face `tokenizers` (models.BPE with the ByteLevel pre-tokenizer and decoder, as
GPT-2's), trained on the given text in this process: nothing is downloaded. Every byte is in its initial
alphabet, so any text encodes without unknown tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

BYTES_VOCAB = 256
SEPARATOR = "<|endoftext|>"  # BPE only: id 0, put between source files
MIN_BPE_VOCAB = BYTES_VOCAB + 1  # the byte alphabet plus the separator
CHUNK_CHARS = 1 << 16  # text encoded per call: whole lines up to about this many characters


def encode_bytes(data: bytes) -> np.ndarray:
    """UTF-8 bytes as token ids 0..255: [len(data)] uint8."""
    return np.frombuffer(data, dtype=np.uint8)


def _bpe_model():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Trains a byte-level BPE tokenizer with at most `vocab_size` tokens on `texts`.

    Args:
      texts: the training text, in pieces (whole lines or files).
      vocab_size: the target size, at least MIN_BPE_VOCAB; a small text may give fewer merges.

    Returns:
      A `tokenizers.Tokenizer`; id 0 is SEPARATOR, ids 1..256 the bytes, then the learned merges.
    """
    from tokenizers import pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"--vocab: a BPE vocabulary needs at least {MIN_BPE_VOCAB} tokens, got {vocab_size}")
    tokenizer = _bpe_model()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Whole lines of `text`, joined into pieces of about `size` characters (cut only at line ends)."""
    piece: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        piece.append(line)
        length += len(line)
        if length >= size:
            yield "".join(piece)
            piece, length = [], 0
    if piece:
        yield "".join(piece)


def encode_bpe(tokenizer, text: str) -> np.ndarray:
    """Token ids of `text` under a trained BPE tokenizer: [n] int64 (encoded in line-aligned chunks)."""
    pieces = list(chunks(text))
    if not pieces:
        return np.zeros((0,), np.int64)
    encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])


def load_bpe(path: str):
    """A BPE tokenizer saved by prepare (DIR/tokenizer.json), to decode ids back to text."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)

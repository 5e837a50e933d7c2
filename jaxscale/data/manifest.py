"""A prepared token directory: its manifest (manifest.json) read and checked, and its splits as memory maps.

Layout written by `python -m jaxscale.data prepare` (see prepare.py):

```
DIR/manifest.json        format, tokenizer, vocab_size, dtype, per-split file and token count, sources
DIR/train.bin            token ids, raw little-endian `dtype` (uint16 when the vocabulary allows)
DIR/validation.bin       the held-out split, same format
DIR/tokenizer.json       the trained BPE tokenizer (Hugging Face `tokenizers`), for tokenizer=bpe only
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

FORMAT = "jaxscale.tokens/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
TOKENIZERS = ("bytes", "bpe")


class DataError(ValueError):
    """Bad input data (a missing path, a corrupt manifest, a mismatch with the config): one line names it."""


@dataclasses.dataclass(frozen=True)
class Split:
    """One split's token file: where it is, its dtype and how many tokens it holds."""

    path: pathlib.Path
    dtype: str
    tokens: int

    def open(self) -> np.memmap | np.ndarray:
        """The tokens as a read-only memory map ([tokens] of dtype)."""
        if self.tokens == 0:
            return np.zeros((0,), self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a prepared directory holds (manifest.json, checked against the files beside it)."""

    directory: pathlib.Path
    tokenizer: str  # one of TOKENIZERS
    vocab_size: int  # token ids are < vocab_size; model.vocab_size must equal it
    dtype: str  # numpy dtype of the token files
    splits: dict[str, Split]
    raw: dict  # the whole manifest.json, for the row and for humans

    def split(self, name: str) -> Split:
        return self.splits[name]

    @property
    def digest(self) -> str:
        """sha256 (hex) of what fixes the tokens: the manifest (its sources' sha256, tokenizer, vocabulary, dtype,
        split sizes, validation fraction) and, for bpe, the tokenizer file's bytes.

        Left out: `created_at` and the sources' paths, so the same text prepared again elsewhere has the same
        digest. The token files themselves are not hashed (a checkpointed run compares this at every resume).
        """
        content = {key: value for key, value in self.raw.items() if key != "created_at"}
        sources = content.get("sources")
        if isinstance(sources, list):
            content["sources"] = [{k: v for k, v in s.items() if k != "path"} if isinstance(s, dict) else s
                                  for s in sources]  # fmt: skip
        digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode())
        tokenizer_file = self.raw.get("tokenizer_file")
        if isinstance(tokenizer_file, str) and (self.directory / tokenizer_file).is_file():
            digest.update((self.directory / tokenizer_file).read_bytes())
        return digest.hexdigest()


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds ids below vocab_size: uint16 up to 65,536 tokens, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _corrupt(path: pathlib.Path, why: str) -> DataError:
    return DataError(f"data.path: {path} is corrupt: {why}; prepare the directory again")


def _field(raw: dict, key: str, kind: type | tuple[type, ...], path: pathlib.Path):
    value = raw.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _corrupt(path, f"field {key!r} is missing or not a {getattr(kind, '__name__', kind)}")
    return value


def _read_split(directory: pathlib.Path, raw: dict, name: str, dtype: str, path: pathlib.Path) -> Split:
    entry = _field(raw, "splits", dict, path).get(name)
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("file"), str)
        or not isinstance(entry.get("tokens"), int)
    ):
        raise _corrupt(path, f"splits.{name} must hold 'file' (str) and 'tokens' (int)")
    file = directory / entry["file"]
    if not file.is_file():
        raise _corrupt(path, f"its {name} token file {file.name} is missing")
    expected = entry["tokens"] * np.dtype(dtype).itemsize
    if file.stat().st_size != expected:
        raise _corrupt(path, f"{file.name} holds {file.stat().st_size:,} bytes, the manifest says {expected:,}")
    return Split(file, dtype, entry["tokens"])


def read(directory: str | pathlib.Path) -> Manifest:
    """Reads and checks DIR/manifest.json and the token files it names.

    Raises:
      DataError: the directory or manifest is missing, or the manifest is unreadable or disagrees with the files.
    """
    directory = pathlib.Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DataError(f"data.path: directory {str(directory)!r} not found; write it with "
                        "python -m jaxscale.data prepare --text FILES --out DIR")  # fmt: skip
    if not path.is_file():
        raise DataError(f"data.path: {str(directory)!r} holds no {MANIFEST}: not a prepared directory; write it with "
                        "python -m jaxscale.data prepare --text FILES --out DIR")  # fmt: skip
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _corrupt(path, f"not JSON ({error})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _corrupt(path, f"'format' is not {FORMAT!r}")
    tokenizer = _field(raw, "tokenizer", str, path)
    if tokenizer not in TOKENIZERS:
        raise _corrupt(path, f"unknown tokenizer {tokenizer!r}")
    vocab_size = _field(raw, "vocab_size", int, path)
    dtype = _field(raw, "dtype", str, path)
    if vocab_size <= 0 or dtype not in ("uint16", "uint32") or np.iinfo(dtype).max < vocab_size - 1:
        raise _corrupt(path, f"vocab_size {vocab_size} does not fit dtype {dtype!r}")
    splits = {name: _read_split(directory, raw, name, dtype, path) for name in SPLITS}
    return Manifest(directory, tokenizer, vocab_size, dtype, splits, raw)

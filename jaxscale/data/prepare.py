"""Text files or folders -> token files with a train/validation split and a manifest, written atomically.

Everything is written into a hidden sibling directory (`.<out>.partial-<pid>`) and renamed to `out` only when
complete, so a failure or an interruption leaves no half-written `out` (and nothing is ever overwritten).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from jaxscale.data import manifest, tokenizer
from jaxscale.data.manifest import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")  # files taken from a folder (a file named directly is always read)
DEFAULT_VALIDATION_FRACTION = 0.1


def collect(paths: Sequence[str | os.PathLike]) -> list[pathlib.Path]:
    """The text files named by `paths`: files as given, folders searched recursively for TEXT_SUFFIXES.

    Raises:
      DataError: a path does not exist, is empty, or is a folder without text files.
    """
    if not paths:
        raise DataError("--text: give at least one text file or folder")
    files: list[pathlib.Path] = []
    for given in paths:
        path = pathlib.Path(given)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"--text: folder {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        else:
            raise DataError(f"--text: {str(path)!r} not found")
        if all(p.stat().st_size == 0 for p in found):
            raise DataError(f"--text: {str(path)!r} is empty")
        files += [p for p in found if p.resolve() not in {f.resolve() for f in files}]
    return files


def _read(files: Sequence[pathlib.Path]) -> Iterator[tuple[pathlib.Path, bytes]]:
    for path in files:
        yield path, path.read_bytes()


def _train_bpe(files: Sequence[pathlib.Path], vocab_size: int, progress: bool):
    if progress:
        total = sum(p.stat().st_size for p in files)
        print(
            f"jaxscale: training a byte-level BPE tokenizer ({vocab_size} tokens) on {total:,} bytes", file=sys.stderr
        )
    texts = (piece for _, data in _read(files) for piece in tokenizer.chunks(data.decode("utf-8", errors="replace")))
    return tokenizer.train_bpe(texts, vocab_size)


def _write_tokens(files, bpe, vocab_size: int, dtype: str, target: pathlib.Path, progress: bool) -> list[dict]:
    """Tokenizes every file into `target` (raw ids of dtype); returns the sources' path, size and sha256."""
    sources = []
    total = sum(p.stat().st_size for p in files)
    with open(target, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc="tokenize",
                                         disable=not progress, file=sys.stderr) as bar:  # fmt: skip
        for index, (path, data) in enumerate(_read(files)):
            sources.append(
                {"path": str(path.resolve()), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            )
            if bpe is None:
                ids = tokenizer.encode_bytes(data)
            else:
                ids = tokenizer.encode_bpe(bpe, data.decode("utf-8", errors="replace"))
                if index > 0:
                    ids = np.concatenate([[bpe.token_to_id(tokenizer.SEPARATOR)], ids])
            if ids.size and int(ids.max()) >= vocab_size:
                raise DataError(f"{path}: token id {int(ids.max())} is not below the vocabulary size {vocab_size}")
            out.write(ids.astype(dtype).tobytes())
            bar.update(len(data))
    return sources


def _split(all_tokens: pathlib.Path, directory: pathlib.Path, dtype: str, fraction: float) -> dict[str, dict]:
    """Moves the last `fraction` of the tokens to validation.bin and keeps the rest as train.bin."""
    itemsize = np.dtype(dtype).itemsize
    count = all_tokens.stat().st_size // itemsize
    validation = int(np.ceil(count * fraction))
    train = count - validation
    if train < 1 or validation < 1:
        raise DataError(f"--text: {count} tokens are too few to split into train and validation")
    tokens = np.memmap(all_tokens, dtype=dtype, mode="r", shape=(count,))
    tokens[train:].tofile(directory / "validation.bin")
    del tokens
    os.truncate(all_tokens, train * itemsize)
    all_tokens.rename(directory / "train.bin")
    return {
        "train": {"file": "train.bin", "tokens": train},
        "validation": {"file": "validation.bin", "tokens": validation},
    }


def _write_contents(directory, files, kind, vocab_size, fraction, progress) -> dict:
    bpe = _train_bpe(files, vocab_size, progress) if kind == "bpe" else None
    if bpe is not None:
        bpe.save(str(directory / "tokenizer.json"))
    dtype = manifest.dtype_for(vocab_size)
    sources = _write_tokens(files, bpe, vocab_size, dtype, directory / "all.bin", progress)
    raw = {
        "format": manifest.FORMAT,
        "tokenizer": kind,
        "tokenizer_file": "tokenizer.json" if bpe is not None else None,
        "vocab_size": vocab_size,
        "tokenizer_vocab_size": bpe.get_vocab_size() if bpe is not None else tokenizer.BYTES_VOCAB,
        "separator": tokenizer.SEPARATOR if bpe is not None else None,
        "dtype": dtype,
        "validation_fraction": fraction,
        "splits": _split(directory / "all.bin", directory, dtype, fraction),
        "sources": sources,
        "created_at": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    (directory / manifest.MANIFEST).write_text(json.dumps(raw, indent=1) + "\n")
    return raw


def prepare_tokens(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    kind: str = "bytes",
    vocab_size: int = 2048,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    progress: bool = True,
) -> manifest.Manifest:
    """Tokenizes text files or folders into `out`: train.bin, validation.bin, manifest.json (+ tokenizer.json).

    Args:
      paths: text files and folders (folders are searched recursively for TEXT_SUFFIXES).
      out: the directory to create; it must not exist yet.
      kind: "bytes" (ids 0..255, vocab_size 256) or "bpe" (a byte-level BPE trained here with `vocab_size`).
      vocab_size: for bpe, the tokenizer's target size and the id space the model must cover.
      validation_fraction: the share of tokens, taken from the end of the concatenated text, held out.
      progress: show a progress bar (stderr).

    Returns:
      The manifest of the finished directory.

    Raises:
      DataError: bad input (missing or empty path, existing `out`, bad sizes); nothing is left behind.
    """
    if kind not in manifest.TOKENIZERS:
        raise DataError(f"--tokenizer: unknown {kind!r}; allowed: {', '.join(manifest.TOKENIZERS)}")
    if kind == "bpe" and not tokenizer.MIN_BPE_VOCAB <= vocab_size <= 2**32:
        raise DataError(f"--vocab: a BPE vocabulary needs {tokenizer.MIN_BPE_VOCAB} to 2**32 tokens, got {vocab_size}")
    if not 0.0 < validation_fraction < 1.0:
        raise DataError(f"--validation_fraction: must be in (0, 1), got {validation_fraction}")
    vocab_size = tokenizer.BYTES_VOCAB if kind == "bytes" else vocab_size
    files = collect(paths)
    out = pathlib.Path(out)
    if out.exists():
        raise DataError(f"--out: {str(out)!r} already exists; remove it or choose another (prepare never overwrites)")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _write_contents(partial, files, kind, vocab_size, validation_fraction, progress)
        partial.rename(out)
    except BaseException:  # an error or Ctrl-C: leave nothing half-written
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest.read(out)


def prepared_bytes(
    out: str | os.PathLike, text_file: str | os.PathLike, write_text: Callable[[pathlib.Path], pathlib.Path]
) -> pathlib.Path:
    """`out`, a bytes-tokenized directory, prepared here on first use: when it cannot be read, `write_text(text_file)`
    writes the text (a corpus writer) and `prepare_tokens` tokenizes it (the experiments' corpora). Returns `out`."""
    out = pathlib.Path(out)
    try:
        manifest.read(out)
    except DataError:
        text = write_text(pathlib.Path(text_file))
        print(f"jaxscale: preparing {text} into {out} (bytes tokenizer)")
        prepare_tokens([text], out, kind="bytes", progress=False)
    return out

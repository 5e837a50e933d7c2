"""English text that ships with Python, for offline examples and tests: the pydoc topics (`pydoc_data.topics`).

`pydoc_data.topics.topics` maps each help topic (keywords, statements, types...) to its text from the Python
Language Reference: about 0.8 MB of real English prose with some code, in every CPython installation.
"""

from __future__ import annotations

import os
import pathlib


def pydoc_topics_text() -> str:
    """The pydoc topics joined in sorted-key order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics)) + "\n"


def write_pydoc_text(path: str | os.PathLike) -> pathlib.Path:
    """Writes pydoc_topics_text() to `path` (UTF-8) atomically; returns the path.

    Args:
      path: the .txt file to write; its parent folders are created.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(pydoc_topics_text(), encoding="utf-8")
    partial.replace(path)
    return path

"""Text that ships with Python, for offline examples and tests: English (the pydoc topics) and Python code.

`pydoc_data.topics.topics` maps each help topic (keywords, statements, types...) to its text from the Python
Language Reference: about 0.8 MB of real English prose with some code, in every CPython installation.
`python_source_text` is the source of a few standard-library packages (about 1.1 MB of Python on 3.11): another
domain to fine-tune an English model on (docs/finetune.md). Both depend on the Python version only.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig

# The standard-library packages whose source python_source_text joins.
SOURCE_PACKAGES = ("asyncio", "email", "json", "logging")


def pydoc_topics_text() -> str:
    """The pydoc topics joined in sorted-key order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics)) + "\n"


def python_source_text(packages: tuple[str, ...] = SOURCE_PACKAGES) -> str:
    """The .py files of standard-library `packages`, in sorted path order, each after a `# file: <path>` line."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for package in packages for f in (root / package).rglob("*.py"))
    return "".join(f"# file: {f.relative_to(root)}\n{f.read_text(encoding='utf-8')}\n" for f in files)


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Writes `text` to `path` (UTF-8) atomically; returns the path.

    Args:
      path: the .txt file to write; its parent folders are created.
      text: what it holds (pydoc_topics_text() or python_source_text()).
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path


def write_pydoc_text(path: str | os.PathLike) -> pathlib.Path:
    """Writes pydoc_topics_text() to `path` (see write_text)."""
    return write_text(path, pydoc_topics_text())

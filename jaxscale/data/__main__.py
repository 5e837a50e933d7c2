"""`python -m jaxscale.data prepare --text PATH... --out DIR [--tokenizer bytes|bpe] [--vocab 2048]`.

Also `python -m jaxscale.data pydoc-text --out FILE`: writes Python's own documentation text (pydoc topics,
real English that ships with every Python) to FILE, for an offline example corpus; and `python-source --out FILE`:
the source of a few standard-library packages (Python code, another domain to fine-tune on).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxscale.cli import UsageError, fail
from jaxscale.data import corpus, prepare
from jaxscale.data.manifest import DataError


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one-line UsageErrors (exit 2 via cli.fail), not a usage block."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


EXAMPLES = (
    "python -m jaxscale.data pydoc-text --out /tmp/pydoc.txt",
    "python -m jaxscale.data prepare --text /tmp/pydoc.txt --out data/pydoc_bytes",
    "python -m jaxscale.data python-source --out /tmp/python.txt",
    "python -m jaxscale.data prepare --text docs README.md --out data/docs_bpe --tokenizer bpe --vocab 2048",
)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m jaxscale.data", description="Prepare text as token files for data.source=text.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="{prepare,pydoc-text,python-source}")
    p = commands.add_parser("prepare", help="tokenize text files or folders into DIR", description=(
        "Tokenize text files or folders (searched for " + ", ".join(prepare.TEXT_SUFFIXES) + ") into DIR: "
        "train.bin and validation.bin (token ids, memory-mappable), manifest.json, and tokenizer.json for bpe. "
        "DIR is written atomically and never overwritten."))  # fmt: skip
    p.add_argument("--text", nargs="+", required=True, metavar="PATH", help="text files or folders")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to create (must not exist)")
    p.add_argument(
        "--tokenizer",
        choices=("bytes", "bpe"),
        default="bytes",
        help="bytes: UTF-8 bytes, 256 ids, no training; bpe: byte-level BPE trained here (default: bytes)",
    )
    p.add_argument("--vocab", type=int, default=2048, help="bpe vocabulary size (default: 2048, the presets')")
    p.add_argument(
        "--validation_fraction",
        type=float,
        default=prepare.DEFAULT_VALIDATION_FRACTION,
        help="share of the tokens (from the end) held out for validation (default: 0.1)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    t = commands.add_parser(
        "pydoc-text",
        help="write Python's pydoc topics (English text) to a file",
        description="Write Python's own documentation text (pydoc_data.topics) to FILE.",
    )
    t.add_argument("--out", required=True, metavar="FILE", help="the .txt file to write")
    c = commands.add_parser(
        "python-source",
        help="write Python source of a few standard-library packages to a file",
        description="Write the source of the standard library's " + ", ".join(corpus.SOURCE_PACKAGES) + " packages "
        "to FILE (code: a domain to fine-tune an English model on).",
    )
    c.add_argument("--out", required=True, metavar="FILE", help="the .txt file to write")
    # --help shows the examples and every command's flags on one page, as the lab's other commands do
    commands_help = "".join(f"\n{command.format_help()}" for command in (p, t, c))
    parser.epilog = "examples:\n" + "".join(f"  {example}\n" for example in EXAMPLES) + commands_help
    return parser  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: exit 0, or 2 with one line naming the problem (nothing half-written)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv)
        if args.command == "pydoc-text":
            print(f"wrote {corpus.write_pydoc_text(args.out)}")
            return 0
        if args.command == "python-source":
            print(f"wrote {corpus.write_text(args.out, corpus.python_source_text())}")
            return 0
        found = prepare.prepare_tokens(args.text, args.out, args.tokenizer, args.vocab, args.validation_fraction,
                                progress=not args.quiet)  # fmt: skip
    except (UsageError, DataError) as error:
        return fail(str(error))
    except OSError as error:
        return fail(f"{error.strerror}: {error.filename}" if error.filename else str(error))
    train, validation = found.split("train").tokens, found.split("validation").tokens
    print(f"wrote {found.directory}: tokenizer {found.tokenizer}, vocab_size {found.vocab_size}, {found.dtype}; "
          f"train {train:,} tokens, validation {validation:,} tokens")  # fmt: skip
    print(f"train on it: --config.data.source=text --config.data.path={found.directory} "
          f"--config.model.vocab_size={found.vocab_size}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m jaxscale.data prepare`: token files that decode back to the text, a manifest that describes them,
folders searched, and bad input refused in one line with nothing written (also when it fails half-way)."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pytest
from conftest import run_cli

from jaxscale.data import DataError, prepare, prepare_tokens, read, tokenizer
from jaxscale.data.__main__ import main


def _tokens(directory: pathlib.Path, split: str) -> np.ndarray:
    return np.asarray(read(directory).split(split).open())


def test_bytes_tokens_are_the_text_split_at_the_end(pydoc_text, pydoc_bytes):
    data = pydoc_text.read_bytes()
    found = read(pydoc_bytes)
    assert (found.tokenizer, found.vocab_size, found.dtype) == ("bytes", 256, "uint16")
    train, validation = _tokens(pydoc_bytes, "train"), _tokens(pydoc_bytes, "validation")
    assert len(train) + len(validation) == len(data)
    assert len(validation) == int(np.ceil(len(data) * 0.1))
    assert bytes(train.astype(np.uint8)) + bytes(validation.astype(np.uint8)) == data
    source = found.raw["sources"][0]
    assert source["sha256"] == hashlib.sha256(data).hexdigest() and source["bytes"] == len(data)


def test_bpe_tokenizer_is_trained_here_and_decodes_back(pydoc_text, tmp_path):
    found = prepare_tokens([pydoc_text], tmp_path / "bpe", kind="bpe", vocab_size=300, progress=False)
    assert (found.tokenizer, found.vocab_size, found.raw["tokenizer_vocab_size"]) == ("bpe", 300, 300)
    train = _tokens(found.directory, "train")
    assert train.max() < 300 and len(train) < pydoc_text.stat().st_size / 1.2  # merges shorten the text
    bpe = tokenizer.load_bpe(str(found.directory / "tokenizer.json"))
    text = pydoc_text.read_text()
    assert bpe.decode(train[:2000].tolist()) == text[: len(bpe.decode(train[:2000].tolist()))]
    assert len(bpe.decode(train[:2000].tolist())) > 2000


def test_the_digest_names_the_data_not_where_or_when_it_was_prepared(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    first = prepare_tokens([text], tmp_path / "first", progress=False)
    moved = tmp_path / "elsewhere" / "a.txt"
    moved.parent.mkdir()
    moved.write_bytes(text.read_bytes())
    again = prepare_tokens([moved], tmp_path / "again", progress=False)  # another path, maybe another second
    raw = json.loads((again.directory / "manifest.json").read_text())
    raw["created_at"] = "1999-01-01T00:00:00"
    (again.directory / "manifest.json").write_text(json.dumps(raw))
    assert len(first.digest) == 64 and read(again.directory).digest == first.digest
    text.write_text("The quick brown fox jumps over the lazy cat.\n" * 40)  # same size, other bytes
    assert prepare_tokens([text], tmp_path / "other", progress=False).digest != first.digest
    bpe = prepare_tokens([moved], tmp_path / "bpe", kind="bpe", vocab_size=260, progress=False).digest
    with open(tmp_path / "bpe" / "tokenizer.json", "a") as handle:
        handle.write(" ")  # the tokenizer file is part of the data
    assert read(tmp_path / "bpe").digest != bpe != first.digest


def test_folders_are_searched_for_text_files_and_files_are_joined_in_order(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("second file\n")
    (folder / "sub" / "a.txt").write_text("nested file\n")
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "named.data").write_text("a file named directly is read whatever its suffix\n")
    found = prepare_tokens([folder, tmp_path / "named.data"], tmp_path / "out", validation_fraction=0.2, progress=False)
    paths = [pathlib.Path(s["path"]).name for s in found.raw["sources"]]
    assert paths == ["b.md", "a.txt", "named.data"]
    tokens = np.concatenate([_tokens(found.directory, "train"), _tokens(found.directory, "validation")])
    assert bytes(tokens.astype(np.uint8)).decode() == "second file\nnested file\na file named directly is read " \
        "whatever its suffix\n"  # fmt: skip


def test_a_failure_half_way_leaves_nothing(pydoc_text, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare, "_split", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_tokens([pydoc_text], tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither out nor the partial directory


def test_unreadable_manifests_are_named(pydoc_bytes, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(pydoc_bytes, copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest.json is corrupt: not JSON"):
        read(copy)
    raw = json.loads((pydoc_bytes / "manifest.json").read_text())
    raw["splits"]["train"]["tokens"] += 1
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match="train.bin holds .* bytes, the manifest says"):
        read(copy)
    with pytest.raises(DataError, match="holds no manifest.json"):
        read(tmp_path)


def _bad_inputs(tmp_path: pathlib.Path) -> list[tuple[list[str], str]]:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "text.txt").write_text("some text\n" * 20)
    (tmp_path / "exists").mkdir()
    out = str(tmp_path / "out")
    return [
        (["prepare", "--text", str(tmp_path / "missing.txt"), "--out", out], "missing.txt' not found"),
        (["prepare", "--text", str(tmp_path / "empty.txt"), "--out", out], "empty.txt' is empty"),
        (["prepare", "--text", str(tmp_path / "empty_folder"), "--out", out], "holds no text files"),
        (["prepare", "--text", str(tmp_path / "text.txt"), "--out", str(tmp_path / "exists")], "already exists"),
        (["prepare", "--text", str(tmp_path / "text.txt"), "--out", out, "--tokenizer", "bpe", "--vocab", "100"],
         "--vocab: a BPE vocabulary needs 257"),
        (["prepare", "--text", str(tmp_path / "text.txt"), "--out", out, "--tokenizer", "words"], "invalid choice"),
        (["prepare", "--out", out], "the following arguments are required: --text"),
        ([], "required: {prepare,pydoc-text,python-source}"),
    ]  # fmt: skip


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    for args, message in _bad_inputs(tmp_path):
        before = sorted(tmp_path.iterdir())
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("jaxscale: error: ") and "\n" not in err and message in err, (args, err)
        assert sorted(tmp_path.iterdir()) == before


def test_pydoc_text_command_writes_pythons_own_documentation(tmp_path, capsys):
    from jaxscale.data import corpus

    assert main(["pydoc-text", "--out", str(tmp_path / "sub" / "pydoc.txt")]) == 0
    text = (tmp_path / "sub" / "pydoc.txt").read_text(encoding="utf-8")
    assert text == corpus.pydoc_topics_text() and len(text) > 100_000
    assert 'The "if" statement' in text and "wrote" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["pydoc.txt"]  # no partial file left


def test_python_source_command_writes_the_standard_librarys_code(tmp_path, capsys):
    """Each file of the packages after a `# file:` line, whole: json's own source is there as Python ships it."""
    import json
    import pathlib

    assert main(["python-source", "--out", str(tmp_path / "python.txt")]) == 0
    text = (tmp_path / "python.txt").read_text(encoding="utf-8")
    json_init = pathlib.Path(json.__file__)
    assert f"# file: json/__init__.py\n{json_init.read_text(encoding='utf-8')}" in text
    assert text.count("# file: asyncio/") > 10 and "wrote" in capsys.readouterr().out


def test_command_line_help_and_a_real_process(pydoc_text, tmp_path):
    helped = run_cli("jaxscale.data", "prepare", "--help")
    assert helped.returncode == 0 and "--tokenizer {bytes,bpe}" in helped.stdout and "--vocab" in helped.stdout
    done = run_cli("jaxscale.data", "prepare", "--text", str(pydoc_text), "--out", str(tmp_path / "d"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokenize" in done.stderr  # the progress bar
    assert f"--config.data.path={tmp_path / 'd'} --config.model.vocab_size=256" in done.stdout
    missing = run_cli("jaxscale.data", "prepare", "--text", str(tmp_path / "nope"), "--out", str(tmp_path / "e"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and not (tmp_path / "e").exists()

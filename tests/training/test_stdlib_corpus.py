"""Standard-library corpus: file selection, split, token stream, held-out prompts."""

from pathlib import Path

import pytest
import torch

from dflash.tiny.corpus import (
    HELDOUT_PACKAGES,
    encode_corpus,
    heldout_prompts,
    load_corpus,
    stdlib_files,
    stdlib_root,
    top_level_name,
)
from dflash.tiny.tokenizer import ByteTokenizer


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    _write(root, "json/__init__.py", "import json\n\ndef dumps(x):\n    return x\n")
    _write(root, "json/decoder.py", "class JSONDecoder:\n    pass\n")
    _write(root, "xmlrpc/client.py", "x = 1\n")  # not `xml`: stays in train
    _write(root, "argparse.py", "import sys\nclass ArgumentParser:\n    pass\n")
    _write(root, "email/mime/text.py", "# text\nclass MIMEText:\n    pass\n")
    _write(root, "test/test_json.py", "leak = 1\n")
    _write(root, "unittest/test/test_case.py", "leak = 2\n")
    _write(root, "site-packages/numpy/core.py", "third_party = 1\n")
    _write(root, "pydoc_data/topics.py", "topics = {}\n")
    _write(root, "encodings/cp999.py", '""" Python Character Mapping Codec cp999 generated with gencodec.py.\n"""\n')
    _write(root, "encodings/utf_8.py", "import codecs\n")
    _write(root, "_sysconfigdata__linux.py", "build_time_vars = {}\n")
    _write(root, "README.txt", "not python\n")
    return root


def _rel(paths, root):
    return [p.relative_to(root.resolve()).as_posix() for p in paths]


def test_fake_tree_selection_and_split(fake_stdlib):
    train = _rel(stdlib_files("train", fake_stdlib), fake_stdlib)
    heldout = _rel(stdlib_files("heldout", fake_stdlib), fake_stdlib)
    assert train == ["argparse.py", "encodings/utf_8.py", "xmlrpc/client.py"]
    assert heldout == ["email/mime/text.py", "json/__init__.py", "json/decoder.py"]


def test_fake_tree_token_stream(fake_stdlib):
    files = load_corpus("train", fake_stdlib)
    ids = encode_corpus("train", fake_stdlib)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.numel() == sum(len(f) + 1 for f in files)
    eos_positions = (ids == ByteTokenizer.eos_token_id).nonzero().flatten().tolist()
    ends, offset = [], 0
    for f in files:
        offset += len(f) + 1
        ends.append(offset - 1)
    assert eos_positions == ends
    assert bytes(ids[: len(files[0])].tolist()) == files[0]


def test_bad_split():
    with pytest.raises(ValueError, match="split must be one of"):
        stdlib_files("validation")


def test_real_split_deterministic_and_disjoint():
    root = stdlib_root()
    train, heldout = stdlib_files("train"), stdlib_files("heldout")
    assert train == stdlib_files("train") and heldout == stdlib_files("heldout")
    rel_train, rel_heldout = _rel(train, root), _rel(heldout, root)
    assert rel_train == sorted(rel_train) and rel_heldout == sorted(rel_heldout)
    assert not set(rel_train) & set(rel_heldout)
    assert len(train) > 300 and len(heldout) > 40
    assert {top_level_name(p) for p in rel_heldout} == set(HELDOUT_PACKAGES)
    assert not {top_level_name(p) for p in rel_train} & set(HELDOUT_PACKAGES)
    for rel in rel_train + rel_heldout:
        parts = rel.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "pydoc_data"} & set(parts[:-1]), rel
    assert "argparse.py" in rel_train and "json/decoder.py" in rel_heldout


def test_real_token_stream():
    ids = encode_corpus("heldout")
    files = load_corpus("heldout")
    assert ids.numel() == sum(len(f) + 1 for f in files)
    assert int((ids == ByteTokenizer.eos_token_id).sum()) == len(files)
    assert int(ids.max()) <= ByteTokenizer.eos_token_id and int(ids.min()) >= 0
    assert int(ids[-1]) == ByteTokenizer.eos_token_id


def test_heldout_prompts_deterministic():
    a = heldout_prompts(8, 64, seed=3, following=32)
    assert a == heldout_prompts(8, 64, seed=3, following=32)
    assert a != heldout_prompts(8, 64, seed=4, following=32)
    assert len(a) == 8 and all(len(p) == 64 for p in a)
    assert all(0 <= i < 256 for p in a for i in p)
    # Every prompt starts a non-blank line of one held-out file and has room for `following` bytes.
    files = load_corpus("heldout")
    for p in a:
        needle = bytes(p)
        assert needle[:1] not in (b"\n", b"\r")
        found = False
        for data in files:
            i = data.find(needle)
            while i >= 0 and not found:
                found = (i == 0 or data[i - 1:i] == b"\n") and i + 64 + 32 <= len(data)
                i = data.find(needle, i + 1)
            if found:
                break
        assert found, needle


def test_heldout_prompts_fake_tree(fake_stdlib):
    prompts = heldout_prompts(3, 5, seed=0, root=fake_stdlib)
    starts = {bytes(p) for p in prompts}
    line_starts = set()
    for data in load_corpus("heldout", fake_stdlib):
        for i, _ in enumerate(data):
            if (i == 0 or data[i - 1:i] == b"\n") and data[i:i + 1] != b"\n" and i + 5 <= len(data):
                line_starts.add(data[i:i + 5])
    assert starts <= line_starts
    with pytest.raises(ValueError, match="eligible line starts"):
        heldout_prompts(1000, 5, root=fake_stdlib)
    with pytest.raises(ValueError, match="prompt_len > 0"):
        heldout_prompts(1, 0, root=fake_stdlib)

"""Byte tokenizer: ids, round trip, special ids, save / load."""

import json

import pytest

from dflash.tiny.tokenizer import TOKENIZER_CONFIG_NAME, ByteTokenizer, is_byte_tokenizer_dir


def test_ids_and_vocab():
    tok = ByteTokenizer()
    assert (tok.mask_token_id, tok.eos_token_id, tok.vocab_size) == (256, 257, 258)
    assert tok.encode("A\n") == [65, 10]
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode("ab", add_eos=True) == [97, 98, 257]
    assert tok.encode("") == []


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x + 1\n", "naïve → ünïcödé 日本語 🐍", "\x00\xff"])
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_decode_special_and_invalid():
    tok = ByteTokenizer()
    ids = [104, 256, 105, 257]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "h<mask>i<eos>"
    # A lone continuation byte is not UTF-8: replaced, not raised.
    assert tok.decode([0x80, 65]) == "\ufffdA"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([258])
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="expects str"):
        tok.encode(b"bytes")


def test_decode_tensor():
    torch = pytest.importorskip("torch")
    tok = ByteTokenizer()
    assert tok.decode(torch.tensor([111, 107, 257])) == "ok"


def test_save_and_load(tmp_path):
    tok = ByteTokenizer()
    path = tok.save_pretrained(tmp_path / "model")
    assert path.name == TOKENIZER_CONFIG_NAME
    config = json.loads(path.read_text())
    assert config == {"type": "byte", "vocab_size": 258, "mask_token_id": 256, "eos_token_id": 257}
    assert is_byte_tokenizer_dir(tmp_path / "model")
    loaded = ByteTokenizer.from_pretrained(tmp_path / "model")
    assert loaded.encode("x") == [120]


def test_load_rejects_other_tokenizers(tmp_path):
    (tmp_path / TOKENIZER_CONFIG_NAME).write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    assert not is_byte_tokenizer_dir(tmp_path)
    with pytest.raises(ValueError, match="not a byte tokenizer"):
        ByteTokenizer.from_pretrained(tmp_path)
    (tmp_path / TOKENIZER_CONFIG_NAME).write_text(json.dumps({"type": "byte", "eos_token_id": 0}))
    with pytest.raises(ValueError, match="eos_token_id"):
        ByteTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        ByteTokenizer.from_pretrained(tmp_path / "missing")
    assert not is_byte_tokenizer_dir(tmp_path / "missing")

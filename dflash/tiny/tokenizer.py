"""Byte-level tokenizer of the tiny demo models.

Ids 0..255 are the bytes of the UTF-8 encoding of the text; two special ids
follow: ``mask_token_id = 256`` (the drafter's MASK placeholder) and
``eos_token_id = 257`` (end of text, also the boundary between corpus files).
``vocab_size = 258``.

A model directory carries the tokenizer as ``tokenizer_config.json``::

    {"type": "byte", "vocab_size": 258, "mask_token_id": 256, "eos_token_id": 257}

so that loading code can tell it apart from a Hugging Face tokenizer directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Union

__all__ = ["ByteTokenizer", "TOKENIZER_CONFIG_NAME", "is_byte_tokenizer_dir"]

TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
_TYPE_MARKER = "byte"


class ByteTokenizer:
    """Text <-> token ids, one id per UTF-8 byte, plus MASK and EOS ids."""

    num_byte_ids = 256
    mask_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    @property
    def special_token_ids(self) -> tuple[int, int]:
        """The ids that are not bytes: ``(mask_token_id, eos_token_id)``."""
        return (self.mask_token_id, self.eos_token_id)

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids; ``add_eos`` appends ``eos_token_id``."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids in ``ids``.

        Special ids (MASK, EOS) are dropped when ``skip_special_tokens`` (the
        default), otherwise rendered as ``<mask>`` / ``<eos>``. Invalid UTF-8
        becomes U+FFFD (``errors="replace"``). Accepts any iterable of ints,
        including a 1-D tensor. Ids outside ``[0, vocab_size)`` are an error.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        pieces: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.num_byte_ids:
                run.append(i)
                continue
            if i not in self.special_token_ids:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, {self.vocab_size})")
            if not skip_special_tokens:
                pieces.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                pieces.append("<mask>" if i == self.mask_token_id else "<eos>")
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def to_config(self) -> dict:
        """The JSON-able description written by :meth:`save_pretrained`."""
        return {
            "type": _TYPE_MARKER,
            "vocab_size": self.vocab_size,
            "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id,
        }

    def save_pretrained(self, directory: Union[str, Path]) -> Path:
        """Write ``tokenizer_config.json`` into ``directory`` (created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_CONFIG_NAME
        path.write_text(json.dumps(self.to_config(), indent=2) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, directory: Union[str, Path]) -> "ByteTokenizer":
        """Load from a directory written by :meth:`save_pretrained`.

        Raises ``ValueError`` when the directory holds a tokenizer config that
        is not a byte tokenizer, or one with different special ids.
        """
        path = Path(directory) / TOKENIZER_CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_CONFIG_NAME} in {directory}")
        config = json.loads(path.read_text())
        if config.get("type") != _TYPE_MARKER:
            raise ValueError(
                f"{path} is not a byte tokenizer config (type={config.get('type')!r}, expected 'byte')"
            )
        tok = cls()
        expected = tok.to_config()
        for key in ("vocab_size", "mask_token_id", "eos_token_id"):
            if key in config and config[key] != expected[key]:
                raise ValueError(f"{path}: {key}={config[key]} but the byte tokenizer uses {expected[key]}")
        return tok

    def __repr__(self) -> str:
        return (
            f"ByteTokenizer(vocab_size={self.vocab_size}, mask_token_id={self.mask_token_id}, "
            f"eos_token_id={self.eos_token_id})"
        )


def is_byte_tokenizer_dir(directory: Union[str, Path]) -> bool:
    """True when ``directory`` holds a ``tokenizer_config.json`` of type ``byte``."""
    path = Path(directory) / TOKENIZER_CONFIG_NAME
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("type") == _TYPE_MARKER
    except (json.JSONDecodeError, AttributeError):
        return False

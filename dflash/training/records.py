"""Training records on disk: the JSONL format, its reader and writer, and where a block may start.

One sequence per line, in either form::

    {"input_ids": [...], "loss_mask": [0 ..., 1 ...]}    token ids; loss_mask optional (default all ones)
    {"text": "..."}                                       tokenized by the target's tokenizer, all supervised

``loss_mask[t] = 1`` marks positions whose token is a training target (for
regenerated chat data: the assistant tokens the target wrote). Other keys
(``source``, ``turn``) are ignored by the reader. Every error names the file
and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

import torch

__all__ = [
    "DataError",
    "TrainingSequence",
    "write_jsonl",
    "valid_anchor_mask",
    "read_training_jsonl",
    "read_prompts_jsonl",
]


class DataError(ValueError):
    """Training or prompt data that cannot be used; the message names the file and line."""


@dataclass
class TrainingSequence:
    """One training sequence: ``input_ids [T]`` and ``loss_mask [T]`` (bool), from ``line`` of the file."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    line: int


def write_jsonl(records: Sequence[dict], path: Union[str, Path]) -> Path:
    """One JSON object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return path


def valid_anchor_mask(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool ``[T]``: where a block ``[anchor, MASK x (B-1)]`` may start.

    Anchor ``a`` is valid iff ``1 <= a`` (at least one context row before it,
    as at inference, where the prompt precedes every block) and its ``B-1``
    supervised positions ``a+1 .. a+B-1`` lie inside the sequence and inside
    the loss mask.
    """
    T, B = loss_mask.numel(), int(block_size)
    valid = torch.zeros(T, dtype=torch.bool)
    if T < B + 1:
        return valid
    m = torch.cat([torch.zeros(1, dtype=torch.long), loss_mask.long().cumsum(0)])  # m[i] = sum(mask[:i])
    a = torch.arange(1, T - B + 1)
    valid[a] = (m[a + B] - m[a + 1]) == (B - 1)
    return valid


def _parse_line(path, lineno: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path} line {lineno}: expected a JSON object with 'input_ids' or 'text', "
                        f"got {type(record).__name__}")
    return record


def _encode_text(tokenizer, text: str) -> List[int]:
    ids = tokenizer.encode(text)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _record_ids(path, lineno: int, record: dict, tokenizer, vocab_size: int) -> List[int]:
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise DataError(f"{path} line {lineno}: 'input_ids' must be a list of integer token ids")
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{path} line {lineno}: 'text' must be a string, got {type(record['text']).__name__}")
        if tokenizer is None:
            raise DataError(f"{path} line {lineno}: a text record needs a tokenizer (give --tokenizer)")
        ids = _encode_text(tokenizer, record["text"])
    else:
        raise DataError(f"{path} line {lineno}: the object has neither 'input_ids' nor 'text' "
                        f"(keys: {sorted(record)})")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise DataError(f"{path} line {lineno}: token id {t} at index {i} is outside the vocabulary "
                            f"[0, {vocab_size})")
    return ids


def read_training_jsonl(path: Union[str, Path], vocab_size: int, block_size: int, tokenizer=None,
                        max_length: Optional[int] = None) -> List[TrainingSequence]:
    """Training sequences from a JSONL file (token-id or text records; blank lines skipped).

    Every record must give at least one valid block (see
    :func:`valid_anchor_mask`); ``max_length`` crops longer sequences.
    Raises :class:`DataError` naming the line: empty file, malformed JSON,
    neither ``input_ids`` nor ``text``, ids outside ``[0, vocab_size)``, a
    ``loss_mask`` of the wrong length or not 0/1, a sequence shorter than one
    block plus one context token, or a loss mask that leaves no block.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"training data {path} does not exist")
    B = int(block_size)
    out: List[TrainingSequence] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = _parse_line(path, lineno, line)
            ids = _record_ids(path, lineno, record, tokenizer, vocab_size)
            mask = record.get("loss_mask")
            if mask is None:
                mask = [1] * len(ids)
            elif not isinstance(mask, list) or len(mask) != len(ids):
                raise DataError(f"{path} line {lineno}: 'loss_mask' must be a list as long as the sequence "
                                f"({len(ids)}), got {len(mask) if isinstance(mask, list) else type(mask).__name__}")
            elif any(m not in (0, 1) for m in mask):
                raise DataError(f"{path} line {lineno}: 'loss_mask' entries must be 0 or 1")
            if max_length is not None:
                ids, mask = ids[:max_length], mask[:max_length]
            if len(ids) < B + 1:
                raise DataError(f"{path} line {lineno}: sequence of {len(ids)} tokens is shorter than one block "
                                f"plus one context token ({B + 1} for block size {B})")
            seq = TrainingSequence(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), lineno)
            if not bool(valid_anchor_mask(seq.loss_mask, B).any()):
                raise DataError(f"{path} line {lineno}: no block of {B} positions fits: a block needs its {B - 1} "
                                "positions after the anchor inside the sequence and the loss mask")
            out.append(seq)
    if not out:
        raise DataError(f"training data {path} is empty: no sequences")
    return out


def read_prompts_jsonl(path: Union[str, Path], vocab_size: int, tokenizer=None) -> List[List[int]]:
    """Evaluation prompts from JSONL (``{"input_ids": [...]}`` or ``{"text": ...}`` per line)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            ids = _record_ids(path, lineno, _parse_line(path, lineno, line), tokenizer, vocab_size)
            if not ids:
                raise DataError(f"{path} line {lineno}: empty prompt")
            prompts.append(ids)
    if not prompts:
        raise DataError(f"prompt file {path} is empty: no prompts")
    return prompts

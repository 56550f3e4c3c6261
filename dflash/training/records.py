"""Training records on disk: the JSONL format, its reader and writer, and where a block may start.

One sequence per line, in either form::

    {"input_ids": [...], "loss_mask": [0 ..., 1 ...]}    token ids; loss_mask optional (default all ones)
    {"text": "..."}                                       tokenized by the target's tokenizer, all supervised

``loss_mask[t] = 1`` marks positions whose token is a training target (for
regenerated chat data: the assistant tokens the target wrote). Other keys
(``source``, ``turn``) are ignored by the reader. Every error names the file
and the line.

Packing (:func:`pack_sequences`, ``python -m dflash train --pack``) puts
several samples end to end into one sequence of at most ``--max-length``
tokens. A packed sequence keeps its samples' lengths (``segments``): each
sample's target features come from its own target pass at positions
``0..len-1``, its blocks take their anchors inside it and see only its own
context rows at its own positions, so every block computes exactly what it
computes when its sample is trained alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "DataError",
    "TrainingSequence",
    "write_jsonl",
    "valid_anchor_mask",
    "sequence_anchor_mask",
    "segment_starts",
    "pack_sequences",
    "read_training_jsonl",
    "read_prompts_jsonl",
]


class DataError(ValueError):
    """Training or prompt data that cannot be used; the message names the file and line."""


@dataclass
class TrainingSequence:
    """One training sequence: ``input_ids [T]`` and ``loss_mask [T]`` (bool), from ``line`` of the file.

    A packed sequence (:func:`pack_sequences`) also carries ``segments``, the
    lengths of its samples in order (summing to ``T``), and ``lines``, their
    lines; ``line`` is then its first sample's line.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    line: int
    segments: Optional[Tuple[int, ...]] = None
    lines: Optional[Tuple[int, ...]] = None


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


def segment_starts(seq: TrainingSequence) -> torch.Tensor:
    """int64 ``[T]``: the first row of the sample each row belongs to (all 0 for an unpacked sequence).

    Row ``r``'s position inside its sample is ``r - segment_starts(seq)[r]``.
    """
    T = seq.input_ids.numel()
    if seq.segments is None:
        return torch.zeros(T, dtype=torch.long)
    lengths = torch.tensor(seq.segments, dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts, lengths)


def sequence_anchor_mask(seq: TrainingSequence, block_size: int) -> torch.Tensor:
    """:func:`valid_anchor_mask` of each sample of ``seq`` in turn: a packed sequence's blocks start and end
    inside one sample, with at least one of its rows before the anchor."""
    if seq.segments is None:
        return valid_anchor_mask(seq.loss_mask, block_size)
    return torch.cat([valid_anchor_mask(m, block_size) for m in torch.split(seq.loss_mask, list(seq.segments))])


def pack_sequences(sequences: Sequence[TrainingSequence], max_length: int,
                   block_size: int) -> List[TrainingSequence]:
    """Samples packed end to end, in order, into sequences of at most ``max_length`` tokens.

    Next-fit in file order (deterministic): a sample joins the current pack
    while the pack stays within ``max_length``, else it starts the next one.
    Each pack keeps its samples' lengths (``segments``) and lines; see the
    module docstring for what that guarantees. Raises ValueError for a
    ``max_length`` below one block plus one context token or a sample longer
    than ``max_length`` (crop first: ``read_training_jsonl(max_length=)``).
    """
    B, limit = int(block_size), int(max_length)
    if limit < B + 1:
        raise ValueError(f"a packed length of {limit} tokens holds no block: it must be >= {B + 1} (one block of "
                         f"{B} plus one context token)")
    packs: List[List[TrainingSequence]] = []
    size = 0
    for seq in sequences:
        n = seq.input_ids.numel()
        if n > limit:
            raise ValueError(f"line {seq.line}: a sample of {n} tokens does not fit a packed length of {limit}")
        if seq.segments is not None:
            raise ValueError(f"line {seq.line}: already packed")
        if not packs or size + n > limit:
            packs.append([])
            size = 0
        packs[-1].append(seq)
        size += n
    out = []
    for group in packs:
        if len(group) == 1:
            out.append(group[0])
            continue
        out.append(TrainingSequence(torch.cat([s.input_ids for s in group]), torch.cat([s.loss_mask for s in group]),
                                    group[0].line, segments=tuple(s.input_ids.numel() for s in group),
                                    lines=tuple(s.line for s in group)))
    return out


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

"""Drafter training data: the target's own greedy continuations, and the JSONL reader.

A DFlash drafter learns to predict what the *target* would generate, so its
best training text is the target's own output. This module

* samples *held-in* prompts (line starts in the train split of
  :mod:`dflash.tiny.corpus`; the held-out packages stay unseen),
* continues them greedily with the target, batched through Hugging Face
  ``generate`` (equal-length prompts, so no padding),
* writes token-id JSONL, one sequence per line::

      {"input_ids": [prompt ..., continuation ...], "loss_mask": [0 ..., 1 ...]}

  ``loss_mask[t] = 1`` marks positions whose token is a training target. The
  prompt is unsupervised on purpose: inside real (not target-written) text the
  target's choice at block position ``k >= 2`` is conditioned on real
  intermediate tokens the drafter cannot see, unlike at inference time, where
  they are the target's own choices.
* reads training JSONL back (:func:`read_training_jsonl`), in either format:
  token ids as above (``loss_mask`` optional, default all ones) or text
  (``{"text": "..."}``, tokenized, all positions supervised), with errors that
  name the file and line of anything wrong.

Command line (writes the shipped drafter's data set)::

    python -m dflash.training.data --target dflash/assets/tiny/target --out DATA.jsonl \
        --num 2048 --prompt-len 128 --new-tokens 256 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

import torch

from ..tiny.corpus import line_start_prompts

__all__ = [
    "DataError",
    "TrainingSequence",
    "heldin_prompts",
    "greedy_continuations",
    "build_greedy_records",
    "write_jsonl",
    "valid_anchor_mask",
    "read_training_jsonl",
    "read_prompts_jsonl",
    "main",
]


class DataError(ValueError):
    """Training or prompt data that cannot be used; the message names the file and line."""


@dataclass
class TrainingSequence:
    """One training sequence: ``input_ids [T]`` and ``loss_mask [T]`` (bool), from ``line`` of the file."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    line: int


# --------------------------------------------------------------------------- prompts


def heldin_prompts(n: int, prompt_len: int, seed: int = 0, following: int = 0,
                   root: Optional[Union[str, Path]] = None) -> List[List[int]]:
    """``n`` prompts of ``prompt_len`` byte ids from the *train* split of the stdlib corpus.

    Each starts at a non-blank line start of one train file and stays inside
    it, with ``following`` more bytes of the file after it. Start points are
    drawn without replacement by ``random.Random(seed)`` (deterministic for
    given arguments and interpreter). The held-out packages (json, email,
    asyncio, xml) are never used, so evaluation on them stays fair.
    """
    return line_start_prompts("train", n, prompt_len, seed, following, root)


# --------------------------------------------------------------------------- generation


@torch.no_grad()
def greedy_continuations(target, prompts: Sequence[Sequence[int]], new_tokens: int, batch_size: int = 64,
                         eos_token_id: Optional[int] = None, progress: bool = False) -> List[List[int]]:
    """Greedy continuations (``new_tokens`` ids at most) of equal-length ``prompts``.

    Batched ``target.generate(do_sample=False)``; a continuation ends right
    after the first ``eos_token_id`` (the rest of its row is padding).
    """
    if not prompts:
        return []
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("greedy_continuations needs prompts of equal length (batched without padding)")
    if new_tokens < 1 or batch_size < 1:
        raise ValueError(f"need new_tokens >= 1 and batch_size >= 1, got {new_tokens}, {batch_size}")
    device = next(target.parameters()).device
    pad = eos_token_id if eos_token_id is not None else 0
    out: List[List[int]] = []
    starts = range(0, len(prompts), batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="greedy continuations", unit="batch")
    for b0 in starts:
        ids = torch.tensor([list(p) for p in prompts[b0:b0 + batch_size]], dtype=torch.long, device=device)
        gen = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad)
        for row in gen[:, ids.shape[1]:].tolist():
            if eos_token_id is not None and eos_token_id in row:
                row = row[:row.index(eos_token_id) + 1]
            out.append(row)
    return out


def build_greedy_records(target, prompts: Sequence[Sequence[int]], new_tokens: int, batch_size: int = 64,
                         eos_token_id: Optional[int] = None, min_new_tokens: int = 16,
                         progress: bool = False) -> List[dict]:
    """Token-id records ``{"input_ids", "loss_mask"}``: prompt (mask 0) + greedy continuation (mask 1).

    Continuations shorter than ``min_new_tokens`` (the target ended the
    text at once) are dropped: they hold no full block to learn from.
    """
    records = []
    for prompt, cont in zip(prompts, greedy_continuations(target, prompts, new_tokens, batch_size, eos_token_id,
                                                          progress)):
        if len(cont) < min_new_tokens:
            continue
        records.append({"input_ids": list(prompt) + cont, "loss_mask": [0] * len(prompt) + [1] * len(cont)})
    return records


def write_jsonl(records: Sequence[dict], path: Union[str, Path]) -> Path:
    """One JSON object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return path


# --------------------------------------------------------------------------- reading


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


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dflash.training.data``: write the target's greedy continuations of held-in prompts."""
    p = argparse.ArgumentParser(prog="python -m dflash.training.data", description=main.__doc__)
    p.add_argument("--target", required=True, help="local target directory (byte tokenizer: stdlib prompts)")
    p.add_argument("--out", required=True, help="output JSONL file")
    p.add_argument("--num", type=int, default=2048, help="number of prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens (bytes)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy continuation length")
    p.add_argument("--min-new-tokens", type=int, default=16, help="drop continuations shorter than this")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from ..tiny.pair import load_target, load_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target)
    if getattr(tokenizer, "num_byte_ids", None) != 256:
        raise SystemExit("drafter_data builds stdlib prompts for byte-level targets only; for other targets write "
                         "your own JSONL (text or input_ids)")
    start = time.perf_counter()
    prompts = heldin_prompts(args.num, args.prompt_len, seed=args.seed, following=args.new_tokens)
    records = build_greedy_records(target, prompts, args.new_tokens, args.batch_size,
                                   eos_token_id=tokenizer.eos_token_id, min_new_tokens=args.min_new_tokens,
                                   progress=True)
    write_jsonl(records, args.out)
    tokens = sum(len(r["input_ids"]) for r in records)
    print(f"wrote {len(records)} sequences ({tokens} tokens; {args.num - len(records)} dropped) to {args.out} "
          f"in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

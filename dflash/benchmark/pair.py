"""The benchmarked pair: loaded from ``--target`` / ``--draft`` (or the embedded tiny pair), its stop ids and
its description in the results."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class Pair:
    """The target, its drafter (Optional), the tokenizer and the device they run on."""

    target: torch.nn.Module
    draft: Optional[torch.nn.Module]
    tokenizer: object
    device: torch.device


def load_pair_for(args, device: torch.device, dtype: torch.dtype, notes: List[str]) -> Pair:
    from ..tiny.pair import load_default_pair, load_pair

    if (args.target is None) != (args.draft is None):
        raise SystemExit("give both --target and --draft, or neither (the embedded default pair)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.target is None:
            target, draft, tokenizer = load_default_pair(dtype=dtype, device=device)
        else:
            target, draft, tokenizer = load_pair(args.target, args.draft, dtype=dtype, device=device)
    for w in caught:
        if "default pair" in str(w.message) or "not shipped" in str(w.message):
            notes.append(f"Pair: {w.message}")
        print(f"warning: {w.message}", file=sys.stderr)
    return Pair(target, draft, tokenizer, device)


def stop_ids_for(pair: Pair, ignore_eos: bool) -> List[int]:
    """End-of-text ids: the tokenizer's and the target's generation config's (both sides stop at the same ids)."""
    if ignore_eos:
        return []
    ids = []
    for value in (getattr(pair.tokenizer, "eos_token_id", None),
                  getattr(getattr(pair.target, "generation_config", None), "eos_token_id", None)):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


def describe_pair(pair: Pair) -> dict:
    cfg = pair.target.config
    out = dict(target=type(pair.target).__name__, target_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
               vocab=cfg.vocab_size, tokenizer=type(pair.tokenizer).__name__)
    if pair.draft is not None:
        out.update(draft_layers=pair.draft.config.num_hidden_layers, draft_block_size=int(pair.draft.block_size),
                   target_layer_ids=list(pair.draft.target_layer_ids))
    return out

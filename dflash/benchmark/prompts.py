"""The benchmark's prompts: a JSONL file of texts or token ids, or held-out standard-library code."""

from __future__ import annotations

import json
from typing import List

import torch


def read_prompts_jsonl(path, tokenizer) -> List[List[int]]:
    """Token ids from a JSONL file of ``{"input_ids": [...]}`` or ``{"prompt": "text"}`` lines."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            if isinstance(item, dict) and "input_ids" in item:
                ids = item["input_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                    raise ValueError(f"{path}:{n}: input_ids must be a non-empty list of ints")
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                ids = encode_text(tokenizer, item["prompt"])
            else:
                raise ValueError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"input_ids": [...]}}')
            prompts.append(list(ids))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def encode_text(tokenizer, text: str) -> List[int]:
    ids = tokenizer.encode(text)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    return list(ids)


def builtin_prompts(tokenizer, n: int, prompt_len: int, seed: int) -> List[List[int]]:
    """Held-out standard-library code (json, email, asyncio, xml): never seen in training of the tiny pair.

    With the byte tokenizer the bytes are the ids; another tokenizer encodes
    the text of those bytes.
    """
    from ..tiny.corpus import heldout_prompts
    from ..tiny.tokenizer import ByteTokenizer

    chunks = heldout_prompts(n, prompt_len, seed)
    if isinstance(tokenizer, ByteTokenizer):
        return chunks
    return [encode_text(tokenizer, bytes(c).decode("utf-8", errors="ignore")) for c in chunks]


def bench_prompts(args, pair, device):
    """``(prompt tensors, prompts, source)``: the JSONL prompts or the built-in held-out ones, checked against
    the target's vocabulary."""
    if args.prompts:
        prompts = read_prompts_jsonl(args.prompts, pair.tokenizer)[: args.num_prompts]
        source = str(args.prompts)
    else:
        prompts = builtin_prompts(pair.tokenizer, args.num_prompts, args.prompt_len, args.seed)
        source = f"built-in: {args.num_prompts} held-out stdlib prompts of {args.prompt_len} bytes"
    vocab = pair.target.config.vocab_size
    for i, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab:
            raise SystemExit(f"prompt {i} holds ids outside the target vocabulary [0, {vocab})")
    return [torch.tensor(p, dtype=torch.long, device=device) for p in prompts], prompts, source

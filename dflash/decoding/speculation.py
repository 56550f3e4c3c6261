"""State and helpers every decoding loop shares: prompt and argument checks, the committed
output, the stage clock, the prefill, the drafter pass, and :class:`Speculation` (the per-call
state of the DFlash and DDTree loops)."""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

from ..drafter.cache import DraftKVCache
from ..drafter.config import DraftConfigError, validate_target_layer_ids
from ..target import TargetAdapter
from .result import GenerationResult


class _Clock:
    """Wall-clock stage timer; synchronizes CUDA only when asked to time stages."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = sync and device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def _prepare_prompt(input_ids, vocab_size: int, device) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"batch size {input_ids.shape[0]} is not supported: pass one prompt (input_ids [1, T])")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty: generation needs at least one input token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids hold ids outside the target vocabulary [0, {vocab_size}): min {lo}, max {hi}")
    return input_ids.to(device=device, dtype=torch.long)


def _check_common(max_new_tokens, temperature, stop_token_ids):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    return set(int(t) for t in (stop_token_ids or ()))


class _Output:
    """Committed tokens with the max_new_tokens / stop-token rules applied."""

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, stop_ids: set):
        self.tokens: List[int] = prompt.tolist()
        self.num_prompt = len(self.tokens)
        self.max_new = max_new_tokens
        self.stop_ids = stop_ids
        self.done = False

    def extend(self, new: Sequence[int]) -> None:
        for t in new:
            self.tokens.append(int(t))
            if int(t) in self.stop_ids or len(self.tokens) - self.num_prompt >= self.max_new:
                self.done = True
                return

    @property
    def last(self) -> int:
        return self.tokens[-1]

    @property
    def committed(self) -> int:
        return len(self.tokens)


def _generator(seed: Optional[int], device) -> Optional[torch.Generator]:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


@torch.inference_mode()
def _prefill(adapter: TargetAdapter, prompt, cache, temperature, gen):
    positions = torch.arange(prompt.numel(), device=prompt.device)
    hidden = adapter.forward(prompt, positions, cache)
    cache.commit(prompt.numel())
    last = torch.tensor([prompt.numel() - 1], device=prompt.device)
    first = adapter.choose(hidden, temperature, positions=last, generator=gen)
    return first


def check_pair(adapter: TargetAdapter, draft) -> None:
    """The drafter fits the target: layer count, hidden size, vocab, fc width."""
    cfg = draft.config
    if int(cfg.num_target_layers) != adapter.num_layers:
        raise DraftConfigError(
            f"drafter was built for a {cfg.num_target_layers}-layer target, this target has {adapter.num_layers} layers"
        )
    validate_target_layer_ids(draft.target_layer_ids, adapter.num_layers, warn_repeats=False)
    if cfg.hidden_size != adapter.hidden_size:
        raise DraftConfigError(f"drafter hidden_size {cfg.hidden_size} != target hidden size {adapter.hidden_size}")
    if cfg.vocab_size != adapter.vocab_size:
        raise DraftConfigError(f"drafter vocab_size {cfg.vocab_size} != target vocabulary {adapter.vocab_size}")
    want = len(draft.target_layer_ids) * adapter.hidden_size
    if draft.fc.in_features != want:
        raise DraftConfigError(
            f"drafter fc takes {draft.fc.in_features} features but {len(draft.target_layer_ids)} target layers of "
            f"width {adapter.hidden_size} give {want}"
        )


def draft_block(draft, adapter: TargetAdapter, last_token: int, context, positions, cache,
                mask_token_id: Optional[int] = None) -> torch.Tensor:
    """One drafter pass: final-normed states ``[B, H]`` of ``[last_token, MASK x (B-1)]``."""
    B = positions.numel() - context.shape[0]
    mask = draft.mask_token_id if mask_token_id is None else mask_token_id
    ids = torch.full((B,), mask, dtype=torch.long, device=adapter.device)
    ids[0] = last_token
    return draft(adapter.embed(ids), context, positions, cache=cache)


class Speculation:
    """State of one speculative generation, shared by the DFlash and DDTree loops.

    Owns the target adapter (capture hooks), both caches, the committed
    output and the result; ``prefill()`` then rounds of ``draft()`` and the
    loop's own verify/commit, then ``finish()``. Use as a context manager
    (removes the hooks).
    """

    def __init__(self, target, draft, input_ids, *, method, max_new_tokens, temperature, stop_token_ids, block_size,
                 seed, tree_size: int = 0, mask_token_id=None, stage_timing=True):
        stop_ids = _check_common(max_new_tokens, temperature, stop_token_ids)
        self.B = int(block_size if block_size is not None else draft.block_size)
        if self.B < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {self.B}")
        self.adapter = adapter = TargetAdapter(target, draft.target_layer_ids)
        try:
            check_pair(adapter, draft)
            self.mask_token_id = draft.mask_token_id if mask_token_id is None else int(mask_token_id)
            if not 0 <= self.mask_token_id < adapter.vocab_size:
                raise ValueError(
                    f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {adapter.vocab_size})"
                )
            self.device = device = adapter.device
            prompt = _prepare_prompt(input_ids, adapter.vocab_size, device)
        except BaseException:
            adapter.close()
            raise
        self.draft_model, self.temperature, self.prompt = draft, temperature, prompt
        self.generator = _generator(seed, device)
        # verify writes B (chain) or tree_size + 1 (tree) rows past the committed length
        max_len = prompt.numel() + max_new_tokens + max(self.B, tree_size + 1) + 1
        self.cache = adapter.new_cache(max_len)
        self.draft_cache = DraftKVCache(draft.config, max_len, dtype=draft.fc.weight.dtype, device=device)
        self.out = _Output(prompt, max_new_tokens, stop_ids)
        self.result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method=method)
        self.lm_head = adapter.lm_head.weight
        self.draft_rows = torch.arange(1, self.B, device=device)  # block positions with a proposal
        self.clock = _Clock(device, stage_timing)
        self.context = None  # captured features waiting to enter the drafter cache

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.adapter.close()

    def prefill(self) -> None:
        """Target pass over the prompt; commits the first token; the prompt features wait for the drafter."""
        self.start_time = self.clock.t
        first = _prefill(self.adapter, self.prompt, self.cache, self.temperature, self.generator)
        self.context = self.adapter.context_features()
        self.out.extend(first.tolist())
        self.result.time_to_first_token = self.clock.lap()

    def draft(self) -> torch.Tensor:
        """Drafter pass over the waiting context and the block at ``n-1 .. n-2+B``: ``[B, H]``."""
        start = self.out.committed - 1
        positions = torch.arange(self.draft_cache.length, start + self.B, device=self.device)
        return draft_block(self.draft_model, self.adapter, self.out.last, self.context, positions, self.draft_cache,
                           self.mask_token_id)

    def finish(self) -> GenerationResult:
        self.result.total_time = time.perf_counter() - self.start_time
        self.result.output_ids = torch.tensor([self.out.tokens], device=self.device)
        return self.result

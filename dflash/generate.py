"""Decoding loops: plain autoregressive baseline and the DFlash chain (SPEC section 4).

One DFlash round, with ``n`` committed tokens (the last one, at position
``n-1``, not yet in the target's cache):

1. draft:  the drafter reads the new context rows and the block
   ``[x[n-1], MASK x (B-1)]`` at positions ``n-1 .. n+B-2``; the target's
   lm_head + argmax at block positions 1..B-1 gives proposals ``d_1..d_{B-1}``;
2. verify: the target runs on ``[x[n-1], d_1 .. d_{B-1}]``; its choice after
   block position j is ``posterior[j]`` (argmax, or a sample at T > 0);
3. commit: ``a`` = length of the prefix with ``d_{j+1} == posterior[j]``;
   commit ``posterior[0..a]`` (the accepted drafts plus the bonus token),
   keep ``a + 1`` rows of the target cache, and the captured features of
   those rows become the next round's context.

The round needs one host sync (the accepted tokens, to check stop tokens
and lengths).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

import dflash_kernels

from .target import TargetAdapter

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class GenerationResult:
    """Output ids and statistics of one generation.

    ``output_ids [1, prompt + new]``; ``acceptance_lengths``: tokens committed
    per round (bonus included; all 1 for ``ar``); times in seconds.
    """

    output_ids: torch.Tensor
    num_prompt_tokens: int
    method: str
    acceptance_lengths: List[int] = field(default_factory=list)
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    tree_sizes: List[int] = field(default_factory=list)
    accepted_depths: List[int] = field(default_factory=list)
    trees: List[dict] = field(default_factory=list)

    @property
    def generated_ids(self) -> torch.Tensor:
        """The new tokens only, ``[1, new]``."""
        return self.output_ids[:, self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:
        return self.output_ids.shape[1] - self.num_prompt_tokens

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def decode_time(self) -> float:
        return self.total_time - self.time_to_first_token

    @property
    def time_per_output_token(self) -> float:
        """Decode time after the first token, per further token."""
        return self.decode_time / max(1, self.num_new_tokens - 1)

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.total_time if self.total_time > 0 else float("nan")

    def summary(self) -> dict:
        return dict(
            method=self.method,
            new_tokens=self.num_new_tokens,
            rounds=self.num_rounds,
            tau=self.tau,
            tokens_per_second=self.tokens_per_second,
            time_to_first_token=self.time_to_first_token,
            time_per_output_token=self.time_per_output_token,
            total_time=self.total_time,
            draft_time=self.draft_time,
            verify_time=self.verify_time,
            commit_time=self.commit_time,
        )


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


@torch.inference_mode()
def ar_generate(target, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None, seed=None,
                stage_timing=True) -> GenerationResult:
    """Plain autoregressive decoding with the same cache and ops (the speedup baseline)."""
    stop_ids = _check_common(max_new_tokens, temperature, stop_token_ids)
    adapter = TargetAdapter(target)
    try:
        prompt = _prepare_prompt(input_ids, adapter.vocab_size, adapter.device)
        gen = _generator(seed, adapter.device)
        cache = adapter.new_cache(prompt.numel() + max_new_tokens + 1)
        out = _Output(prompt, max_new_tokens, stop_ids)
        result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method="ar")
        clock = _Clock(adapter.device, stage_timing)
        start = clock.t
        token = _prefill(adapter, prompt, cache, temperature, gen)
        out.extend(token.tolist())
        result.time_to_first_token = clock.lap()
        while not out.done:
            pos = torch.tensor([out.committed - 1], device=adapter.device)
            hidden = adapter.forward(token, pos, cache)
            cache.commit(1)
            token = adapter.choose(hidden, temperature, generator=gen)
            out.extend(token.tolist())
            result.acceptance_lengths.append(1)
        result.verify_time = clock.lap()
        result.total_time = time.perf_counter() - start
        result.output_ids = torch.tensor([out.tokens], device=adapter.device)
        return result
    finally:
        adapter.close()


def _check_pair(adapter: TargetAdapter, draft) -> None:
    """The drafter fits the target: layer count, hidden size, vocab, fc width."""
    from .config import DraftConfigError, validate_target_layer_ids

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
        from .cache import DraftKVCache

        stop_ids = _check_common(max_new_tokens, temperature, stop_token_ids)
        self.B = int(block_size if block_size is not None else draft.block_size)
        if self.B < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {self.B}")
        self.adapter = adapter = TargetAdapter(target, draft.target_layer_ids)
        try:
            _check_pair(adapter, draft)
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


@torch.inference_mode()
def dflash_generate(target, draft, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None,
                    block_size=None, seed=None, stage_timing=True) -> GenerationResult:
    """DFlash speculative decoding (one chain of ``block_size - 1`` drafts per round)."""
    with Speculation(target, draft, input_ids, method="dflash", max_new_tokens=max_new_tokens,
                     temperature=temperature, stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                     stage_timing=stage_timing) as s:
        B, result, clock = s.B, s.result, s.clock
        block_offsets = torch.arange(B, device=s.device)
        s.prefill()
        while not s.out.done:
            n = s.out.committed
            # draft: B-1 proposals for positions n .. n+B-2
            proposals = dflash_kernels.lm_head_argmax(s.draft(), s.lm_head, positions=s.draft_rows)
            result.draft_time += clock.lap()

            # verify: the block at positions n-1 .. n-1+B-1
            block = torch.cat([torch.tensor([s.out.last], device=s.device), proposals])
            hidden = s.adapter.forward(block, (n - 1) + block_offsets, s.cache)
            choices = s.adapter.choose(hidden, temperature, generator=s.generator)
            result.verify_time += clock.lap()

            # commit: longest matching prefix plus the bonus token (one host sync)
            matches = torch.cumprod((proposals == choices[:-1]).long(), 0)
            host = torch.cat([choices, matches]).tolist()
            accepted = int(sum(host[B:]))
            s.cache.commit(accepted + 1)
            s.context = s.adapter.context_features(rows=block_offsets[: accepted + 1], trusted_rows=True)
            s.out.extend(host[: accepted + 1])
            result.acceptance_lengths.append(accepted + 1)
            result.commit_time += clock.lap()
        return s.finish()


def generate(target, draft=None, input_ids=None, *, method: str = "dflash", max_new_tokens: int,
             temperature: float = 0.0, stop_token_ids=None, block_size=None, seed=None, tree_budget=None,
             **kwargs) -> GenerationResult:
    """Generate with ``method`` in ``"ar"``, ``"dflash"``, ``"ddtree"``.

    ``target``: a HF causal LM (Qwen3, Llama, ...); ``draft``: a
    :class:`dflash.DFlashDraftModel` (unused by ``ar``); ``input_ids``:
    ``[T]`` or ``[1, T]`` (batch 1). Temperature 0 is greedy and the output is
    exactly the target's own greedy decoding; at T > 0 the target samples
    (reproducible with ``seed``). Generation stops after ``max_new_tokens``
    new tokens or right after a token of ``stop_token_ids``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if method == "ar":
        return ar_generate(target, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                           stop_token_ids=stop_token_ids, seed=seed, **kwargs)
    if draft is None:
        raise ValueError(f"method {method!r} needs a drafter (draft=DFlashDraftModel)")
    if method == "dflash":
        return dflash_generate(target, draft, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                               stop_token_ids=stop_token_ids, block_size=block_size, seed=seed, **kwargs)
    from .ddtree import ddtree_generate_result

    return ddtree_generate_result(target, draft, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                  stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                                  tree_budget=tree_budget, **kwargs)

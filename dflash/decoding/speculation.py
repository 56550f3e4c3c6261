"""State and helpers every decoding loop shares: prompt and argument checks, the committed
output, the stage clock, the prefill, the drafter pass, and :class:`Speculation` (the per-call
state of the DFlash and DDTree loops)."""

from __future__ import annotations

import random
import time
from typing import Callable, List, Optional, Sequence

import torch

import dflash_kernels

from ..drafter.cache import DraftKVCache
from ..drafter.config import DraftConfigError, validate_target_layer_ids
from ..target import TargetAdapter
from .generation_config import SamplingSettings
from .result import GenerationResult


class StageClock:
    """Per-stage times of a generation without a host sync per stage.

    ``mark(stage)`` closes the interval since the previous mark and charges it
    to ``stage``. On CUDA each mark records an event on the current stream
    (nothing waits); :meth:`totals` synchronizes once, at the end, and sums
    the event intervals. On the CPU the marks read the wall clock. With
    ``enabled=False`` marks do nothing and every stage total is 0.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self._wall = time.perf_counter()
        self._sums: dict = {}
        self._intervals: List[tuple] = []  # (stage, start event, end event) on CUDA
        self._last_event = self._event() if self.cuda else None

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, stage: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            event = self._event()
            self._intervals.append((stage, self._last_event, event))
            self._last_event = event
        else:
            now = time.perf_counter()
            self._sums[stage] = self._sums.get(stage, 0.0) + now - self._wall
            self._wall = now

    def restart(self) -> None:
        """Start the next interval now (what happened since the last mark is charged to no stage)."""
        if self.cuda:
            self._last_event = self._event()
        else:
            self._wall = time.perf_counter()

    def totals(self) -> dict:
        """Seconds per stage (one synchronize on CUDA)."""
        sums = dict(self._sums)
        if self._intervals:
            torch.cuda.synchronize()
            for stage, start, end in self._intervals:
                sums[stage] = sums.get(stage, 0.0) + start.elapsed_time(end) / 1000.0
        return sums


class HostReader:
    """The round's one device -> host read: int64 values through a pinned buffer.

    On CUDA the copy is non-blocking into page-locked memory, then the stream
    is waited on once; on the CPU the values are read directly.
    """

    def __init__(self, device: torch.device, size: int):
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(size, dtype=torch.long, pin_memory=True) if self.cuda else None

    def read(self, values: torch.Tensor) -> List[int]:
        if not self.cuda:
            return values.tolist()
        staged = self.buffer[: values.numel()]
        staged.copy_(values, non_blocking=True)
        torch.cuda.current_stream(values.device).synchronize()
        return staged.tolist()


class SeedSource:
    """Per-call sampling seeds from a host RNG (no device generator, no read-back).

    ``seed=None`` draws from OS entropy, so unseeded runs differ.
    """

    def __init__(self, seed: Optional[int]):
        self.rng = random.Random(seed)

    def next(self) -> int:
        return self.rng.getrandbits(62)


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
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    return set(int(t) for t in (stop_token_ids or ()))


def as_sampling(sampling: Optional[SamplingSettings], temperature: float) -> SamplingSettings:
    """The loops' sampling settings: ``sampling`` if given, else temperature-only sampling (0 = greedy)."""
    if sampling is not None:
        if not isinstance(sampling, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings, got {type(sampling).__name__}")
        return sampling
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    return SamplingSettings(float(temperature))


# ---------------------------------------------------------------- the target's token choice (sampling engineer)
# Every loop picks the target's tokens through choose_tokens(); unsupported_sampling() says, before a generation
# starts, which setting choose_tokens cannot apply (the drop-in then falls back to transformers). The top-k / top-p /
# min-p sampler replaces the bodies of both functions.

def unsupported_sampling(sampling: SamplingSettings) -> Optional[str]:
    """The name of the first sampling setting :func:`choose_tokens` cannot apply, or None (today: none)."""
    return None


def choose_tokens(adapter: TargetAdapter, hidden: torch.Tensor, sampling: SamplingSettings,
                  seed: Optional[int]) -> torch.Tensor:
    """The target's token after each row of pre-norm ``hidden [T, H]`` under ``sampling``.

    Greedy: the argmax of the logits in the lm_head's dtype (lowest id on
    ties). Sampling: a sample from the processed distribution (temperature,
    then top-k, top-p, min-p, exactly as transformers' warpers), reproducible
    with ``seed``: :func:`dflash_kernels.lm_head_sample_processed` when a
    filter is on, the plain fused sampler otherwise. Both get the family's
    final norm and final-logit softcap from ``adapter.head_inputs``.
    """
    if sampling.greedy or not sampling.active():
        return adapter.choose(hidden, sampling.temperature, seed=seed)
    rows, kw = adapter.head_inputs(hidden)
    return dflash_kernels.lm_head_sample_processed(rows, adapter.lm_head.weight, sampling.temperature,
                                                   top_k=sampling.top_k, top_p=sampling.top_p,
                                                   min_p=sampling.min_p, seed=seed, check_bounds=False, **kw)


class _Output:
    """Committed tokens with the stop rules applied, and the streamer fed as they commit.

    Stops right after ``max_new_tokens`` new tokens, a token of ``stop_ids``,
    or a token after which ``stopping_criteria(input_ids [1, n], None)`` is
    true (asked after every committed token, on a CPU copy of the sequence,
    as transformers asks after every token). ``streamer``: ``put(prompt
    [1, T])`` at construction (as transformers' generate puts its input ids
    first), then ``put(tokens [k])`` with each :meth:`extend`'s committed
    tokens, and ``end()`` once from :meth:`close`. Built only from the host
    values the round already read: no device read of its own.
    """

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, stop_ids: set, *,
                 stopping_criteria: Optional[Callable] = None, streamer=None):
        self.tokens: List[int] = prompt.tolist()
        self.num_prompt = len(self.tokens)
        self.max_new = max_new_tokens
        self.stop_ids = stop_ids
        self.done = False
        self.criteria = stopping_criteria
        self.streamer = streamer
        self._ended = False
        self.host = None  # CPU copy of the sequence, for the streamer and the stopping criteria
        if streamer is not None or stopping_criteria is not None:
            self.host = torch.empty(self.num_prompt + max_new_tokens, dtype=torch.long)
            self.host[: self.num_prompt].copy_(prompt)
        if streamer is not None:
            streamer.put(self.host[None, : self.num_prompt].clone())

    def _criteria_say_stop(self) -> bool:
        verdict = self.criteria(self.host[None, : len(self.tokens)], None)
        if isinstance(verdict, torch.Tensor):
            return bool(verdict.any())
        return bool(verdict)

    def extend(self, new: Sequence[int]) -> None:
        start = len(self.tokens)
        for t in new:
            t = int(t)
            self.tokens.append(t)
            if self.host is not None:
                self.host[len(self.tokens) - 1] = t
            if (t in self.stop_ids or len(self.tokens) - self.num_prompt >= self.max_new
                    or (self.criteria is not None and self._criteria_say_stop())):
                self.done = True
                break
        if self.streamer is not None and len(self.tokens) > start:
            self.streamer.put(self.host[start : len(self.tokens)].clone())

    def close(self) -> None:
        """Tell the streamer the generation ended (once)."""
        if self.streamer is not None and not self._ended:
            self._ended = True
            self.streamer.end()

    @property
    def last(self) -> int:
        return self.tokens[-1]

    @property
    def committed(self) -> int:
        return len(self.tokens)


def prefill(adapter: TargetAdapter, prompt, cache, sampling: SamplingSettings, seeds: SeedSource):
    """Target pass over the prompt (chunked); returns ``(first token [1] on the device, context features)``."""
    last_hidden, features = adapter.prefill(prompt, cache)
    first = choose_tokens(adapter, last_hidden, sampling, seeds.next())
    return first, features


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


def block_size_of(draft, block_size) -> int:
    """The block size of a generation: ``block_size`` or the drafter's own; at least 2 (anchor + one draft)."""
    B = int(block_size if block_size is not None else draft.block_size)
    if B < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {B}")
    return B


def mask_token_id_of(draft, mask_token_id, vocab_size: int) -> int:
    """The block's mask id: ``mask_token_id`` or the drafter's own, inside the target vocabulary."""
    mask_id = draft.mask_token_id if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_token_id {mask_id} is outside the vocabulary [0, {vocab_size})")
    return mask_id


def draft_block(draft, adapter: TargetAdapter, last_token: torch.Tensor, mask_block: torch.Tensor, context,
                positions, cache) -> torch.Tensor:
    """One drafter pass: final-normed states ``[B, H]`` of ``[last_token, MASK x (B-1)]``.

    ``last_token [1]`` and ``mask_block [B-1]`` (the mask id repeated) stay on the device.
    """
    ids = torch.cat([last_token, mask_block])
    return draft(adapter.embed(ids), context, positions, cache=cache)


class Speculation:
    """State of one speculative generation, shared by the DFlash and DDTree loops.

    Owns the target adapter (capture hooks), both caches, the committed
    output and the result; ``prefill()`` then rounds of ``draft()`` and the
    loop's own verify/commit, then ``finish()``. Use as a context manager
    (removes the hooks).
    """

    def __init__(self, target, draft, input_ids, *, method, max_new_tokens, temperature=0.0, stop_token_ids=None,
                 block_size=None, seed=None, tree_size: int = 0, mask_token_id=None, stage_timing=True,
                 sampling: Optional[SamplingSettings] = None, stopping_criteria=None, streamer=None):
        self.sampling = sampling = as_sampling(sampling, temperature)
        stop_ids = _check_common(max_new_tokens, sampling.temperature, stop_token_ids)
        self.B = block_size_of(draft, block_size)
        self.adapter = adapter = TargetAdapter(target, draft.target_layer_ids)
        try:
            check_pair(adapter, draft)
            self.mask_token_id = mask_token_id_of(draft, mask_token_id, adapter.vocab_size)
            self.device = device = adapter.device
            prompt = _prepare_prompt(input_ids, adapter.vocab_size, device)
        except BaseException:
            adapter.close()
            raise
        self.draft_model, self.temperature, self.prompt = draft, sampling.temperature, prompt
        self.seeds = SeedSource(seed)
        # verify writes B (chain) or tree_size + 1 (tree) rows past the committed length
        max_len = prompt.numel() + max_new_tokens + max(self.B, tree_size + 1) + 1
        self.cache = adapter.new_cache(max_len)
        self.draft_cache = DraftKVCache(draft.config, max_len, dtype=draft.fc.weight.dtype, device=device)
        self.out = None
        try:
            self.out = _Output(prompt, max_new_tokens, stop_ids, stopping_criteria=stopping_criteria,
                               streamer=streamer)
        except BaseException:
            adapter.close()
            raise
        self.result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method=method)
        self.lm_head = adapter.lm_head.weight
        self.draft_rows = torch.arange(1, self.B, device=device)  # block positions with a proposal
        self.mask_block = torch.full((self.B - 1,), self.mask_token_id, dtype=torch.long, device=device)
        self.clock = StageClock(device, stage_timing)
        self.reader = HostReader(device, max(self.B, tree_size + 1) + 2)
        self.context = None  # captured features waiting to enter the drafter cache
        self.last_token = None  # [1] on the device: the last committed token (the next block's anchor)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.out.close()
        finally:
            self.adapter.close()

    def choose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's tokens after the rows of ``hidden`` (:func:`choose_tokens`, the next seed)."""
        return choose_tokens(self.adapter, hidden, self.sampling, self.seeds.next())

    def prefill(self) -> None:
        """Target pass over the prompt; commits the first token; the prompt features wait for the drafter."""
        self.start_time = time.perf_counter()
        self.last_token, self.context = prefill(self.adapter, self.prompt, self.cache, self.sampling, self.seeds)
        self.out.extend(self.reader.read(self.last_token))
        self.result.time_to_first_token = time.perf_counter() - self.start_time
        self.clock.restart()

    def draft(self) -> torch.Tensor:
        """Drafter pass over the waiting context and the block at ``n-1 .. n-2+B``: ``[B, H]``."""
        start = self.out.committed - 1
        positions = torch.arange(self.draft_cache.length, start + self.B, device=self.device)
        return draft_block(self.draft_model, self.adapter, self.last_token, self.mask_block, self.context, positions,
                           self.draft_cache)

    def commit(self, tokens: Sequence[int]) -> None:
        """Append a round's committed tokens (host ints) and record its acceptance length."""
        before = self.out.committed
        self.out.extend(tokens)
        self.result.acceptance_lengths.append(self.out.committed - before)

    def finish(self) -> GenerationResult:
        self.result.total_time = time.perf_counter() - self.start_time
        stages = self.clock.totals()
        self.result.draft_time = stages.get("draft", 0.0)
        self.result.verify_time = stages.get("verify", 0.0)
        self.result.commit_time = stages.get("commit", 0.0)
        self.result.output_ids = torch.tensor([self.out.tokens], device=self.device)
        return self.result

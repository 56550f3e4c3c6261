"""The host side of a generation: the committed output with its stop rules and streamer, the round's one
device -> host read, the per-generation seed, and the stage clock."""

from __future__ import annotations

import random
import time
from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["CommittedOutput", "HostReader", "SeedSource", "StageClock"]


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


class CommittedOutput:
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
            self._host_values = self.host.numpy()  # the same memory: a token written there is one host store
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
                self._host_values[len(self.tokens) - 1] = t
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

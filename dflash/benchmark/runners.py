"""One timed generation of one configuration: ours through :func:`dflash.generate`, the peers through
transformers' ``target.generate``, each with its peak memory.

A :class:`Run` holds what one generation emitted and when: the new token ids,
the wall time of the whole call, the time and token count of the first emission,
the committed tokens per round, and for our methods the draft / verify / commit
seconds. For the peers the emissions are read from transformers' streamer, which
sees one ``put`` per target forward (:class:`EmissionClock`).

Peak memory (:class:`PeakMemory`): on CUDA ``torch.cuda.max_memory_allocated``
during the run (absolute, weights included); on the CPU the growth of the
process's peak resident set during the run (``VmHWM`` of ``/proc/self/status``
after resetting it through ``/proc/self/clear_refs``: :mod:`dflash.benchmark.memory`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .configs import OUR_METHODS, PROMPT_LOOKUP_TOKENS, BenchConfig
from .memory import proc_status_kib, reset_peak_rss
from .pair import Pair


class PeakMemory:
    """Peak memory of one run (the module docstring says what is measured on each device)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._rss_base: Optional[int] = None

    @property
    def what(self) -> str:
        return "peak GPU memory allocated" if self.cuda else "peak RSS growth"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif reset_peak_rss():
            self._rss_base = proc_status_kib("VmRSS")

    def peak_mib(self) -> Optional[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self._rss_base is None:
            return None
        hwm = proc_status_kib("VmHWM")
        return None if hwm is None else max(0, hwm - self._rss_base) / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Run:
    """One generation: what was emitted, when, and in which rounds."""

    label: str
    prompt_index: int
    generated: List[int]
    total_time: float
    first_emit_time: float
    first_emit_tokens: int
    acceptance_lengths: List[int]
    draft_time: Optional[float] = None
    verify_time: Optional[float] = None
    commit_time: Optional[float] = None
    peak_memory_mib: Optional[float] = None
    #: drafts accepted per round, and the draft positions a round had (B - 1; None: a method without drafts)
    accepted_drafts: List[int] = field(default_factory=list)
    draft_positions: Optional[int] = None

    @property
    def new_tokens(self) -> int:
        return len(self.generated)


@dataclass
class RunSettings:
    max_new_tokens: int
    stop_token_ids: List[int]
    pad_token_id: int
    seed: int
    #: our methods run as compiled rounds (generate(compile=True)); set-up time is never in a timed run
    compile: bool = False


def run_ours(cfg: BenchConfig, pair: Pair, prompt: torch.Tensor, settings: RunSettings, seed: int,
             max_new_tokens: Optional[int] = None) -> Run:
    """``ar`` / ``dflash`` / ``ddtree`` through :func:`dflash.generate`."""
    from ..decoding import generate

    kw = dict(method=cfg.method, max_new_tokens=max_new_tokens or settings.max_new_tokens,
              temperature=cfg.temperature, stop_token_ids=settings.stop_token_ids or None, seed=seed)
    if cfg.method != "ar":
        kw["block_size"] = cfg.block_size
    if cfg.method == "ddtree":
        kw["tree_budget"] = cfg.budget
    if settings.compile:
        kw["compile"] = True
    result = generate(pair.target, pair.draft if cfg.method != "ar" else None, prompt, **kw)
    stages = (result.draft_time, result.verify_time, result.commit_time)
    run = Run(cfg.label, -1, result.generated_ids[0].tolist(), result.total_time, result.time_to_first_token, 1,
              list(result.acceptance_lengths), *stages)
    if cfg.method != "ar":
        run.accepted_drafts, run.draft_positions = result.accepted_drafts, result.block_size - 1
    return run


class EmissionClock:
    """A transformers streamer that timestamps every ``put`` after the prompt.

    transformers calls ``put`` once with the prompt, then once per target
    forward with the tokens that forward committed (one for plain decoding,
    the accepted drafts plus the bonus token for prompt lookup).
    """

    def __init__(self):
        self.prompt_seen = False
        self.times: List[float] = []
        self.counts: List[int] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


def hf_generation_config(cfg: BenchConfig, settings: RunSettings, max_new_tokens: int):
    """A complete GenerationConfig: nothing left for a checkpoint's defaults (top_k, top_p, eos) to fill."""
    from transformers import GenerationConfig

    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=list(settings.stop_token_ids) or None,
              pad_token_id=settings.pad_token_id, do_sample=cfg.temperature > 0, num_beams=1)
    if cfg.temperature > 0:
        kw.update(temperature=cfg.temperature, top_k=0, top_p=1.0)
    if cfg.method == "prompt-lookup":
        kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    return GenerationConfig(**kw)


def run_peer(cfg: BenchConfig, pair: Pair, prompt: torch.Tensor, settings: RunSettings, seed: int,
             max_new_tokens: Optional[int] = None) -> Run:
    """``hf`` / ``hf-sample`` / ``prompt-lookup`` through ``target.generate``."""
    from transformers import GenerationConfig

    target, device = pair.target, pair.device
    gen_config = hf_generation_config(cfg, settings, max_new_tokens or settings.max_new_tokens)
    ids = prompt.to(device)[None]
    clock = EmissionClock()
    saved = target.generation_config
    target.generation_config = GenerationConfig()  # the checkpoint's sampling defaults must not leak in
    try:
        torch.manual_seed(seed)
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                                  streamer=clock)
        _sync(device)
        total = time.perf_counter() - start
    finally:
        target.generation_config = saved
    generated = out[0, ids.shape[1]:].tolist()
    if sum(clock.counts) != len(generated):
        raise RuntimeError(f"{cfg.label}: the streamer saw {sum(clock.counts)} tokens but generate returned "
                           f"{len(generated)}; this transformers version streams differently")
    run = Run(cfg.label, -1, generated, total, clock.times[0] - start, clock.counts[0], clock.counts[1:])
    if cfg.method == "prompt-lookup":  # each forward after the first: its accepted drafts, then the bonus token
        run.accepted_drafts, run.draft_positions = [c - 1 for c in clock.counts[1:]], PROMPT_LOOKUP_TOKENS
    return run


def run_config(cfg: BenchConfig, pair: Pair, prompt: torch.Tensor, settings: RunSettings, seed: int,
               memory: PeakMemory, max_new_tokens: Optional[int] = None) -> Run:
    runner = run_ours if cfg.method in OUR_METHODS else run_peer
    memory.start()
    run = runner(cfg, pair, prompt, settings, seed, max_new_tokens)
    run.peak_memory_mib = memory.peak_mib()
    return run

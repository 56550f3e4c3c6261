"""End-to-end benchmark: ``python -m dflash bench``.

Every configuration (method x tree budget x block size x temperature) runs
on the same prompts. Per prompt, all configurations run one after another
(interleaved, the order rotated by one each prompt) after one warm-up
generation per configuration, so the plain autoregressive baseline ``ar`` is
measured under the same conditions as the methods it is compared with.

Methods
  ``ar``            plain decoding on our static cache and fused ops (the speedup baseline;
                    always run, at every temperature)
  ``dflash``        one drafted chain of B-1 tokens per round
  ``ddtree``        a best-first tree of ``budget`` drafted tokens per round
  ``hf``            transformers' ``target.generate(do_sample=False)`` (temperature 0 only)
  ``hf-sample``     transformers' ``target.generate(do_sample=True)`` (temperatures > 0 only)
  ``prompt-lookup`` transformers' prompt-lookup drafting,
                    ``target.generate(prompt_lookup_num_tokens=10)``. At T > 0 transformers
                    (5.17-5.24) samples the target at every drafted position and keeps
                    drafts while they equal the samples (no draft probabilities exist):
                    exact sampling, with acceptance against samples rather than argmax.

Statistics per configuration, pooled over prompts
  tau           committed tokens per round after the prefill (bonus included);
                1 for ``ar``, ``hf``, ``hf-sample`` by construction; for
                ``prompt-lookup`` the tokens of each target forward after the
                first, read from transformers' streamer (one ``put`` per forward)
  tokens/s      new tokens / wall time of the whole generation (prefill included)
  ms/token      decode time after the first emitted tokens / tokens emitted after them
  speedup       tokens/s over ``ar``'s tokens/s at the same temperature
  stage shares  draft / verify / commit time as a share of decode time (ours only)
  position acceptance
                per draft position k = 1 .. B - 1, the fraction of all rounds of all
                prompts whose accepted drafts reached k (``dflash`` / ``ddtree``: the
                drafts the verify accepted, a final round cut short by
                ``max_new_tokens`` included; ``prompt-lookup``: k = 1 .. 10, the tokens
                of each forward after the first, minus the bonus); empty without drafts
  peak memory   CUDA: ``torch.cuda.max_memory_allocated`` during the run (absolute, weights
                included); CPU: growth of the process's peak resident set during the run
                (``VmHWM`` of ``/proc/self/status`` after resetting it through
                ``/proc/self/clear_refs``; memory reused from earlier runs does not show)

At temperature 0 every method's output must equal ``ar``'s token for token;
a difference is reported as a FAILURE row and the command exits with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

OUR_METHODS = ("ar", "dflash", "ddtree")
PEER_METHODS = ("hf", "hf-sample", "prompt-lookup")
ALL_METHODS = OUR_METHODS + PEER_METHODS
PROMPT_LOOKUP_TOKENS = 10
NOT_APPLICABLE = "–"


# ----------------------------------------------------------------- configs
@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration; ``budget`` is DDTree's node budget, ``block_size`` the drafter's block."""

    method: str
    temperature: float
    budget: Optional[int] = None
    block_size: Optional[int] = None

    @property
    def label(self) -> str:
        parts = [self.method]
        if self.budget is not None:
            parts.append(f"budget {self.budget}")
        if self.block_size is not None:
            parts.append(f"block {self.block_size}")
        parts.append(f"T={self.temperature:g}")
        return ", ".join(parts)


def expand_configs(methods: Sequence[str], budgets: Sequence[int], temperatures: Sequence[float],
                   block_sizes: Sequence[int]) -> List[BenchConfig]:
    """All configurations in table order; ``ar`` is added at every temperature (the baseline).

    ``hf`` runs only at T = 0 and ``hf-sample`` only at T > 0 (greedy and
    sampled decoding of transformers' own ``generate``).
    """
    configs: List[BenchConfig] = []
    for t in temperatures:
        configs.append(BenchConfig("ar", t))
        if "dflash" in methods:
            configs += [BenchConfig("dflash", t, block_size=b) for b in block_sizes]
        if "ddtree" in methods:
            configs += [BenchConfig("ddtree", t, budget=n, block_size=b) for b in block_sizes for n in budgets]
        if "hf" in methods and t == 0:
            configs.append(BenchConfig("hf", t))
        if "hf-sample" in methods and t > 0:
            configs.append(BenchConfig("hf-sample", t))
        if "prompt-lookup" in methods:
            configs.append(BenchConfig("prompt-lookup", t))
    return configs


# ------------------------------------------------------------------ memory
from .memory import proc_status_kib, reset_peak_rss  # noqa: E402


class PeakMemory:
    """Peak memory of one run (see the module docstring for what is measured on each device)."""

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


# -------------------------------------------------------------------- runs
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
class Pair:
    target: torch.nn.Module
    draft: Optional[torch.nn.Module]
    tokenizer: object
    device: torch.device


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


# ----------------------------------------------------------------- results
@dataclass
class Failure:
    """A greedy output that differs from ``ar``'s."""

    label: str
    prompt_index: int
    position: int
    expected: Optional[int]
    got: Optional[int]
    logit_margin: Optional[float] = None  # the target's fp32 logit[expected] - logit[got] there
    top2_gap: Optional[float] = None

    def describe(self) -> str:
        exp = "end of output" if self.expected is None else f"token {self.expected}"
        got = "end of output" if self.got is None else f"token {self.got}"
        margin = ""
        if self.logit_margin is not None:
            margin = (f"; the target's fp32 logit margin there is {self.logit_margin:.4g} (top-2 gap "
                      f"{self.top2_gap:.4g}: a margin near 0 is a numerical near-tie, a large one a bug)")
        return (f"{self.label} differs from ar on prompt {self.prompt_index} at new token {self.position}: "
                f"ar gives {exp}, {self.label.split(',')[0]} gives {got}{margin}")


def compare_greedy(reference: Run, run: Run) -> Optional[Failure]:
    """The first position where ``run`` differs from the ``ar`` reference, or None."""
    a, b = reference.generated, run.generated
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return Failure(run.label, run.prompt_index, i, x, y)
    return None


def add_margin(failure: Failure, target, prompt: torch.Tensor, reference: Sequence[int]) -> None:
    """Fill ``failure``'s fp32 logit margin at the divergent token (numerics or a bug?)."""
    from ..decoding.parity import first_divergence

    if failure.expected is None or failure.got is None:
        return
    ref = prompt.flatten().tolist() + list(reference)
    other = ref[: prompt.numel() + failure.position] + [failure.got]
    div = first_divergence(target, ref, other)
    if div is not None and div.logit_margin is not None:
        failure.logit_margin, failure.top2_gap = div.logit_margin, div.top2_gap


def _ratio(num: float, den: float) -> Optional[float]:
    return num / den if den > 0 else None


def pooled_position_acceptance(runs: Sequence[Run]) -> List[float]:
    """Position acceptance over all rounds of all ``runs`` (one configuration: one block size); ``[]``
    for a method without drafts."""
    from ..decoding.result import position_acceptance

    sizes = {r.draft_positions for r in runs}
    if sizes == {None} or not sizes:
        return []
    if len(sizes) > 1:
        raise ValueError(f"runs of one configuration drafted {sorted(sizes, key=str)} positions; pooling needs one")
    return position_acceptance([n for r in runs for n in r.accepted_drafts], sizes.pop() + 1)


def summarize(cfg: BenchConfig, runs: Sequence[Run]) -> dict:
    """Pooled statistics of one configuration over its runs (speedup is filled in later)."""
    new = sum(r.new_tokens for r in runs)
    total = sum(r.total_time for r in runs)
    decode = sum(r.total_time - r.first_emit_time for r in runs)
    after_first = sum(r.new_tokens - r.first_emit_tokens for r in runs)
    lengths = [a for r in runs for a in r.acceptance_lengths]
    histogram: Dict[str, int] = {}
    for a in lengths:
        histogram[str(a)] = histogram.get(str(a), 0) + 1
    row = dict(
        label=cfg.label, method=cfg.method, budget=cfg.budget, block_size=cfg.block_size,
        temperature=cfg.temperature, prompts=len(runs), new_tokens=new, rounds=len(lengths),
        tau=_ratio(sum(lengths), len(lengths)),
        tokens_per_second=_ratio(new, total),
        time_per_output_token=_ratio(decode, after_first),
        time_to_first_token=_ratio(sum(r.first_emit_time for r in runs), len(runs)),
        total_time=total, speedup=None,
        draft_share=None, verify_share=None, commit_share=None,
        peak_memory_mib=max((r.peak_memory_mib for r in runs if r.peak_memory_mib is not None), default=None),
        acceptance_histogram=dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        failures=0,
        position_acceptance=pooled_position_acceptance(runs),
    )
    if cfg.method in OUR_METHODS and decode > 0:
        stages = ("verify",) if cfg.method == "ar" else ("draft", "verify", "commit")  # ar: one stage
        for stage in stages:
            row[f"{stage}_share"] = sum(getattr(r, f"{stage}_time") or 0.0 for r in runs) / decode
    return row


def add_speedups(rows: List[dict]) -> None:
    """``speedup`` = tokens/s over ``ar``'s tokens/s at the same temperature."""
    baseline = {r["temperature"]: r["tokens_per_second"] for r in rows if r["method"] == "ar"}
    for r in rows:
        base = baseline.get(r["temperature"])
        if base and r["tokens_per_second"]:
            r["speedup"] = r["tokens_per_second"] / base


# ------------------------------------------------------------------ tables
def _fmt(value, spec: str, suffix: str = "") -> str:
    if isinstance(value, str):  # a budget chosen per round: "auto"
        return value + suffix
    return NOT_APPLICABLE if value is None else format(value, spec) + suffix


def markdown_table(rows: Sequence[dict], failures: Sequence[Failure], memory_what: str) -> str:
    head = ["method", "budget", "block", "T", "tau", "tokens/s", "ms/token", "speedup vs ar",
            "draft %", "verify %", "commit %", f"{memory_what} (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["method"], _fmt(r["budget"], "d"), _fmt(r["block_size"], "d"), f"{r['temperature']:g}",
            _fmt(r["tau"], ".2f"), _fmt(r["tokens_per_second"], ".1f"),
            _fmt(None if r["time_per_output_token"] is None else r["time_per_output_token"] * 1e3, ".2f"),
            _fmt(r["speedup"], ".2f", "x"),
            *(_fmt(None if r[f"{s}_share"] is None else 100 * r[f"{s}_share"], ".1f") for s in
              ("draft", "verify", "commit")),
            _fmt(r["peak_memory_mib"], ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for f in failures:
        lines.append("| **FAILURE** | " + f.describe() + " |" + " |" * (len(head) - 2))
    return "\n".join(lines)


def position_acceptance_table(rows: Sequence[dict]) -> str:
    """One line per drafting row, one column per draft position k (``–`` past a row's block)."""
    drafting = [r for r in rows if r.get("position_acceptance")]
    if not drafting:
        return ""
    positions = max(len(r["position_acceptance"]) for r in drafting)
    head = ["method", "budget", "block", "T", *(f"k={k}" for k in range(1, positions + 1))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in drafting:
        shares = r["position_acceptance"]
        cells = [r["method"], _fmt(r["budget"], "d"), _fmt(r["block_size"], "d"), f"{r['temperature']:g}",
                 *(_fmt(shares[k] if k < len(shares) else None, ".3f") for k in range(positions))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


POSITION_ACCEPTANCE_NOTE = (
    "**Acceptance per draft position**: the share of rounds whose accepted drafts reached draft position k, over "
    "all rounds of all prompts (a final round cut short by the token limit counts the drafts its verify accepted; "
    "prompt-lookup: the tokens of each forward after the first, minus the bonus token, as transformers' streamer "
    "shows them). Methods without drafts have no line.")


NOTES = """\
- tau: committed tokens per round after the prefill (bonus included); 1 for ar / hf / hf-sample by construction;
  for prompt-lookup, tokens per target forward after the first (one streamer `put` per forward in transformers'
  assisted-decoding loop).
- tokens/s: new tokens over the wall time of the whole generation, prefill included. ms/token: decode time after the
  first emitted tokens, per token emitted after them.
- speedup vs ar: tokens/s over `ar`'s tokens/s at the same temperature, measured in this run on the same prompts
  (configurations interleaved per prompt, one warm-up generation each first).
- draft / verify / commit %: share of decode time per stage (our methods only; ar's decode loop counts as verify).
- peak memory: {memory_note}
- hf / hf-sample: transformers' `target.generate` (greedy / multinomial sampling at the temperature, top-k and top-p
  off). prompt-lookup: `generate(prompt_lookup_num_tokens={lookup})`; at T > 0 transformers samples the target at
  every drafted position and keeps drafts while they equal the samples (exact sampling; no draft probabilities).
- At T = 0 every method's output is compared with ar's token for token; a difference is a FAILURE row.
- Kernel backend: {backend}{backend_note}.
"""


def memory_note(cuda: bool) -> str:
    if cuda:
        return "`torch.cuda.max_memory_allocated` during the run (weights included), max over prompts."
    return ("growth of the process's peak resident set during the run (`VmHWM` in /proc/self/status after a reset "
            "through /proc/self/clear_refs), max over prompts; memory reused from earlier runs does not show.")


# ----------------------------------------------------------------- prompts
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


# --------------------------------------------------------------------- CLI
def _budget_list(text: str) -> list:
    """``--budgets``: comma-separated ints >= 1 and ``auto``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if "auto" in items:
        rest = ",".join(x for x in items if x != "auto")
        return (_int_list(rest) if rest else []) + ["auto"]
    return _int_list(text)


def _int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _float_list(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def _method_list(text: str) -> List[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in ALL_METHODS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or text!r}; allowed: {', '.join(ALL_METHODS)}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Methods: " + ", ".join(ALL_METHODS))
    p.add_argument("--target", help="local HF target directory (default: the embedded tiny pair)")
    p.add_argument("--draft", help="local DFlash drafter directory (default: the embedded tiny pair)")
    p.add_argument("--prompts", help='JSONL file: one {"prompt": "..."} or {"input_ids": [...]} per line '
                                     "(default: held-out standard-library code)")
    p.add_argument("--num-prompts", type=int, default=8, help="number of prompts (the first N of --prompts)")
    p.add_argument("--prompt-len", type=int, default=128, help="bytes per built-in prompt")
    p.add_argument("--methods", type=_method_list, default=list(ALL_METHODS),
                   help="comma-separated, default: all (ar always runs: it is the baseline)")
    p.add_argument("--budgets", type=_budget_list, default=[4, 16, 64],
                   help="DDTree node budgets (ints, and 'auto': chosen each round)")
    p.add_argument("--temperatures", type=_float_list, default=[0.0, 0.7])
    p.add_argument("--block-sizes", type=_int_list, default=None, help="drafter block sizes (default: the drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up generation per configuration")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text tokens")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: small models decode fastest single-threaded)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    p.add_argument("--out", default="runs/bench", help="directory for results.json, results.md and the plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--batch-sizes", type=_int_list, default=None,
                   help="measure padded batches instead (dflash/benchmark/batch.py): e.g. 1,4,16; ours batched, the "
                        "same method row by row, and transformers' generate at each size")
    p.add_argument("--compile", action="store_true",
                   help="run ar / dflash / ddtree as compiled rounds (generate(compile=True)); the compile happens "
                        "in the warm-up and is never timed")
    return p


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


def _progress(total: int, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run", desc="bench", disable=disable, file=sys.stderr, dynamic_ncols=True)


def _bench_prompts(args, pair, device):
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


def _greedy_failures(configs, runs, pair, prompt_tensors) -> List[Failure]:
    """Every greedy run whose tokens differ from ``ar``'s on the same prompt, with the logit margin there."""
    failures: List[Failure] = []
    reference = {c.temperature: runs[c] for c in configs if c.method == "ar"}
    for cfg in configs:
        if cfg.temperature != 0 or cfg.method == "ar":
            continue
        for ref_run, run in zip(reference[0.0], runs[cfg]):
            failure = compare_greedy(ref_run, run)
            if failure is not None:
                add_margin(failure, pair.target, prompt_tensors[run.prompt_index], ref_run.generated)
                failures.append(failure)
    return failures


def run_benchmark(args, argv: Sequence[str] = ()) -> dict:
    """Load, warm up, measure interleaved, check greedy outputs; returns the results dict."""
    import dflash_kernels

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.set_num_threads(args.threads)
    notes: List[str] = []
    if args.compile:
        notes.append("ar / dflash / ddtree ran as compiled rounds (generate(compile=True): torch.compile, CUDA graphs "
                     "on a GPU); their set-up happened in the warm-up and is in no timed run.")
    pair = load_pair_for(args, device, dtype, notes)
    prompt_tensors, prompts, source = _bench_prompts(args, pair, device)

    block_sizes = args.block_sizes or [int(pair.draft.block_size)]
    configs = expand_configs(args.methods, args.budgets, args.temperatures, block_sizes)
    for method, why in (("hf", "runs at temperature 0 only"), ("hf-sample", "runs at temperatures > 0 only")):
        if method in args.methods and not any(c.method == method for c in configs):
            notes.append(f"{method} was asked for but {why}: not run.")
    eos = stop_ids_for(pair, args.ignore_eos)
    pad = eos[0] if eos else 0
    settings = RunSettings(args.max_new_tokens, eos, pad, args.seed, compile=args.compile)
    memory = PeakMemory(device)

    bar = _progress(len(configs) * (len(prompts) + 1), disable=args.no_progress)
    for cfg in configs:  # warm-up: kernels compiled, caches allocated, allocator warm
        bar.set_postfix_str(f"warm-up {cfg.label}")
        run_config(cfg, pair, prompt_tensors[0], settings, args.seed, memory,
                   max_new_tokens=min(args.warmup_tokens, args.max_new_tokens))
        bar.update()
    runs: Dict[BenchConfig, List[Run]] = {c: [] for c in configs}
    for i, prompt in enumerate(prompt_tensors):
        shift = i % len(configs)
        for cfg in configs[shift:] + configs[:shift]:
            bar.set_postfix_str(f"prompt {i} {cfg.label}")
            run = run_config(cfg, pair, prompt, settings, args.seed + i, memory)
            run.prompt_index = i
            runs[cfg].append(run)
            bar.update()
    bar.close()

    failures = _greedy_failures(configs, runs, pair, prompt_tensors)
    rows = [summarize(c, runs[c]) for c in configs]
    add_speedups(rows)
    for f in failures:
        next(r for r in rows if r["label"] == f.label)["failures"] += 1

    backend = dflash_kernels.get_backend(device)
    meta = dict(
        command=" ".join(["python -m dflash bench", *argv]),
        device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        dtype=str(dtype).replace("torch.", ""), threads=args.threads, kernel_backend=backend,
        torch=torch.__version__, transformers=__import__("transformers").__version__,
        pair=describe_pair(pair), prompts=dict(source=source, count=len(prompts), lengths=[len(p) for p in prompts]),
        max_new_tokens=args.max_new_tokens, stop_token_ids=eos, seed=args.seed,
        methods=list(args.methods), budgets=list(args.budgets), temperatures=list(args.temperatures),
        block_sizes=block_sizes, memory=memory.what, memory_note=memory_note(device.type == "cuda"),
        prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS, compiled_rounds=bool(args.compile),
    )
    return dict(meta=meta, rows=rows, failures=[asdict(f) | {"message": f.describe()} for f in failures],
                runs=[asdict(r) | {"new_tokens": r.new_tokens} for c in configs for r in runs[c]], notes=notes,
                _failure_objects=failures)


def write_markdown(results: dict, path: Path, plots: Sequence[str]) -> str:
    meta = results["meta"]
    failures = results["_failure_objects"]
    backend_note = (" (CPU: the Triton interpreter is a correctness tool, not a speed path, so the ops run their "
                    "pure-torch references)" if meta["kernel_backend"] == "reference" else "")
    pair = meta["pair"]
    lines = [
        "# dflash end-to-end benchmark", "",
        f"`{meta['command']}`", "",
        f"- device: {meta['device']} ({meta['device_name']}), {meta['dtype']}, {meta['threads']} CPU threads; "
        f"torch {meta['torch']}, transformers {meta['transformers']}",
        f"- pair: {pair['target']} ({pair['target_layers']} layers, hidden {pair['hidden']}, vocab {pair['vocab']})"
        + (f", drafter {pair['draft_layers']} layers, block {pair['draft_block_size']}, target layers "
           f"{pair['target_layer_ids']}" if "draft_layers" in pair else ""),
        f"- prompts: {meta['prompts']['source']}; {meta['max_new_tokens']} new tokens max; stop ids "
        f"{meta['stop_token_ids'] or 'none'}",
        "",
        markdown_table(results["rows"], failures, "peak GPU mem" if meta["device"].startswith("cuda") else
                       "peak RSS growth"),
        "",
    ]
    if failures:
        lines += [f"**{len(failures)} FAILURE(S)**: greedy outputs differ from ar's:", ""]
        lines += [f"- FAILURE: {f.describe()}" for f in failures] + [""]
    else:
        lines += ["All greedy (T = 0) outputs equal ar's token for token.", ""]
    positions = position_acceptance_table(results["rows"])
    if positions:
        lines += [POSITION_ACCEPTANCE_NOTE, "", positions, ""]
    lines += ["Notes:", "", NOTES.format(memory_note=meta["memory_note"], lookup=PROMPT_LOOKUP_TOKENS,
                                         backend=meta["kernel_backend"], backend_note=backend_note)]
    if meta["dtype"] != "float32":
        lines.append(f"- {meta['dtype']}: verifying a block at once and decoding one token at a time round differently, "
                     "and transformers' peers use other kernels, so a near-tie can flip and show as a FAILURE; "
                     "`--dtype float32` gives the strict check.")
    lines += [f"- {n}" for n in results["notes"]]
    if plots:
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "prompt_len", "threads", "warmup_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_sizes:
        return _main_batch(args, argv)
    results = run_benchmark(args, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from .plots import save_plots
    except ImportError as e:  # matplotlib is in the "bench" extra
        results["notes"].append(f"no plots: {e} (pip install 'dflash-kernels[bench]')")
        plots = []
    else:
        plots = save_plots(results["rows"], out)
    failures = results.pop("_failure_objects")
    results["plots"] = [str(p) for p in plots]
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    results["_failure_objects"] = failures
    text = write_markdown(results, out / "results.md", plots)
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p}" for p in plots))
    if failures:
        print(f"FAILURE: {len(failures)} greedy output(s) differ from ar's (see above)", file=sys.stderr)
        return 1
    return 0


def _main_batch(args, argv: Sequence[str]) -> int:
    """``--batch-sizes``: the batch table (:mod:`dflash.benchmark.batch`), to stdout, results.json and results.md."""
    from .batch import batch_markdown, run_batch_benchmark

    if any(b < 1 for b in args.batch_sizes):
        raise SystemExit("--batch-sizes must be ints >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.set_num_threads(args.threads)
    notes: List[str] = []
    pair = load_pair_for(args, device, dtype, notes)
    _, prompts, source = _bench_prompts(args, pair, device)
    eos = stop_ids_for(pair, args.ignore_eos)
    settings = RunSettings(args.max_new_tokens, eos, eos[0] if eos else 0, args.seed)
    results = run_batch_benchmark(args, pair, prompts, settings)
    results["notes"] = notes + results["notes"]
    results["meta"] = dict(command=" ".join(["python -m dflash bench", *argv]), device=str(device),
                           dtype=str(dtype).replace("torch.", ""), threads=args.threads, prompts=source,
                           max_new_tokens=args.max_new_tokens, batch_sizes=list(args.batch_sizes),
                           torch=torch.__version__, pair=describe_pair(pair))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = (f"# dflash batch benchmark\n\n`{results['meta']['command']}`\n\n- device: {device}, "
            f"{results['meta']['dtype']}, {args.threads} CPU threads; prompts: {source}; up to {args.max_new_tokens} "
            f"new tokens\n\n" + batch_markdown(results))
    (out / "results.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")
    if any(r["equal_to_alone"] is False for r in results["rows"]):
        print("FAILURE: a greedy batched row differs from its prompt generated alone (see the table)", file=sys.stderr)
        return 1
    return 0

"""Pooled statistics of a configuration's runs, and the greedy check against ``ar``.

Per configuration, over all its prompts: tau = committed tokens per round after
the prefill (bonus included); tokens/s = new tokens / wall time of the whole
generations; ms/token = decode time after the first emitted tokens / tokens
emitted after them; speedup = tokens/s over ``ar``'s at the same temperature;
stage shares = draft / verify / commit seconds over decode seconds (ours only);
position acceptance = per draft position ``k``, the share of all rounds whose
accepted drafts reached ``k``. At temperature 0 each run's tokens are compared
with ``ar``'s on the same prompt; a difference is a :class:`Failure`, with the
target's fp32 logit margin at the divergent token (a near-tie or a bug).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .configs import OUR_METHODS, BenchConfig
from .runners import Run


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


def greedy_failures(configs, runs, pair, prompt_tensors) -> List[Failure]:
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

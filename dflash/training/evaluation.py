"""Acceptance of a drafter during and after training: tau on held-out prompts.

``tau = committed tokens / rounds`` pooled over the prompts (each round
commits the accepted drafts plus the target's bonus token, so an untrained
drafter scores 1). Under torchrun every rank measures its share of the
prompts (``prompts[rank::N]``) on a whole copy of the drafter and the counts
are summed, so the pooled tau is the one world 1 measures.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["measure_tau", "distributed_tau", "final_eval_table"]


def measure_tau(target, draft, prompts: Sequence[Sequence[int]], *, method: str = "dflash",
                temperature: float = 0.0, max_new_tokens: int = 128, tree_budget: Optional[int] = None,
                seed: int = 0) -> Dict[str, float]:
    """Pooled tau (committed tokens / rounds over all prompts), tokens/s, and the two counts.

    No stop token (every prompt yields ``max_new_tokens``); at ``T > 0``
    prompt ``i`` uses seed ``seed + i``.
    """
    from ..decoding import generate

    was_training = draft.training
    draft.eval()
    committed = rounds = 0
    seconds = 0.0
    try:
        for i, p in enumerate(prompts):
            r = generate(target, draft, torch.tensor(p, dtype=torch.long), method=method,
                         max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                         tree_budget=tree_budget)
            committed += sum(r.acceptance_lengths)
            rounds += r.num_rounds
            seconds += r.total_time
    finally:
        draft.train(was_training)
    return dict(tau=committed / max(rounds, 1), tokens_per_second=committed / seconds if seconds else float("nan"),
                committed=committed, rounds=rounds)


def distributed_tau(world, target, draft, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Pooled greedy DFlash tau over ``prompts``, each rank running ``prompts[rank::N]`` on ``draft`` (whole)."""
    mine = list(prompts)[world.rank::world.world_size]
    m = measure_tau(target, draft, mine, max_new_tokens=max_new_tokens) if mine else dict(committed=0, rounds=0)
    committed, rounds = world.all_reduce_sum([m["committed"], m["rounds"]])
    return committed / max(rounds, 1.0)


def final_eval_table(target, trained, untrained, prompts, budgets: Sequence[int], new_tokens: int,
                     seed: int) -> Dict[str, dict]:
    """tau at T=0 and T=0.7 for DFlash (B) and DDTree ``budgets``, trained vs untrained (rows printed to stderr)."""
    table: Dict[str, dict] = {}
    methods: List = [("dflash", None)] + [("ddtree", b) for b in budgets]
    for temperature in (0.0, 0.7):
        for method, budget in methods:
            key = f"{method}" + (f"_budget{budget}" if budget else f"_B{trained.block_size}") + f"_T{temperature}"
            row = {}
            for name, draft in (("trained", trained), ("untrained", untrained)):
                m = measure_tau(target, draft, prompts, method=method, temperature=temperature,
                                max_new_tokens=new_tokens, tree_budget=budget, seed=seed)
                row[name] = {k: round(v, 3) for k, v in m.items() if k in ("tau", "tokens_per_second")}
            table[key] = row
            print(f"{key:28s} tau trained {row['trained']['tau']:.2f}  untrained {row['untrained']['tau']:.2f}",
                  file=sys.stderr, flush=True)
    return table

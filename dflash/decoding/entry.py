"""The loops' direct entry points (the keywords of :class:`~dflash.decoding.options.LoopOptions`).

``ar_generate(target, input_ids, **options)``, ``dflash_generate(target,
draft, input_ids, **options)``, ``ddtree_generate_result(target, draft,
input_ids, **options)``: each is :func:`~dflash.decoding.loop.generate_rounds`
with its method, eager (``compile=False``) unless asked. ``ddtree_generate``
keeps the reference implementation's argument order.
"""

from __future__ import annotations

from .loop import generate_rounds
from .options import LoopOptions
from .result import GenerationResult

__all__ = ["ar_generate", "ddtree_generate", "ddtree_generate_result", "dflash_generate"]


def ar_generate(target, input_ids, *, compile=False, **options) -> GenerationResult:
    """Plain autoregressive decoding through the same round (the speedup baseline; acceptance lengths all 1)."""
    return generate_rounds(target, None, input_ids, "ar", LoopOptions(**options), compile=compile)


def dflash_generate(target, draft, input_ids, *, compile=False, **options) -> GenerationResult:
    """DFlash speculative decoding (one chain of ``block_size - 1`` drafts per round)."""
    return generate_rounds(target, draft, input_ids, "dflash", LoopOptions(**options), compile=compile)


def ddtree_generate_result(target, draft, input_ids, *, compile=False, **options) -> GenerationResult:
    """DDTree generation (a best-first tree of ``tree_budget`` drafts per round, default ``2 * (B - 1)``;
    ``"auto"``: the budget chosen each round, :mod:`dflash.decoding.budget_policy`)."""
    return generate_rounds(target, draft, input_ids, "ddtree", LoopOptions(**options), compile=compile)


def ddtree_generate(draft, target, input_ids, mask_token_id=None, max_new_tokens=128, block_size=None,
                    stop_token_ids=None, temperature=0.0, tree_budget=None, seed=None,
                    return_trees: bool = False) -> GenerationResult:
    """Drop-in DDTree generation (argument order of the reference implementation).

    Returns a :class:`GenerationResult`: ``output_ids`` plus tau, acceptance
    lengths, per-round tree sizes and accepted depths, timings, and with
    ``return_trees=True`` each round's tree (tokens, depths, parents) and
    accepted node indices.
    """
    return ddtree_generate_result(target, draft, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                  stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                                  tree_budget=tree_budget, mask_token_id=mask_token_id, return_trees=return_trees)

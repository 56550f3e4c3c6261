"""DDTree: verify a best-first tree of drafts per round (SPEC section 5).

One round, with ``n`` committed tokens (the last, the root, at position
``start = n - 1`` and not yet in the target's cache):

1. draft:  the DFlash drafter pass; fused lm_head + log-softmax + top-K at
   block positions 1..B-1 gives ``[B-1, K]`` log-probs and ids;
2. tree:   :func:`dflash_kernels.build_tree` (C++) pops the ``budget`` most
   likely paths best-first: tokens ``[N]``, depths ``[N]``, parents ``[N+1]``;
3. verify: the target runs on ``[root, nodes...]`` at positions
   ``start + [0, depths]``; each token sees the prefix, itself and its
   ancestors (packed bits from :func:`dflash_kernels.ancestor_bits`, read by
   the tree-attention kernel, or a dense mask for the fallback backends);
   ``choice[i]`` = the target's token after node i;
4. walk:   from the root, follow the child whose token equals the target's
   choice; commit the walked nodes' tokens plus the choice at the last node;
   compact the walked rows of every layer's K/V to follow the prefix (one
   launch) and gather their captured features as the next context.

Every committed token is the target's own choice, so the output is lossless
at any temperature. Host syncs per round: the top-K table for the C++ tree
build, and the choices for the walk.
"""

from __future__ import annotations

import torch

import dflash_kernels

from .result import GenerationResult
from .speculation import Speculation


def _check_budget(tree_budget) -> int:
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"tree_budget must be an int >= 1 (number of draft nodes per round), got {tree_budget!r}")
    return tree_budget


@torch.inference_mode()
def ddtree_generate_result(target, draft, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None,
                           block_size=None, seed=None, tree_budget=None, mask_token_id=None, return_trees=False,
                           stage_timing=True) -> GenerationResult:
    """DDTree generation; returns a :class:`GenerationResult` with per-round tree statistics.

    ``tree_budget``: draft nodes per round (default ``2 * (B - 1)``);
    ``return_trees``: keep each round's tree (tokens, depths, parents,
    accepted node indices) in ``result.trees``.
    """
    B = block_size if block_size is not None else draft.block_size
    budget = _check_budget(tree_budget if tree_budget is not None else 2 * (int(B) - 1))
    with Speculation(target, draft, input_ids, method="ddtree", max_new_tokens=max_new_tokens,
                     temperature=temperature, stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                     tree_size=budget, mask_token_id=mask_token_id, stage_timing=stage_timing) as s:
        result, clock, device = s.result, s.clock, s.device
        K = min(budget, s.adapter.vocab_size)
        s.prefill()
        while not s.out.done:
            start = s.out.committed - 1
            logprobs, ids = dflash_kernels.lm_head_topk(s.draft(), s.lm_head, K, positions=s.draft_rows)
            tokens, depths, parents = dflash_kernels.build_tree(logprobs.cpu(), ids.cpu(), budget)
            result.draft_time += clock.lap()

            verify_ids = torch.cat([torch.tensor([s.out.last], device=device), tokens.to(device)])
            verify_pos = dflash_kernels.tree_positions(depths.to(device), start)
            bits = dflash_kernels.ancestor_bits(parents.to(device))
            hidden = s.adapter.forward(verify_ids, verify_pos, s.cache, tree_bits=bits)
            choices = s.adapter.choose(hidden, temperature, generator=s.generator)
            result.verify_time += clock.lap()

            accepted, bonus = dflash_kernels.walk_tree(parents, tokens, choices)
            committed = tokens[accepted[1:] - 1].tolist() + [int(bonus)]
            s.cache.commit_rows(accepted)
            s.context = s.adapter.context_features(rows=accepted.to(device), trusted_rows=True)
            s.out.extend(committed)
            result.acceptance_lengths.append(len(committed))
            result.tree_sizes.append(int(tokens.numel()))
            result.accepted_depths.append(len(committed) - 1)
            if return_trees:
                result.trees.append(dict(tokens=tokens, depths=depths, parents=parents, accepted=accepted))
            result.commit_time += clock.lap()
        return s.finish()


def ddtree_generate(draft, target, input_ids, mask_token_id=None, max_new_tokens=128, block_size=None,
                    stop_token_ids=None, temperature=0.0, tree_budget=None, seed=None,
                    return_trees: bool = False) -> GenerationResult:
    """Drop-in DDTree generation (argument order of the reference implementation).

    Returns a :class:`GenerationResult`: ``output_ids`` plus tau, acceptance
    lengths, per-round tree sizes and accepted depths, timings, and with
    ``return_trees=True`` each round's tree and accepted node indices.
    """
    return ddtree_generate_result(target, draft, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                  stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                                  tree_budget=tree_budget, mask_token_id=mask_token_id, return_trees=return_trees)

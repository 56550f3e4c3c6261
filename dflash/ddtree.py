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

import time
from typing import Optional

import torch

import dflash_kernels

from .cache import DraftKVCache
from .generate import (GenerationResult, _check_common, _check_pair, _Clock, _generator, _Output, _prefill,
                       _prepare_prompt, draft_block)
from .target import TargetAdapter


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
    stop_ids = _check_common(max_new_tokens, temperature, stop_token_ids)
    B = int(block_size if block_size is not None else draft.block_size)
    if B < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {B}")
    budget = _check_budget(tree_budget if tree_budget is not None else 2 * (B - 1))
    adapter = TargetAdapter(target, draft.target_layer_ids)
    try:
        _check_pair(adapter, draft)
        mask_id = draft.mask_token_id if mask_token_id is None else int(mask_token_id)
        if not 0 <= mask_id < adapter.vocab_size:
            raise ValueError(f"mask_token_id {mask_id} is outside the vocabulary [0, {adapter.vocab_size})")
        device = adapter.device
        prompt = _prepare_prompt(input_ids, adapter.vocab_size, device)
        gen = _generator(seed, device)
        K = min(budget, adapter.vocab_size)
        max_len = prompt.numel() + max_new_tokens + max(budget, B) + 2
        cache = adapter.new_cache(max_len)
        draft_cache = DraftKVCache(draft.config, max_len, dtype=draft.fc.weight.dtype, device=device)
        out = _Output(prompt, max_new_tokens, stop_ids)
        result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method="ddtree")
        W = adapter.lm_head.weight
        draft_rows = torch.arange(1, B, device=device)

        clock = _Clock(device, stage_timing)
        start_time = clock.t
        first = _prefill(adapter, prompt, cache, temperature, gen)
        context = adapter.context_features()
        out.extend(first.tolist())
        result.time_to_first_token = clock.lap()

        while not out.done:
            start = out.committed - 1
            positions = torch.arange(draft_cache.length, start + B, device=device)
            with _mask_token(draft, mask_id):
                draft_hidden = draft_block(draft, adapter, out.last, context, positions, draft_cache)
            logprobs, ids = dflash_kernels.lm_head_topk(draft_hidden, W, K, positions=draft_rows)
            tokens, depths, parents = dflash_kernels.build_tree(logprobs.cpu(), ids.cpu(), budget)
            result.draft_time += clock.lap()

            tokens_d, parents_d = tokens.to(device), parents.to(device)
            verify_ids = torch.cat([torch.tensor([out.last], device=device), tokens_d])
            verify_pos = dflash_kernels.tree_positions(depths.to(device), start)
            bits = dflash_kernels.ancestor_bits(parents_d)
            hidden = adapter.forward(verify_ids, verify_pos, cache, tree_bits=bits)
            choices = adapter.choose(hidden, temperature, generator=gen)
            result.verify_time += clock.lap()

            accepted, bonus = dflash_kernels.walk_tree(parents, tokens, choices)
            committed = tokens[accepted[1:] - 1].tolist() + [int(bonus)]
            accepted_d = accepted.to(device)
            cache.commit_rows(accepted)
            context = adapter.context_features(rows=accepted_d, trusted_rows=True)
            out.extend(committed)
            result.acceptance_lengths.append(len(committed))
            result.tree_sizes.append(int(tokens.numel()))
            result.accepted_depths.append(len(committed) - 1)
            if return_trees:
                result.trees.append(dict(tokens=tokens, depths=depths, parents=parents, accepted=accepted))
            result.commit_time += clock.lap()

        result.total_time = time.perf_counter() - start_time
        result.output_ids = torch.tensor([out.tokens], device=device)
        return result
    finally:
        adapter.close()


class _mask_token:
    """Temporarily use another mask token id in the drafter's block input."""

    def __init__(self, draft, mask_id: int):
        self.draft, self.mask_id = draft, mask_id

    def __enter__(self):
        self.saved, self.draft.mask_token_id = self.draft.mask_token_id, self.mask_id

    def __exit__(self, *exc):
        self.draft.mask_token_id = self.saved


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

"""DDTree: verify a best-first tree of drafts per round.

One round, with ``n`` committed tokens (the last, the root, at position
``start = n - 1`` and not yet in the target's cache), all on the device until
one host read at the end:

1. draft:  the DFlash drafter pass; fused lm_head + log-softmax + top-K at
   block positions 1..B-1 gives ``[D, K]`` log-probs and ids (``D = B - 1``);
2. tree:   the ``N`` highest-scoring paths (:func:`dflash_kernels.build_tree_device`:
   per-depth then global top-N, a fixed ``N``): tokens ``[N]``, depths ``[N]``,
   parents ``[N+1]``;
3. verify: the target runs on ``[root, nodes...]`` at positions
   ``start + [0, depths]``; each token sees the prefix, itself and its
   ancestors (packed bits from :func:`dflash_kernels.ancestor_bits`, read by
   the attention function); ``choice[i]`` = the target's token after node i;
4. walk:   node i is on the path iff its token is the choice at its parent and
   its parent is on the path (:func:`dflash_kernels.walk_tree_device`): the
   path ``[D+1]`` (padded), its length, and the committed tokens (path tokens
   then the bonus choice);
5. commit: the path's K/V rows of every layer move to follow the prefix
   (:func:`dflash_kernels.compact_kv_`, the row count read on the device), the
   path rows' captured features are gathered, and ONE host read brings the
   committed tokens and the path length.

On the reference backend with CPU tensors the tree is built and walked by the
C++ ops (the host is the device there: no copy, the same tree and path, and
the walk costs about 1 us instead of the tensor ops' ~165 us); the round still
reads its committed tokens once. Every committed
token is the target's own choice, so the output is lossless at any temperature.
"""

from __future__ import annotations

import torch

import dflash_kernels
from dflash_kernels.tree_device import tree_tables

from .result import GenerationResult
from .speculation import Speculation


def _check_budget(tree_budget) -> int:
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"tree_budget must be an int >= 1 (number of draft nodes per round), got {tree_budget!r}")
    return tree_budget


def _host_tree_ops(device: torch.device) -> bool:
    """True when the tree is built and walked by the C++ ops: the reference backend on CPU tensors."""
    return device.type == "cpu" and dflash_kernels.get_backend(device) == "reference"


@torch.inference_mode()
def ddtree_generate_result(target, draft, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None,
                           block_size=None, seed=None, tree_budget=None, mask_token_id=None, return_trees=False,
                           stage_timing=True, sampling=None, stopping_criteria=None,
                           streamer=None) -> GenerationResult:
    """DDTree generation; returns a :class:`GenerationResult` with per-round tree statistics.

    ``tree_budget``: draft nodes per round (default ``2 * (B - 1)``);
    ``return_trees``: keep each round's tree (tokens, depths, parents,
    accepted node indices) in ``result.trees`` (costs extra host copies);
    ``sampling`` replaces ``temperature`` when given; ``stopping_criteria``
    and ``streamer`` as in :func:`~dflash.decoding.chain.dflash_generate`.
    """
    B = block_size if block_size is not None else draft.block_size
    budget = _check_budget(tree_budget if tree_budget is not None else 2 * (int(B) - 1))
    with Speculation(target, draft, input_ids, method="ddtree", max_new_tokens=max_new_tokens,
                     temperature=temperature, stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                     tree_size=budget, mask_token_id=mask_token_id, stage_timing=stage_timing, sampling=sampling,
                     stopping_criteria=stopping_criteria, streamer=streamer) as s:
        result, clock = s.result, s.clock
        D = s.B - 1
        K = min(budget, s.adapter.vocab_size)
        on_host = _host_tree_ops(s.device)
        # the device build's index tables, made once per generation (a build without them makes its own)
        tables = None if on_host else tree_tables(D, K, budget, s.device)
        s.prefill()
        while not s.out.done:
            start = s.out.committed - 1
            logprobs, ids = dflash_kernels.lm_head_topk(s.draft(), s.lm_head, K, positions=s.draft_rows,
                                                        check_bounds=False)
            if on_host:
                tokens, depths, parents = dflash_kernels.build_tree(logprobs, ids, budget)
            else:
                tokens, depths, parents = dflash_kernels.build_tree_device(logprobs, ids, budget, tables=tables)
            clock.mark("draft")

            verify_ids = torch.cat([s.last_token, tokens])
            bits = dflash_kernels.ancestor_bits(parents, check=False)
            hidden = s.adapter.forward(verify_ids, dflash_kernels.tree_positions(depths, start), s.cache,
                                       tree_bits=bits, tree_parents=parents)
            choices = s.choose(hidden)
            clock.mark("verify")

            if on_host:  # C++ walk on host tensors, host compaction indices
                path, bonus = dflash_kernels.walk_tree(parents, tokens, choices)
                length = path.numel()
                host = s.reader.read(torch.cat([tokens[path[1:] - 1], path]))
                committed = host[: length - 1] + [bonus]
                s.cache.commit_rows(path)
                s.context = s.adapter.context_features(rows=path, trusted_rows=True)
                s.last_token = choices[host[-1] : host[-1] + 1]
            else:  # device walk, device-side row count: nothing waits until the one read
                path, path_len, padded_committed = dflash_kernels.walk_tree_device(parents, tokens, choices, D,
                                                                                   bits=bits)
                s.cache.compact_rows(path, path_len)
                features = s.adapter.context_features(rows=path, trusted_rows=True)
                host = s.reader.read(torch.cat([padded_committed, path_len.reshape(1)]))
                length = host[-1]
                committed = host[:length]
                s.cache.commit(length)
                s.context = features[:length]
                s.last_token = padded_committed[length - 1 : length]
            s.commit(committed)
            result.tree_sizes.append(tokens.numel())
            result.accepted_depths.append(length - 1)
            if return_trees:
                result.trees.append(dict(tokens=tokens.cpu(), depths=depths.cpu(), parents=parents.cpu(),
                                         accepted=path[:length].cpu()))
            clock.mark("commit")
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

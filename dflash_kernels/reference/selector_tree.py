"""DDTree over a DFlash2 candidate selector: the per-node child distributions and the best-first tree (reference).

The selector (:mod:`dflash_kernels.reference.selector`) scores candidate ``j``
of drafted position ``d`` given the token ``prev`` chosen before it::

    s_d(j | prev) = unary[d, j] + < predecessor[prev] * projected[d], successor[candidates[d, j]] >

so in a draft tree the children of a node have their own distribution,
conditioned on that node's token. With ``k`` candidates per position the
nodes of depth ``d + 1`` range over ``candidates[d]`` and a node's children
over ``candidates[d + 1]``; the whole lattice is one transition table::

    prev[0, i]   = anchor                 (the root: every row of depth 0 is its row)
    prev[d, i]   = candidates[d - 1, i]   (d >= 1: the parent is candidate i of the previous position)
    S[d, i, j]   = s_d(j | prev[d, i])                                     [D, k, k] fp32
    L[d, i, :]   = log_softmax(S[d, i, :])                                 [D, k, k] float64

``D * k * k * r`` multiply-adds in one batched contraction. The scores are
the selector's own fp32 arithmetic at temperature 1 (greedy decoding's
``q``); the log-softmax runs in float64, which keeps the fp32 scores' order
within a row, so the argmax of ``L[d, i]`` is the selector's greedy choice
(lowest slot on ties) and the greedy chain is the tree's first path.

Tree: node = (depth ``d + 1``, candidate ``j``, parent node), ``score(node) =
score(parent) + L[d, j_parent, j]`` (float64; the root scores 0 and counts as
candidate 0 of depth 0). :func:`build_selector_tree` pops the ``N =
tree_size(D, k, budget)`` best nodes from a heap keyed by ``(-score, depth,
parent's node number, j)``; nodes are numbered in pop order. A child never
scores above its parent and on a tie is deeper, so this order puts every
parent before its children, and the pops follow one total order of the whole
lattice: the rule :func:`dflash_kernels.build_selector_tree_device` reproduces
without a heap. Layout as in :mod:`dflash_kernels.reference.tree`.
"""

from __future__ import annotations

import heapq
from typing import List, Tuple

import torch

from .selector import check_selector

__all__ = ["build_selector_tree", "selector_child_logprobs"]


def selector_child_logprobs(unary: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor,
                            predecessor: torch.Tensor, successor: torch.Tensor,
                            anchor: torch.Tensor) -> torch.Tensor:
    """The child log-probs ``L [(b,) D, k, k]`` float64 of the module docstring, of one sequence or of each of
    a batch of ``b``.

    Args:
        unary: ``[(b,) D, k]`` float: the candidates' drafter scores (logits or log-probs).
        candidates: ``[(b,) D, k]`` int64/int32 token ids, in ``[0, V)``.
        projected: ``[(b,) D, r]`` float: ``hidden_projection`` of the final block states.
        predecessor, successor: ``[V, r]`` float codebooks.
        anchor: int ``[1]`` (one sequence) or ``[b]``: the token before position 0 (each tree's root).

    Fixed-shape torch ops, no host read (traceable). ``L[.., 0, i]`` is the
    root's row for every ``i``; ``L[.., d, i]`` (``d >= 1``) the distribution
    over ``candidates[.., d]`` after ``candidates[.., d - 1, i]``. A batch is one
    contraction over its ``b * D`` positions, each computed exactly as in the
    call for its own sequence (the same values, bit for bit).
    """
    batched, _ = check_selector(unary, candidates, projected, predecessor, successor, anchor, 0.0,
                                "selector_child_logprobs")
    if not batched:
        return selector_child_logprobs(unary[None], candidates[None], projected[None], predecessor, successor,
                                       anchor.reshape(1))[0]
    b, D, k = unary.shape
    cand = candidates.to(torch.int64)
    root = anchor.reshape(b, 1, 1).to(torch.int64).expand(b, 1, k)
    prev = torch.cat([root, cand[:, :-1]], dim=1)  # [b, D, k]
    context = predecessor.float()[prev] * projected.float()[:, :, None, :]  # [b, D, k, r]
    r = context.shape[-1]
    # one [b * D]-batch contraction: position (s, d) is slice s * D + d, the [k, r] x [r, k] product of its own
    pair = torch.einsum("dir,djr->dij", context.reshape(b * D, k, r), successor.float()[cand].reshape(b * D, k, r))
    scores = unary.float()[:, :, None, :] + pair.view(b, D, k, k)
    return torch.log_softmax(scores.to(torch.float64), dim=-1)


def check_lattice(child_logprobs: torch.Tensor, candidates: torch.Tensor, fn: str) -> Tuple[int, int]:
    """``(D, k)`` of a lattice: ``child_logprobs [(b,) D, k, k]`` float and ``candidates [(b,) D, k]`` int on one
    device (a batch of ``b`` lattices where ``fn`` takes one)."""
    if not isinstance(child_logprobs, torch.Tensor) or not isinstance(candidates, torch.Tensor):
        raise TypeError(f"{fn}: child_logprobs and candidates must be torch.Tensor")
    if candidates.dim() not in (2, 3):
        raise ValueError(f"{fn}: candidates must be 2-D [D, k] or 3-D [b, D, k], got shape {tuple(candidates.shape)}")
    D, k = candidates.shape[-2:]
    want = (*candidates.shape[:-2], D, k, k)
    if tuple(child_logprobs.shape) != want:
        dims = "[b, D, k, k]" if candidates.dim() == 3 else "[D, k, k]"
        raise ValueError(f"{fn}: child_logprobs must be {dims} = {list(want)} for candidates "
                         f"{list(candidates.shape)}, got {tuple(child_logprobs.shape)}")
    if not child_logprobs.dtype.is_floating_point:
        raise ValueError(f"{fn}: child_logprobs must be floating point, got {child_logprobs.dtype}")
    if candidates.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{fn}: candidates must be int64 or int32, got {candidates.dtype}")
    if candidates.device != child_logprobs.device:
        raise ValueError(f"{fn}: child_logprobs and candidates must be on one device, got {child_logprobs.device} "
                         f"and {candidates.device}")
    return D, k


def build_selector_tree(child_logprobs: torch.Tensor, candidates: torch.Tensor,
                        budget: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first tree over the selector's lattice, by a heap (module docstring).

    Args:
        child_logprobs: ``[D, k, k]`` float (:func:`selector_child_logprobs`), all ``<= 0``.
        candidates: ``[D, k]`` int token ids.
        budget: the most nodes (root not counted), ``>= 0``.

    Returns:
        ``(token_ids [N] int64, depths [N] int64, parents [N+1] int64)`` on the
        CPU, ``N = min(budget, sum_{d=1..D} k**d)``.

    Every pop pushes all ``k`` children of the popped node (when it is above
    depth ``D``): the children of one node are not sorted by score, so no
    sibling chain as in :func:`dflash_kernels.reference.build_tree`.
    """
    D, k = check_lattice(child_logprobs, candidates, "build_selector_tree")
    if candidates.dim() != 2:
        raise ValueError(f"build_selector_tree: one lattice only, candidates [D, k]; got {tuple(candidates.shape)}")
    if type(budget) is not int or budget < 0:
        raise ValueError(f"build_selector_tree: budget must be an int >= 0, got {budget!r}")
    lp: List[List[List[float]]] = child_logprobs.detach().to("cpu", torch.float64).tolist()
    ids: List[List[int]] = candidates.detach().to("cpu", torch.int64).tolist()
    if any(x != x for plane in lp for row in plane for x in row):
        raise ValueError("build_selector_tree: child_logprobs contains NaN")
    token_ids: List[int] = []
    depths: List[int] = []
    parents: List[int] = [-1]
    # entries (-score, depth, parent node, j): unique, so the tuple order is the tie rule
    queue: list = []
    if D > 0 and k > 0:
        queue = [(-(0.0 + lp[0][0][j]), 1, 0, j) for j in range(k)]
        heapq.heapify(queue)
    while queue and len(token_ids) < budget:
        neg, depth, parent, j = heapq.heappop(queue)
        token_ids.append(ids[depth - 1][j])
        depths.append(depth)
        parents.append(parent)
        node = len(token_ids)
        if depth < D:
            score = -neg
            row = lp[depth][j]
            for c in range(k):
                heapq.heappush(queue, (-(score + row[c]), depth + 1, node, c))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return as_tensor(token_ids), as_tensor(depths), as_tensor(parents)

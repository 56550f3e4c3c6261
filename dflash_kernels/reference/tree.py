"""Pure-Python reference of the DDTree host ops and of the ancestor bitmask.

These are the spec in code: the C++ tree build / walk and the
Triton ancestor-bits kernel are tested for exact equality against them.

Tree layout used everywhere: node 0 is the root (the last committed token);
nodes 1..N are the drafted tokens, numbered in the order the best-first search
pops them, so ``parents[i] < i`` for every ``i >= 1`` and ``parents[0] == -1``.
``token_ids[i - 1]`` and ``depths[i - 1]`` belong to node ``i``.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Tuple

import numpy as np
import torch

__all__ = ["build_tree", "build_tree_sorted", "walk_tree", "walk_tree_padded", "ancestor_bits", "ancestor_bits_doubling"]


def build_tree(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first draft tree under a node budget.

    Args:
        top_logprobs: ``[D, K]`` float, row ``d`` = log-probs of the top-K tokens
            at depth ``d + 1``, sorted best first.
        top_ids: ``[D, K]`` integer token ids matching ``top_logprobs``.
        budget: the most nodes to add (the root not counted), ``>= 0``.

    Returns:
        ``(token_ids [N] int64, depths [N] int64, parents [N+1] int64)`` on the
        CPU, with ``N <= budget``.

    A max-priority queue holds candidates keyed by the sum of log-probs along
    their path (in float64): ``score = score(parent) + top_logprobs[depth-1, rank]``.
    It starts with (depth 1, rank 0, parent 0). Each pop appends the candidate
    as the next node and pushes, in this order, (a) its next sibling (same
    parent and depth, ``rank + 1``) if ``rank + 1 < K`` and (b) its first child
    (``depth + 1``, rank 0, parent = the new node) if ``depth < D``.

    Tie rule, every tree build's (:func:`build_tree_sorted` spells it out):
    nodes come in the order ``(score desc, depth asc, parent asc, rank asc)``,
    parents by node number. The queue holds one candidate per parent at most,
    and a candidate that enters after another of its chain (a next sibling, a
    first child) also comes after it in that order on a tied score, so the
    pops follow the order exactly.
    """
    if top_logprobs.dim() != 2 or top_ids.shape != top_logprobs.shape:
        raise ValueError(
            f"build_tree: top_logprobs must be [D, K] and top_ids the same shape, got "
            f"{tuple(top_logprobs.shape)} and {tuple(top_ids.shape)}"
        )
    if budget < 0:
        raise ValueError(f"build_tree: budget must be >= 0, got {budget}")
    logprobs: List[List[float]] = top_logprobs.detach().to("cpu", torch.float64).tolist()
    ids: List[List[int]] = top_ids.detach().to("cpu", torch.int64).tolist()
    if any(x != x for row in logprobs for x in row):
        raise ValueError("build_tree: top_logprobs contains NaN")
    max_depth, k = top_logprobs.shape

    token_ids: List[int] = []
    depths: List[int] = []
    parents: List[int] = [-1]
    # Entries: (-score, depth, parent, rank, parent_score); heapq pops the
    # smallest tuple: the highest score, then the lowest depth, then the lowest
    # parent (never two entries of one parent: rank is not compared).
    queue: list = []
    if budget > 0 and max_depth > 0 and k > 0:
        heapq.heappush(queue, (-(0.0 + logprobs[0][0]), 1, 0, 0, 0.0))
    while queue and len(token_ids) < budget:
        neg_score, depth, parent, rank, parent_score = heapq.heappop(queue)
        score = -neg_score
        token_ids.append(ids[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        node = len(token_ids)
        if rank + 1 < k:
            sibling_score = parent_score + logprobs[depth - 1][rank + 1]
            heapq.heappush(queue, (-sibling_score, depth, parent, rank + 1, parent_score))
        if depth < max_depth:
            child_score = score + logprobs[depth][0]
            heapq.heappush(queue, (-child_score, depth + 1, node, 0, score))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return as_tensor(token_ids), as_tensor(depths), as_tensor(parents)


def build_tree_sorted(
    top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, max_nodes: int = 200_000
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device build's tree (:func:`dflash_kernels.build_tree` with ``on_device=True``), by enumerating the whole tree.

    Args and returns as :func:`build_tree`; ``N = min(budget, sum_d K**d)``.
    Only for small trees: the full tree (``sum_d K**d`` nodes) must not exceed
    ``max_nodes``.

    Every node of the full tree gets a score (float64, ``score(parent) +
    logprob``, as in :func:`build_tree`) and, per depth, a position: depth
    ``d``'s nodes sorted by ``(score desc, parent's position asc, rank asc)``
    (the root has position 0). All nodes are then sorted by ``(score desc,
    depth asc, position asc)`` and the first ``N`` become nodes ``1..N``.
    This is the tie rule spelled out without the device build's pruning (the
    per-depth top-N and the dominated-pair cut) or the heap's lazy expansion,
    against which both are tested; they equal it, ties included.
    """
    if top_logprobs.dim() != 2 or top_ids.shape != top_logprobs.shape:
        raise ValueError(
            f"build_tree_sorted: top_logprobs must be [D, K] and top_ids the same shape, got "
            f"{tuple(top_logprobs.shape)} and {tuple(top_ids.shape)}"
        )
    if budget < 0:
        raise ValueError(f"build_tree_sorted: budget must be >= 0, got {budget}")
    logprobs: List[List[float]] = top_logprobs.detach().to("cpu", torch.float64).tolist()
    ids: List[List[int]] = top_ids.detach().to("cpu", torch.int64).tolist()
    max_depth, k = top_logprobs.shape
    total = sum(k**d for d in range(1, max_depth + 1))
    if total > max_nodes:
        raise ValueError(f"build_tree_sorted: the full tree has {total} nodes, more than max_nodes = {max_nodes}")
    # levels[d] = depth d + 1's nodes in position order: (score, parent position, rank).
    levels: List[List[Tuple[float, int, int]]] = []
    parent_scores = [0.0]  # the root, position 0
    for d in range(max_depth):
        nodes = [(parent_scores[p] + logprobs[d][r], p, r) for p in range(len(parent_scores)) for r in range(k)]
        nodes.sort(key=lambda x: (-x[0], x[1], x[2]))
        levels.append(nodes)
        parent_scores = [x[0] for x in nodes]
    everything = [(x[0], d, pos) for d, nodes in enumerate(levels) for pos, x in enumerate(nodes)]
    everything.sort(key=lambda x: (-x[0], x[1], x[2]))
    chosen = everything[: min(budget, total)]
    number = {(d, pos): i + 1 for i, (_, d, pos) in enumerate(chosen)}
    token_ids, depths, parents = [], [], [-1]
    for _, d, pos in chosen:
        _, parent_pos, rank = levels[d][pos]
        token_ids.append(ids[d][rank])
        depths.append(d + 1)
        parents.append(0 if d == 0 else number[(d - 1, parent_pos)])
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return as_tensor(token_ids), as_tensor(depths), as_tensor(parents)


def walk_tree(parents: torch.Tensor, token_ids: torch.Tensor, target_choice: torch.Tensor,
              max_depth: Optional[int] = None):
    """Follow the target's choices down the verified tree.

    Args:
        parents: ``[N+1]`` parent index per node (``parents[0] == -1``), or ``[b, N+1]`` with ``max_depth``.
        token_ids: ``[(b,) N]`` token of nodes 1..N.
        target_choice: ``[(b,) N+1]`` the target's next token after each node.
        max_depth: None: the unpadded walk of one tree. ``D``: the padded walk (:func:`walk_tree_padded`).

    Returns:
        ``(accepted [A] int64 node indices, root first, root-to-leaf order,
        bonus token)``. From the root: while ``target_choice[cur]`` is the token
        of a child of ``cur``, move to that child (the lowest-numbered if two
        share it); ``bonus = target_choice[last accepted]``.
    """
    if max_depth is not None:
        return walk_tree_padded(parents, token_ids, target_choice, max_depth)
    par = parents.detach().cpu().tolist()
    tok = token_ids.detach().cpu().tolist()
    choice = target_choice.detach().cpu().tolist()
    if len(par) < 1 or par[0] != -1:
        raise ValueError("walk_tree: parents must be [N+1] with parents[0] == -1")
    if len(tok) != len(par) - 1 or len(choice) != len(par):
        raise ValueError(
            f"walk_tree: expected token_ids [{len(par) - 1}] and target_choice [{len(par)}], "
            f"got [{len(tok)}] and [{len(choice)}]"
        )
    children: List[List[int]] = [[] for _ in par]
    for i in range(1, len(par)):
        if not 0 <= par[i] < i:
            raise ValueError(f"walk_tree: parents[{i}] = {par[i]} must lie in [0, {i})")
        children[par[i]].append(i)
    accepted = [0]
    cur = 0
    while True:
        nxt = next((c for c in children[cur] if tok[c - 1] == choice[cur]), None)
        if nxt is None:
            break
        accepted.append(nxt)
        cur = nxt
    return torch.tensor(accepted, dtype=torch.int64), int(choice[cur])


def ancestor_bits(parents: torch.Tensor) -> torch.Tensor:
    """Packed ancestor-or-self bitmask, by the row-copy recurrence.

    Args:
        parents: ``[N+1]`` int (one tree) or ``[b, N+1]`` (``b`` trees), ``parents[.., 0] == -1``,
            ``parents[.., i] < i``.

    Returns:
        ``[(b,) N+1, ceil((N+1)/32)]`` int32 on ``parents.device``: bit ``j % 32``
        of word ``j // 32`` in row ``i`` is set iff node ``j`` is ``i`` or an
        ancestor of ``i``. Row ``i`` = row ``parents[i]`` | bit ``i``.

    A NumPy loop over rows (and trees): readable, and the benchmark baseline of the kernel.
    """
    if parents.dim() not in (1, 2) or parents.shape[-1] < 1:
        raise ValueError(f"ancestor_bits: parents must be 1-D [N+1] or 2-D [b, N+1] with N+1 >= 1, got shape "
                         f"{tuple(parents.shape)}")
    par = parents.detach().cpu().numpy()
    n = par.shape[-1]
    trees = par.reshape(-1, n)
    bits = np.zeros((trees.shape[0], n, (n + 31) // 32), dtype=np.uint32)
    for t in range(trees.shape[0]):
        for i in range(n):
            if i > 0:
                if not 0 <= trees[t, i] < i:
                    raise ValueError(f"ancestor_bits: parents[{i}] = {trees[t, i]} must lie in [0, {i})")
                bits[t, i] = bits[t, trees[t, i]]
            bits[t, i, i // 32] |= np.uint32(1 << (i % 32))
    out = torch.from_numpy(bits.view(np.int32)).to(parents.device)
    return out if parents.dim() == 2 else out[0]


def ancestor_bits_doubling(parents: torch.Tensor) -> torch.Tensor:
    """:func:`ancestor_bits` by pointer doubling: fixed-shape tensor ops, no host read, no value check.

    ``bits`` starts as each node's own bit and ``jump`` as its parent (the
    root its own); each of ``ceil(log2(N+1))`` rounds ORs in the row
    ``jump`` points at and doubles the jump (``jump = jump[jump]``), so after
    round ``r`` a row holds its ancestors up to ``2**r - 1`` levels up: all of
    them once ``2**r`` exceeds any depth (depths are at most ``N``). A batch
    ``[b, N+1]`` runs every tree at once (gathers along the nodes' dim).
    """
    batched = parents.dim() == 2
    par = parents if batched else parents[None]
    b, n = par.shape
    words = (n + 31) // 32
    nodes = torch.arange(n, device=parents.device)
    bits = torch.zeros(b, n, words, dtype=torch.int64, device=parents.device)
    bits.scatter_(2, (nodes // 32)[None, :, None].expand(b, n, 1), (1 << (nodes % 32))[None, :, None].expand(b, n, 1))
    jump = torch.where(nodes == 0, nodes, par.to(torch.int64).clamp(min=0))  # [b, n]
    for _ in range(max(1, n.bit_length())):
        bits = bits | bits.gather(1, jump[:, :, None].expand(b, n, words))
        jump = jump.gather(1, jump)
    # int64 words hold 32 bits each: wrap the top bit into int32's sign bit
    out = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return out if batched else out[0]


def walk_tree_padded(parents: torch.Tensor, token_ids: torch.Tensor, target_choice: torch.Tensor,
                     max_depth: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk of one tree ``[N+1]`` or of each tree of a batch ``[b, N+1]``, padded with 0 to ``D + 1 =
    max_depth + 1``: ``(path [(b,) D+1], path_len [1] or [b], committed [(b,) D+1])`` int64, where for the
    accepted nodes ``a_0 = 0, .., a_{M-1}`` of a row (:func:`walk_tree`): ``path[j] = a_j``, ``path_len =
    M``, ``committed[j] = token_ids[a_{j+1} - 1]`` (``j < M - 1``), ``committed[M - 1]`` = the bonus."""
    one = parents.dim() == 1
    rows = [(parents, token_ids, target_choice)] if one else list(zip(parents, token_ids, target_choice))
    width = int(max_depth) + 1
    path = torch.zeros(len(rows), width, dtype=torch.int64)
    committed = torch.zeros(len(rows), width, dtype=torch.int64)
    path_len = torch.zeros(len(rows), dtype=torch.int64)
    for r, (par, tok, choice) in enumerate(rows):
        accepted, bonus = walk_tree(par, tok, choice)
        m = accepted.numel()
        if m > width:
            raise ValueError(f"walk_tree: row {r} accepts {m} nodes, more than max_depth + 1 = {width}")
        path[r, :m] = accepted
        committed[r, : m - 1] = tok.detach().cpu().to(torch.int64)[accepted[1:] - 1]
        committed[r, m - 1] = bonus
        path_len[r] = m
    return (path[0], path_len, committed[0]) if one else (path, path_len, committed)

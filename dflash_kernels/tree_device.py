"""DDTree build and walk on the tensors' device, with fixed shapes and no host sync.

The C++ ops of :mod:`dflash_kernels.tree` (``build_tree``, ``walk_tree``) read
the draft and the verification result on the host: a device-to-host copy, and
so a synchronization, per round, and copies back. The two functions here do
the same work with torch ops on the inputs' device. Their output shapes depend
only on shapes and Python ints (``D``, ``K``, ``budget``, ``max_depth``), they
never read a tensor value on the host (no ``.item()``, ``.tolist()``,
``nonzero``, boolean-mask indexing or Python ``if`` on values), so a round can
be enqueued (or captured in a CUDA graph) without waiting for the GPU. On CPU
tensors the same ops run on the CPU. On the Triton backend the walk is one
launch instead (:func:`dflash_kernels.tree.walk_tree_triton`, the same path
bit for bit); the torch walk here is the reference backend's.

Tree layout as in :mod:`dflash_kernels.tree`: node 0 is the root, nodes 1..N
are drafted tokens with ``parents[i] < i``; ``token_ids[i - 1]`` and
``depths[i - 1]`` describe node ``i``.

The public names are exported through :mod:`dflash_kernels.tree` (its
``__all__``; the build as the device backend of its one ``build_tree``),
hence the empty ``__all__`` here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .reference.selector_tree import check_lattice
from .reference.tree import ancestor_bits_doubling

__all__: list = []  # exported by dflash_kernels.tree: tree_size, build_selector_tree_device, walk_tree_device;
# build_tree_device is the device backend of dflash_kernels.build_tree (on_device=True)
# (TreeTables / tree_tables: the build's index tables, for callers that hold them; see build_tree_device)


def _check_int(name: str, fn: str, value, minimum: int = 0) -> int:
    if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value}")
    return value


def tree_size(depth: int, k: int, budget: int) -> int:
    """Node count ``N = min(budget, sum_{d=1..depth} k**d)`` of a DDTree (root not counted).

    Host arithmetic on Python ints (no tensors): the size :func:`build_tree_device`
    returns and the C++ ``build_tree`` reaches (its queue only runs empty once
    the whole tree of ``depth`` levels of ``k`` children has been popped).
    """
    _check_int("depth", "tree_size", depth)
    _check_int("k", "tree_size", k)
    _check_int("budget", "tree_size", budget)
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        if level == 0:
            break
        total += level
        if total >= budget:
            return budget
    return min(budget, total)


def _host_layout(n: int, k: int, max_depth: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Host ints of the device build for ``N = n``: ``(prefix, kept)`` (see :func:`_candidate_pairs` and
    :func:`_depth_layout`). Pure Python arithmetic, ``O(n + max_depth)``."""
    prefix = [0]
    for s in range(n):
        prefix.append(prefix[-1] + min(k, n // (s + 1)))
    kept, prev = [], 1
    for _ in range(max_depth):
        prev = min(n, prefix[prev])
        kept.append(prev)
    return tuple(prefix), tuple(kept)


class TreeTables(NamedTuple):
    """The index tables :func:`build_tree_device` reads for one ``(depth, k, budget)`` on one device.

    ``n, k, depth`` (host ints) say which build they serve; ``prefix`` and
    ``kept`` are host ints (:func:`_candidate_pairs`, :func:`_depth_layout`);
    ``slots``, ``ranks`` (``[C]``), ``depth_of`` (``[sum(kept)]``) and
    ``parent_base`` (``[depth + 1]``) are int64 device tensors.

    Whoever runs the build repeatedly holds its tables: a compiled round makes
    them once (:func:`tree_tables`) and keeps them as long as the graphs that
    read their addresses (a CUDA graph replays the addresses it captured, so
    the tables must not be freed while it lives: no module-level cache keeps
    them here). A build called without tables makes its own.
    """

    n: int
    k: int
    depth: int
    prefix: Tuple[int, ...]
    kept: Tuple[int, ...]
    slots: torch.Tensor
    ranks: torch.Tensor
    depth_of: torch.Tensor
    parent_base: torch.Tensor


def _tables(n: int, k: int, max_depth: int, device) -> TreeTables:
    prefix, kept = _host_layout(n, k, max_depth)
    long = dict(dtype=torch.int64, device=device)
    # device ops only (no host-to-device copy, no sync): slot s has min(k, n // (s + 1)) candidate ranks
    slot = torch.arange(n, **long)
    counts = torch.clamp(torch.div(n, slot + 1, rounding_mode="floor"), max=k)
    total = prefix[-1]
    slots = torch.repeat_interleave(slot, counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.arange(total, **long) - torch.repeat_interleave(starts, counts, output_size=total)
    if kept:
        depth_of = torch.cat([torch.full((m,), d + 1, **long) for d, m in enumerate(kept)])
    else:
        depth_of = torch.zeros(0, **long)
    # parent_base[d] = nodes kept at depths < d - 1 (the flat start of depth d - 1's list; 0 for d <= 1)
    parent_base = torch.searchsorted(depth_of, torch.arange(-2, max_depth - 1, **long), right=True)
    return TreeTables(n, k, max_depth, prefix, kept, slots, ranks, depth_of, parent_base)


def tree_tables(depth: int, k: int, budget: int, device) -> TreeTables:
    """The :class:`TreeTables` of a ``build_tree_device`` over ``[depth, k]`` drafts with ``budget``, on ``device``.

    Made with device ops from host ints (no host-to-device copy, no sync), so
    it may run inside a round; a caller that builds many trees of one shape
    makes them once and passes them (``tables=``).
    """
    _check_int("depth", "tree_tables", depth)
    _check_int("k", "tree_tables", k)
    _check_int("budget", "tree_tables", budget)
    return _tables(tree_size(depth, k, budget), k, depth, torch.device(device))


def _candidate_pairs(n: int, k: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """The candidates (parent slot ``s``, rank ``r``) that can be in a depth's top ``n``.

    Within a depth the kept parents are sorted by score (slot 0 best) and each
    row of log-probs is sorted, so candidate ``(s, r)`` scores no higher than
    every ``(s', r')`` with ``s' <= s, r' <= r`` and comes after all of them
    in the tie order too: ``(s + 1) * (r + 1) - 1`` candidates precede it, and
    it can be among the first ``n`` only if ``(s + 1) * (r + 1) <= n``.

    Returns ``(slots [C] int64, ranks [C] int64, prefix)`` on ``device``, listed
    by slot then rank (the tie order), ``C = sum_{s<n} min(k, n // (s + 1))``
    (about ``n ln n`` at ``k >= n``); ``prefix[m]`` (a host int) is the number
    of pairs with slot ``< m``, so the pairs of ``m`` parents are the first
    ``prefix[m]``. (The ``slots`` / ``ranks`` of :class:`TreeTables`.)
    """
    t = _tables(n, k, 0, device)
    return t.slots, t.ranks, t.prefix


def _depth_layout(n: int, k: int, max_depth: int, device: torch.device) -> Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor]:
    """Static per-depth sizes of the device build for ``N = n``.

    Returns ``(kept, depth_of, parent_base)``: ``kept[d]`` (host int) nodes are
    kept at depth ``d + 1``, ``min(n, #candidate pairs of kept[d - 1] parents)``
    (``= min(n, k**(d+1))``); ``depth_of [sum(kept)]`` int64 is the depth of
    each kept node in the flat list (depth 1's first, then depth 2's, ...);
    ``parent_base [max_depth + 1]`` int64 maps a depth to the flat start of
    the previous depth's list (0 for depths 0 and 1, whose parent is the root).
    (The ``kept`` / ``depth_of`` / ``parent_base`` of :class:`TreeTables`.)
    """
    t = _tables(n, k, max_depth, device)
    return t.kept, t.depth_of, t.parent_base


def _check_draft(top_logprobs, top_ids, fn: str) -> None:
    if not isinstance(top_logprobs, torch.Tensor) or not isinstance(top_ids, torch.Tensor):
        raise TypeError(f"{fn}: top_logprobs and top_ids must be torch.Tensor")
    if top_logprobs.dim() not in (2, 3) or top_ids.shape != top_logprobs.shape:
        raise ValueError(
            f"{fn}: top_logprobs must be 2-D [D, K] or 3-D [b, D, K] and top_ids the same shape, got "
            f"{tuple(top_logprobs.shape)} and {tuple(top_ids.shape)}"
        )
    if not top_logprobs.dtype.is_floating_point:
        raise ValueError(f"{fn}: top_logprobs must be floating point, got {top_logprobs.dtype}")
    if top_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{fn}: top_ids must be int64 or int32, got {top_ids.dtype}")
    if top_ids.device != top_logprobs.device:
        raise ValueError(f"{fn}: top_logprobs and top_ids must be on one device, got {top_logprobs.device} and {top_ids.device}")


def _empty_tree(lead: Tuple[int, ...], device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree of no nodes: ``(token_ids [.., 0], depths [.., 0], parents [.., 1] = -1, scores [.., 0] fp32)``."""
    empty = torch.zeros(*lead, 0, dtype=torch.int64, device=device)
    return (empty, empty.clone(), torch.full((*lead, 1), -1, dtype=torch.int64, device=device),
            torch.zeros(*lead, 0, dtype=torch.float32, device=device))


def build_tree_device(
    top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, tables: Optional[TreeTables] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first DDTree of ``N = tree_size(D, K, budget)`` nodes, built on the inputs' device.

    Args:
        top_logprobs: ``[D, K]`` (one tree) or ``[b, D, K]`` (``b`` trees) float (any float dtype); row ``d``
            holds the log-probs of depth ``d + 1``'s top-K tokens, sorted best first, all ``<= 0`` (``-inf``
            allowed).
        top_ids: int64/int32 token ids of the same shape matching ``top_logprobs``, distinct within a row;
            same device.
        budget: the most nodes (root not counted), ``>= 0``.
        tables: the build's index tables, :func:`tree_tables` of ``(D, K,
            budget)`` on the inputs' device (checked against the shapes);
            made here when omitted. A caller that captures the build in a
            CUDA graph passes tables it keeps alive as long as the graph.

    Returns:
        ``(token_ids [.., N] int64, depths [.., N] int64, parents [.., N+1] int64, scores [.., N] float32)`` on
        the inputs' device (``..`` the batch, if any), the layout of the C++ ``build_tree``; no host sync.
        ``scores[.., i]`` is node ``i + 1``'s path score (below), rounded to fp32: non-increasing in node
        order, ``exp(scores)`` the drafter's probability that the walk accepts the node.

    Scores are float64 path sums, computed as ``score(parent) +
    top_logprobs[d, rank]`` exactly like the C++ heap. Since scores never rise
    along a path or along sibling ranks, the heap's first ``N`` pops are the
    ``N`` highest-scoring nodes; this builds them directly, every row of a
    batch at once (each sort along the last dim):

    1. Per depth ``d = 1..D``: candidates = (the kept nodes of depth ``d - 1``,
       by slot; the root alone at depth 0) x (ranks ``0..K-1``), restricted to
       the pairs ``(s + 1)(r + 1) <= N`` that can reach the top ``N`` (a
       static index set, ``tables``, ~``N ln N`` pairs instead of ``N * K``);
       ``score = score(slot s) + logprob[d - 1, r]``; keep the best
       ``min(N, #candidates)``, sorted, as depth ``d``'s slots.
    2. Over all kept nodes: the best ``N``, numbered ``1..N`` in that order;
       each parent's slot maps to its node number.

    Tie rule (both sorts are stable sorts by score, descending, of lists laid
    out in the order below): nodes are ordered by ``(score desc, depth asc,
    parent's slot asc, rank asc)``, a node's slot being its position in its
    depth's order. Consequences (tested): a parent precedes its children
    (a child's score is ``<=`` its parent's, and on equality its depth is
    larger), so ``parents[i] < i``; the selected set is the first ``N`` nodes
    of one total order of the whole tree that sorts by score, hence it is
    prefix-closed (a node's parent is selected) and a valid best-first tree:
    every selected node scores ``>=`` every unselected node. This is exactly
    the C++ heap's tree (tokens, depths, parents bit for bit), exact score ties
    included: the heap pops in the same order (parents by node number, which
    within a depth follow the slots).

    Not checked (checking would read values on the host): NaN, positive or
    unsorted log-probs make the selection unspecified; ``parents`` is still
    clamped into ``[0, i)`` so the result is always a well-formed tree.
    """
    _check_draft(top_logprobs, top_ids, "build_tree_device")
    _check_int("budget", "build_tree_device", budget)
    batched = top_logprobs.dim() == 3
    if not batched:
        top_logprobs, top_ids = top_logprobs[None], top_ids[None]
    b, max_depth, k = top_logprobs.shape
    device = top_logprobs.device
    n = tree_size(max_depth, k, budget)
    if n == 0:
        return _empty_tree((b,) if batched else (), device)

    if tables is None:
        tables = _tables(n, k, max_depth, device)
    elif not isinstance(tables, TreeTables):
        raise TypeError(f"build_tree_device: tables must be TreeTables (tree_tables()), got {type(tables).__name__}")
    elif (tables.n, tables.k, tables.depth) != (n, k, max_depth) or tables.slots.device != device:
        raise ValueError(
            f"build_tree_device: tables are for N={tables.n}, K={tables.k}, D={tables.depth} on "
            f"{tables.slots.device}; this build has N={n}, K={k}, D={max_depth} on {device}")

    long = dict(dtype=torch.int64, device=device)
    lp = top_logprobs.detach().to(torch.float64)
    slots_all, ranks_all, prefix = tables.slots, tables.ranks, tables.prefix
    kept, depth_of, parent_base = tables.kept, tables.depth_of, tables.parent_base
    # Log-prob of every candidate pair's rank, all depths at once: [b, D, C].
    lp_pairs = lp[:, :, ranks_all[: prefix[kept[-2] if max_depth > 1 else 1]]]

    scores, picks = [], []
    prev_score = torch.zeros(b, 1, dtype=torch.float64, device=device)  # the root
    prev_kept = 1
    for d in range(max_depth):
        c = prefix[prev_kept]
        cand = prev_score[:, slots_all[:c]] + lp_pairs[:, d, :c]  # [b, c]
        pick = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, : kept[d]]  # pair index per slot
        prev_score = cand.gather(1, pick)
        scores.append(prev_score)
        picks.append(pick)
        prev_kept = kept[d]

    total = depth_of.numel()
    all_scores = torch.cat(scores, 1)  # [b, total]
    sel = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :n]  # [b, N]
    node_index = torch.arange(1, n + 1, **long)
    node_of = torch.full((b, total), n, **long)
    node_of.scatter_(1, sel, node_index.expand(b, n))
    sel_pair = torch.cat(picks, 1).gather(1, sel)
    sel_depth = depth_of[sel]
    # Flat index (over all kept nodes) of the parent: its slot + the start of
    # the previous depth's kept list (meaningless at depth 1: the root).
    parent_flat = slots_all[sel_pair] + parent_base[sel_depth]
    parent_node = torch.where(sel_depth > 1, node_of.gather(1, parent_flat.clamp(0, total - 1)), 0)
    parent_node = torch.minimum(parent_node, node_index - 1)  # a no-op on valid input
    parents = torch.cat([torch.full((b, 1), -1, **long), parent_node], 1)
    token_ids = top_ids.to(torch.int64).reshape(b, max_depth * k).gather(1, (sel_depth - 1) * k + ranks_all[sel_pair])
    node_scores = all_scores.gather(1, sel).to(torch.float32)
    out = (token_ids, sel_depth, parents, node_scores)
    return out if batched else tuple(t[0] for t in out)


def _selector_kept(n: int, k: int, max_depth: int) -> Tuple[int, ...]:
    """Host ints: nodes kept per depth by :func:`build_selector_tree_device`, ``min(n, k**(d+1))``."""
    kept, prev = [], 1
    for _ in range(max_depth):
        prev = min(n, prev * k)
        kept.append(prev)
    return tuple(kept)


def build_selector_tree_device(child_logprobs: torch.Tensor, candidates: torch.Tensor,
                               budget: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first tree over a DFlash2 selector's lattice, ``N = tree_size(D, k, budget)`` nodes, on the inputs'
    device, fixed shapes, no host sync.

    Args:
        child_logprobs: ``[D, k, k]`` (one tree) or ``[b, D, k, k]`` (``b`` trees) float:
            ``child_logprobs[.., d, i, j]`` = log-prob of candidate ``j`` of depth ``d + 1`` after candidate
            ``i`` of depth ``d`` (the root's row is ``[0, 0]``), all ``<= 0``:
            :func:`dflash_kernels.reference.selector_child_logprobs`.
        candidates: ``[(b,) D, k]`` int64/int32 token ids of each depth's candidates; same device.
        budget: the most nodes (root not counted), ``>= 0``.

    Returns:
        ``(token_ids [.., N] int64, depths [.., N] int64, parents [.., N+1] int64, scores [.., N] float32)``,
        the layout of :func:`build_tree_device` (``scores`` each node's float64 path sum rounded to fp32), so
        the verify, the walk and the compaction are unchanged.

    The tree of :func:`dflash_kernels.reference.build_selector_tree` (its heap) without a heap. A node's
    children have their own row of log-probs, not sorted, so unlike :func:`build_tree_device` no candidate
    pair is dominated by position; per depth ``d = 1..D`` (every row of a batch at once):

    1. candidates = (depth ``d - 1``'s kept nodes, by slot; the root alone at depth 0) x (``j = 0..k-1``),
       laid out by slot then ``j``: ``score = score(slot) + child_logprobs[d - 1, cand(slot), j]``
       (``[m, k]``, a gather of the parents' rows);
    2. keep the best ``min(N, m * k)`` (a stable sort, descending) as depth ``d``'s slots.

    Then over all kept nodes the best ``N`` (a stable sort of the concatenation, depth by depth), numbered
    ``1..N`` in that order. Order: ``(score desc, depth asc, parent's slot asc, j asc)``, the heap's key,
    since a depth's slot order is its nodes' pop order: with the heap's float64 sums this is the heap's
    tree bit for bit, ties included. The true top ``N`` of a depth all have parents in the previous depth's
    top ``N``, so keeping ``N`` per depth loses nothing. Work: ``D`` sorts of ``<= N * k`` scores and one of
    ``<= D * N``.

    Not checked (it would read values on the host): NaN or positive log-probs make the selection
    unspecified; ``parents`` is clamped into ``[0, i)`` so the result is always a well-formed tree.
    """
    fn = "build_selector_tree_device"
    max_depth, k = check_lattice(child_logprobs, candidates, fn)
    _check_int("budget", fn, budget)
    batched = candidates.dim() == 3
    if not batched:
        child_logprobs, candidates = child_logprobs[None], candidates[None]
    b = candidates.shape[0]
    device = child_logprobs.device
    long = dict(dtype=torch.int64, device=device)
    n = tree_size(max_depth, k, budget)
    if n == 0:
        return _empty_tree((b,) if batched else (), device)

    lp = child_logprobs.detach().to(torch.float64)
    kept = _selector_kept(n, k, max_depth)
    # Flat list of every kept node: the root at 0, then depth 1's slots, depth 2's, ...; `start` is the flat
    # index of the previous depth's slot 0.
    scores, parent_flat, cand, depth_of = [], [], [], []
    prev_score = torch.zeros(b, 1, dtype=torch.float64, device=device)
    prev_cand = torch.zeros(b, 1, **long)
    start = 0
    for d in range(max_depth):
        rows = lp[:, d].gather(1, prev_cand[:, :, None].expand(-1, -1, k))  # [b, m, k]: the parents' rows
        flat = (prev_score[:, :, None] + rows).reshape(b, -1)  # [b, m * k]: slot-major, then j
        pick = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, : kept[d]]
        prev_score, prev_cand = flat.gather(1, pick), pick % k
        scores.append(prev_score)
        parent_flat.append(torch.div(pick, k, rounding_mode="floor") + start)
        cand.append(prev_cand)
        depth_of.append(torch.full((kept[d],), d + 1, **long))
        start = 1 + sum(kept[:d])

    total = 1 + sum(kept)
    all_scores = torch.cat(scores, 1)  # [b, total - 1]
    order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :n]
    sel = order + 1  # flat index (root = 0)
    node_of = torch.zeros(b, total, **long)
    node_of.scatter_(1, sel, torch.arange(1, n + 1, **long).expand(b, n))
    zero = torch.zeros(b, 1, **long)
    parent_node = node_of.gather(1, torch.cat([zero] + parent_flat, 1).gather(1, sel))
    parent_node = torch.minimum(parent_node, torch.arange(n, **long))  # a no-op on valid input
    depths = torch.cat([zero[0]] + depth_of)[sel]
    slot = torch.cat([zero] + cand, 1).gather(1, sel)
    token_ids = candidates.to(torch.int64).reshape(b, max_depth * k).gather(1, (depths - 1) * k + slot)
    parents = torch.cat([torch.full((b, 1), -1, **long), parent_node], 1)
    out = (token_ids, depths, parents, all_scores.gather(1, order).to(torch.float32))
    return out if batched else tuple(t[0] for t in out)


def _check_walk(parents, token_ids, target_choice, max_depth, bits) -> int:
    fn = "walk_tree_device"
    for name, t in (("parents", parents), ("token_ids", token_ids), ("target_choice", target_choice)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{fn}: {name} must be int64 or int32, got {t.dtype}")
        if t.device != parents.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, parents on {parents.device}: all must share a device")
    if parents.dim() not in (1, 2) or parents.shape[-1] < 1:
        raise ValueError(f"{fn}: parents must be 1-D [N+1] or 2-D [b, N+1] with N+1 >= 1, got shape "
                         f"{tuple(parents.shape)}")
    lead, n_nodes = tuple(parents.shape[:-1]), parents.shape[-1]
    dims = "2-D [b, N]" if lead else "1-D [N]"
    if tuple(token_ids.shape) != (*lead, n_nodes - 1):
        raise ValueError(f"{fn}: token_ids must be {dims} = {[*lead, n_nodes - 1]}, got shape {tuple(token_ids.shape)}")
    if tuple(target_choice.shape) != (*lead, n_nodes):
        raise ValueError(f"{fn}: target_choice must be {dims[:3]} {[*lead, n_nodes]} (parents' shape), got shape "
                         f"{tuple(target_choice.shape)}")
    _check_int("max_depth", fn, max_depth)
    if bits is not None:
        words = (n_nodes + 31) // 32
        want = (*lead, n_nodes, words)
        if not isinstance(bits, torch.Tensor) or bits.dtype != torch.int32 or tuple(bits.shape) != want:
            got = f"{tuple(bits.shape)} {bits.dtype}" if isinstance(bits, torch.Tensor) else type(bits).__name__
            raise ValueError(f"{fn}: bits must be the int32 [.., N+1, ceil((N+1)/32)] = {list(want)} of "
                             f"ancestor_bits, got {got}")
        if bits.device != parents.device:
            raise ValueError(f"{fn}: bits is on {bits.device}, parents on {parents.device}")
    return n_nodes


def walk_tree_device(
    parents: torch.Tensor,
    token_ids: torch.Tensor,
    target_choice: torch.Tensor,
    max_depth: int,
    bits: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted path of a verified tree, or of each tree of a batch, on the inputs' device, fixed shapes, no host
    sync.

    Args:
        parents: ``[N+1]`` (one tree) or ``[b, N+1]`` (``b`` trees) int64/int32, ``parents[.., 0] == -1``,
            ``parents[.., i] in [0, i)``.
        token_ids: ``[(b,) N]`` int64/int32, token of nodes ``1..N``.
        target_choice: ``[(b,) N+1]`` int64/int32, the target's token after each node.
        max_depth: the trees' depth bound ``D`` (every node's depth ``<= D``).
        bits: optional ``[(b,) N+1, ceil((N+1)/32)]`` int32 from ``ancestor_bits(parents)``
            (the verification's attention mask already needs it); built here when omitted.

    Returns:
        ``(path [(b,) D+1] int64, path_len [1] (one tree) or [b] int64, committed [(b,) D+1] int64)`` on the
        inputs' device. ``path[:path_len]`` = the accepted nodes from the root
        (0) in depth order; entries past ``path_len`` repeat the last path
        node. ``committed[:path_len]`` = the round's committed tokens: the
        tokens of path nodes ``1..`` and then the bonus ``target_choice[last
        path node]`` at ``committed[path_len - 1]``; entries past it are 0.
        Same path and bonus as the C++ ``walk_tree``. A batch is every row's walk at once (each op along the
        nodes' dim): row ``r`` is bit for bit the walk of tree ``r`` alone.

    Node ``i >= 1`` matches iff ``token_ids[i - 1] == target_choice[parents[i]]``;
    should several children of one node match (siblings sharing a token,
    which ``build_tree`` never produces), only the lowest-numbered counts, as
    in the C++ walk. A node is on the path iff it and all its ancestors match
    (the root always does), so the path is a chain and, since parents precede
    children, its nodes in increasing index order are in depth order. "All
    ancestors match" is one test over the ancestor bitmask: pack the match
    vector into 32-bit words and test ``(bits[i] & ~match_words) == 0`` over
    the row's words, one elementwise pass over ``[N+1, W]`` plus a row
    reduction, free when the mask exists (a round's verify built it for the
    attention); without ``bits`` the mask is built here first, by the
    fixed-shape pointer doubling of :func:`dflash_kernels.reference.ancestor_bits_doubling`.

    A path longer than ``D + 1`` nodes (a node deeper than ``max_depth``) is cut
    to its first ``D + 1`` nodes; the bonus is then the last kept node's
    target choice, i.e. the next path node's token, still a valid commit.
    """
    n_nodes = _check_walk(parents, token_ids, target_choice, max_depth, bits)
    batched = parents.dim() == 2
    if not batched:
        parents, token_ids, target_choice = parents[None], token_ids[None], target_choice[None]
        bits = None if bits is None else bits[None]
    b = parents.shape[0]
    long = dict(dtype=torch.int64, device=parents.device)
    par = parents.to(torch.int64).clamp(min=0)  # the root points at itself
    choice = target_choice.to(torch.int64)
    idx = torch.arange(n_nodes, **long)
    tok = torch.cat([torch.full((b, 1), -1, **long), token_ids.to(torch.int64)], 1)
    is_root = idx == 0
    match = (tok == choice.gather(1, par)) | is_root  # the root always matches (no ``match[0] = True``: a host upload)
    # Only the lowest-numbered matching child of each node counts.
    first = torch.full((b, n_nodes), n_nodes, **long)
    first.scatter_reduce_(1, par[:, 1:], torch.where(match[:, 1:], idx[1:], n_nodes), reduce="amin")
    match = (match & (first.gather(1, par) == idx)) | is_root

    if bits is None:
        bits = ancestor_bits_doubling(parents)
    words = bits.shape[-1]
    padded = torch.zeros(b, words * 32, **long)
    padded[:, :n_nodes] = match.to(torch.int64)
    shifts = torch.arange(32, **long)
    match_words = (padded.view(b, words, 32) << shifts).sum(dim=2)  # [b, W], in [0, 2**32)
    on_path = ((bits.to(torch.int64) & ~match_words[:, None, :]) & 0xFFFFFFFF).eq(0).all(dim=2)

    width = max_depth + 1
    keys = torch.where(on_path, idx, n_nodes)
    if n_nodes < width:
        keys = torch.cat([keys, torch.full((b, width - n_nodes), n_nodes, **long)], 1)
    ordered = torch.sort(keys, dim=1).values[:, :width]
    path_len = on_path.sum(dim=1, keepdim=True).clamp(max=width).to(torch.int64)  # [b, 1]
    last = ordered.gather(1, path_len - 1)
    slot = torch.arange(width, **long)
    path = torch.where(slot < path_len, ordered, last)
    following = torch.cat([path[:, 1:], last], 1)  # path[j + 1]; only read where j + 1 < path_len
    committed = torch.where(slot < path_len - 1, tok.gather(1, following),
                            torch.where(slot == path_len - 1, choice.gather(1, last), 0))
    if batched:
        return path, path_len[:, 0], committed
    return path[0], path_len[0], committed[0]

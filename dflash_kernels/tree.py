"""DDTree structure ops: tree build and walk (C++), ancestor bitmask (Triton).

Tree layout: node 0 is the root, the last committed token;
nodes 1..N are drafted tokens numbered in best-first pop order, so a parent
always precedes its children (``parents[i] < i``, ``parents[0] == -1``).
``token_ids[i - 1]`` and ``depths[i - 1]`` describe node ``i``.

* :func:`build_tree` is the one tree build: one tree ``[D, K]`` or a batch
  ``[b, D, K]``, the tokens, depths, parents and each node's path score; on
  the host (the C++ heap of ``dflash_kernels._C``; GPU inputs are copied to
  the CPU first, one device-to-host copy, which synchronizes; CPU results)
  or, ``on_device=True``, on the inputs' device with fixed shapes and no host
  sync (:mod:`dflash_kernels.tree_device`). Both give the same trees, bit for
  bit, exact score ties included (one tie rule: ``(score desc, depth asc,
  parent asc, rank asc)``). The pure-Python spec is
  :mod:`dflash_kernels.reference.tree`.
* :func:`walk_tree` runs in C++ on the host: one tree, or a batch in one call.
* :func:`ancestor_bits` builds the packed ancestor-or-self bitmask on the
  parents' device with a Triton kernel (the interpreter on CPU when
  ``TRITON_INTERPRET=1``), else with the NumPy reference.
* :func:`tree_positions` gives the position ids of ``[root, nodes...]``.
* :func:`walk_tree_device` does the walk on the inputs' device, fixed shapes
  (:func:`tree_size` gives ``N``) and no host sync: the C++ walk's path. On
  the Triton backend one launch, one program per tree
  (:func:`walk_tree_triton`); on the reference backend the fixed-shape torch
  ops of :mod:`dflash_kernels.tree_device`.
* :func:`selector_child_logprobs` / :func:`build_selector_tree_device`: the
  tree over a DFlash2 candidate selector, whose children are scored given
  their parent's token (:mod:`dflash_kernels.reference.selector_tree`); the
  same output layout, so verification and the walk are unchanged.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import _C
from . import reference as _reference
from . import tree_device as _device
from ._dispatch import resolve_backend, tracing
from .reference.selector_tree import selector_child_logprobs
from .tree_device import TreeTables, tree_size

__all__ = [
    "build_tree",
    "walk_tree",
    "ancestor_bits",
    "tree_positions",
    "tree_size",
    "build_selector_tree_device",
    "selector_child_logprobs",
    "walk_tree_device",
]


def build_tree(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int, *, on_device: bool = False,
               tables: Optional[TreeTables] = None,
               backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best-first draft tree(s) under a node budget: the one tree build, on the host or on the device.

    Args:
        top_logprobs: ``[D, K]`` (one tree) or ``[b, D, K]`` (``b`` trees) float; row ``d`` holds the log-probs
            of the top-K drafted tokens at depth ``d + 1``, sorted best first, all ``<= 0``.
        top_ids: int64 (or int32) token ids of the same shape matching ``top_logprobs``.
        budget: the most nodes to add, root not counted (``>= 0``).
        on_device: False: the C++ heap on the host (``dflash_kernels._C``): inputs on a GPU are copied to the
            CPU first (a sync; CPU inputs are read in place, any strides, float32/float64 without a conversion
            copy), the outputs are CPU tensors, the scores float64. True: the fixed-shape sort build of
            :func:`dflash_kernels.tree_device.build_tree_device` on the inputs' device, no host read (a
            compiled round's), the scores float32.
        tables: on the device, the build's :class:`~dflash_kernels.tree_device.TreeTables`, held by the caller
            (a compiled round holds them as long as its graphs, which read their addresses); made per call
            when omitted.
        backend: on the device, 'triton' or 'reference' to fix the backend (a compiled round does), None:
            :func:`dflash_kernels.get_backend`.

    Returns:
        ``(token_ids [.., N] int64, depths [.., N] int64, parents [.., N+1] int64, scores [.., N])``, ``..`` the
        batch if any, ``N = tree_size(D, K, budget)``; ``scores[.., i]`` is node ``i + 1``'s path score, the sum
        of the log-probs from the root to it (float64 sums, ``score(parent) + logprob``; the key the build
        ranks nodes by: non-increasing in node order). ``exp(scores)`` is the drafter's probability that a
        walk accepts the node. Nodes come in the order ``(score desc, depth asc, parent asc, rank asc)`` on
        both backends, so they build the same trees bit for bit, exact ties included
        (:func:`dflash_kernels.reference.build_tree` for the heap, ``build_tree_sorted`` for the rule spelled
        out).
    """
    if type(budget) is not int and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise TypeError(f"build_tree: budget must be an int, got {type(budget).__name__}")
    if type(top_logprobs) is not torch.Tensor and not isinstance(top_logprobs, torch.Tensor):
        raise TypeError(f"build_tree: top_logprobs must be a torch.Tensor, got {type(top_logprobs).__name__}")
    if type(top_ids) is not torch.Tensor and not isinstance(top_ids, torch.Tensor):
        raise TypeError(f"build_tree: top_ids must be a torch.Tensor, got {type(top_ids).__name__}")
    if not on_device:
        if tables is not None:
            raise ValueError("build_tree: tables are the device build's (on_device=True)")
        return _C.build_tree(top_logprobs, top_ids, budget)
    if tracing() and resolve_backend(backend, top_logprobs.device) == "triton":
        if tables is None:
            return torch.ops.dflash.build_tree_device.default(top_logprobs, top_ids, budget)
        return torch.ops.dflash.build_tree_device.tables(top_logprobs, top_ids, budget, tables.slots, tables.ranks,
                                                         tables.depth_of, tables.parent_base)
    return _device.build_tree_device(top_logprobs, top_ids, budget, tables=tables)


def walk_tree(parents: torch.Tensor, token_ids: torch.Tensor, target_choice: torch.Tensor,
              max_depth: Optional[int] = None):
    """Accepted path of a verified tree, or of each tree of a batch (C++, one call).

    Args:
        parents: ``[N+1]`` (one tree) or ``[b, N+1]`` (a batch) int, ``parents[.., 0] == -1``,
            ``parents[.., i] in [0, i)``.
        token_ids: ``[(b,) N]`` int, token of nodes 1..N.
        target_choice: ``[(b,) N+1]`` int, the target's token after each node
            (argmax or sample of its logits at that node).
        max_depth: None: the unpadded walk of one tree (``[N+1]`` inputs only). An int ``D`` (the tree's
            depth bound): the padded walk of one tree or of a batch, in the layout of
            :func:`walk_tree_device`.

    From the root, while ``target_choice[cur]`` is the token of a child of ``cur`` (the lowest-numbered
    such child), the walk moves to that child; the accepted nodes are ``a_0 = 0, a_1, .., a_{M-1}``.
    GPU inputs are copied to the CPU first; the outputs are int64 CPU tensors.

    Returns:
        ``max_depth`` None: ``(accepted, bonus)``, ``accepted [M]`` the accepted nodes and ``bonus =
        int(target_choice[accepted[-1]])``. ``max_depth = D``: ``(path [(b,) D+1], path_len [1] or [b],
        committed [(b,) D+1])``, ``path[.., j] = a_j``, ``path_len = M``, ``committed[.., j] =
        token_ids[a_{j+1} - 1]`` for ``j < M - 1`` and the bonus at ``j = M - 1``, every other slot 0
        (a row accepting more than ``D + 1`` nodes is an error).
    """
    for name, t in (("parents", parents), ("token_ids", token_ids), ("target_choice", target_choice)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"walk_tree: {name} must be a torch.Tensor, got {type(t).__name__}")
    hosted = (_on_host(parents), _on_host(token_ids), _on_host(target_choice))
    if max_depth is None:
        return _C.walk_tree(*hosted)
    return _C.walk_tree_padded(*hosted, int(max_depth))


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it already lives on the CPU (no copy, no read); else its host copy (a sync)."""
    return t if t.device.type == "cpu" else t.detach().cpu()


def tree_positions(depths: torch.Tensor, start: int) -> torch.Tensor:
    """Position ids of the verification input ``[root, nodes...]``.

    Args:
        depths: ``[N]`` int, depth of nodes 1..N (from :func:`build_tree`).
        start: position of the root (the last committed token).

    Returns:
        ``[N+1]`` int64 on ``depths.device``: ``start`` for the root and
        ``start + depths[i - 1]`` for node ``i``.
    """
    if depths.dim() != 1:
        raise ValueError(f"tree_positions: depths must be 1-D [N], got shape {tuple(depths.shape)}")
    root = torch.zeros(1, dtype=torch.int64, device=depths.device)
    return torch.cat([root, depths.to(torch.int64)]) + start


# ----------------------------------------------------------------------------
# Ancestor bitmask
# ----------------------------------------------------------------------------

#: Launch configurations :func:`ancestor_bits` can choose (the compile test enumerates them).
ANCESTOR_BITS_CONFIGS: List[dict] = [
    {"BLOCK_R": 32, "num_warps": 1},
    {"BLOCK_R": 128, "num_warps": 4},
]


def ancestor_bits_config(n_nodes: int) -> dict:
    """Rows per program and warps for ``n_nodes = N + 1`` tree tokens."""
    return ANCESTOR_BITS_CONFIGS[0] if n_nodes <= 32 else ANCESTOR_BITS_CONFIGS[1]


@triton.jit
def _ancestor_bits_kernel(parents_ptr, bits_ptr, n_nodes, n_words, BLOCK_R: tl.constexpr):
    """One program: word ``w`` (nodes 32w..32w+31) of rows ``BLOCK_R * pid .. + BLOCK_R`` of tree ``pid(2)``.

    Each lane starts at its row and climbs the parent chain, setting the bit
    of every visited node that falls in this word. Indices only decrease on the
    way up, so the loop ends once every lane is below the word's first node
    (at once for the words right of the diagonal). A parent that is not
    smaller than its child ends the chain, so malformed input cannot hang.

    The batch is grid dim 2: tree ``t`` reads only its own parents row
    (``parents + t * n_nodes + [0, n_nodes)``) and writes only its own bits
    (``bits + t * n_nodes * n_words + row * n_words + word``, one element per
    (tree, row, word), i.e. per program and lane). No program reads what
    another writes: the parents are only loaded, the bits only stored, and
    they are different tensors (the launcher allocates the bits), so the
    programs of one launch need no ordering among themselves.
    """
    row_block = tl.program_id(0)
    word = tl.program_id(1)
    tree = tl.program_id(2).to(tl.int64)
    parents_ptr += tree * n_nodes
    bits_ptr += tree * n_nodes * n_words
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_nodes
    first = word * 32
    cur = tl.where(row_ok, rows, -1)
    acc = tl.zeros([BLOCK_R], dtype=tl.int32)
    one = tl.full([BLOCK_R], 1, dtype=tl.int32)
    while tl.max(cur, axis=0) >= first:
        hit = (cur >= first) & (cur < first + 32)
        shift = tl.where(hit, cur - first, 0)
        acc = acc | tl.where(hit, one << shift, 0)
        parent = tl.load(parents_ptr + cur, mask=cur >= 0, other=-1).to(tl.int32)
        cur = tl.where(parent < cur, parent, -1)
    tl.store(bits_ptr + rows.to(tl.int64) * n_words + word, acc, mask=row_ok)


def _check_parents(parents: torch.Tensor) -> None:
    if not isinstance(parents, torch.Tensor):
        raise TypeError(f"ancestor_bits: parents must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dim() not in (1, 2) or parents.shape[-1] < 1:
        raise ValueError(f"ancestor_bits: parents must be 1-D [N+1] or 2-D [b, N+1] with N+1 >= 1, got shape "
                         f"{tuple(parents.shape)}")
    if parents.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ancestor_bits: parents must be int64 or int32, got {parents.dtype}")
    if parents.shape[-1] >= 2**31:
        raise ValueError(f"ancestor_bits: at most 2**31 - 1 nodes, got {parents.shape[-1]}")
    if parents.dim() == 2 and parents.shape[0] >= 2**16:
        raise ValueError(f"ancestor_bits: at most 65535 trees in a batch, got {parents.shape[0]}")


def ancestor_bits_triton(parents: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`ancestor_bits` (no check of parent values: no host sync)."""
    _check_parents(parents)
    n_nodes = parents.shape[-1]
    n_words = triton.cdiv(n_nodes, 32)
    batch = parents.shape[0] if parents.dim() == 2 else 1
    parents = parents.contiguous()
    bits = torch.empty(*parents.shape, n_words, dtype=torch.int32, device=parents.device)
    if batch == 0:
        return bits
    cfg = ancestor_bits_config(n_nodes)
    grid = (triton.cdiv(n_nodes, cfg["BLOCK_R"]), n_words, batch)
    _ancestor_bits_kernel[grid](parents, bits, n_nodes, n_words, BLOCK_R=cfg["BLOCK_R"], num_warps=cfg["num_warps"])
    return bits


def ancestor_bits(parents: torch.Tensor, *, check: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """Packed ancestor-or-self bitmask of a tree, or of each tree of a batch.

    Args:
        parents: ``[N+1]`` (one tree) or ``[b, N+1]`` (``b`` trees) int64/int32 on any device;
            ``parents[.., 0] == -1`` and ``parents[.., i] in [0, i)``.

    Returns:
        ``[(b,) N+1, ceil((N+1)/32)]`` int32 on ``parents.device``; bit ``j % 32`` of
        word ``j // 32`` in row ``i`` (of tree ``r``) is set iff node ``j`` is ``i`` or one of
        its ancestors (the root always is). A batch is one launch (the trees are the kernel's grid dim 2).
        Values of ``parents`` are checked
        only on the reference path with ``check=True`` (checking reads them on
        the host); ``check=False`` (trees the decode loop built itself) runs
        the reference as fixed-shape tensor ops with no host read.
        ``backend``: 'triton' or 'reference' to fix the backend (a compiled
        round does), None: :func:`dflash_kernels.get_backend`.
    """
    _check_parents(parents)
    if resolve_backend(backend, parents.device) == "triton":
        if tracing():
            return torch.ops.dflash.ancestor_bits(parents, check)
        return ancestor_bits_triton(parents)
    if not check:
        return _reference.ancestor_bits_doubling(parents)
    return _reference.ancestor_bits(parents)


# ----------------------------------------------------------------------------
# Device walk
# ----------------------------------------------------------------------------

#: Integer arguments of the walk kernel that vary between calls or models (node count, depth bound): never
#: specialized, so one binary per block size serves every tree of a generation.
WALK_DYNAMIC_INTS = ("n_nodes", "max_depth")
#: The walk's inputs may be views at any offset (a bucket's prefix of a bigger tree, a row of the verify's
#: choices): never specialized on 16-byte alignment, so a new offset never compiles a new binary mid-generation
#: (the kernel reads them lane by lane and gathers the parents' choices: no vector load to lose).
WALK_UNALIGNED_PTRS = ("parents_ptr", "tokens_ptr", "choice_ptr")


def walk_block(n_nodes: int) -> int:
    """Lanes of the walk kernel for ``n_nodes = N + 1`` tree tokens: the next power of two, at least 32."""
    return max(32, triton.next_power_of_2(n_nodes))


def walk_width_block(max_depth: int) -> int:
    """Lanes of the walk kernel's path vectors (``D + 1`` slots): the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(max_depth + 1))


def walk_num_warps(block: int) -> int:
    return 1 if block <= 128 else 4


@triton.jit(do_not_specialize=WALK_DYNAMIC_INTS, do_not_specialize_on_alignment=WALK_UNALIGNED_PTRS)
def _walk_tree_kernel(parents_ptr, tokens_ptr, choice_ptr, path_ptr, len_ptr, committed_ptr, n_nodes, max_depth,
                      BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """One program: the accepted path of tree ``pid(0)``, from the root down.

    Node ``i >= 1`` matches iff ``tokens[i - 1] == choice[parents[i]]``. From the root, the next path node is
    the lowest-numbered matching child of the current one (``min {i : parents[i] == cur, match[i]}``, a
    reduction over the tree's ``BLOCK`` lanes), for at most ``max_depth`` steps: the C++ walk's descent, so a
    node is on the path iff it and all its ancestors match and each is its parent's lowest matching child.
    ``path[d]`` is the path's ``d``-th node, repeated past its end; ``committed[d]`` the token of ``path[d +
    1]`` below the end, the bonus ``choice[last]`` at ``path_len - 1``, 0 after; ``path_len[tree]`` the node
    count (at most ``max_depth + 1``). The path vectors live in ``BLOCK_W >= max_depth + 1`` lanes.

    Overlap: tree ``t`` reads only its own rows of ``parents`` / ``tokens`` / ``choice`` (``[t, 0..n_nodes)``,
    row strides ``n_nodes``, ``n_nodes - 1``, ``n_nodes``: the launcher passes contiguous tensors) and writes
    only its own ``path`` / ``committed`` row (``[t, 0..max_depth]``) and ``path_len[t]``; those three are
    fresh outputs, never views of an input, so no program reads what any program writes.
    """
    tree = tl.program_id(0).to(tl.int64)
    parents_ptr += tree * n_nodes
    tokens_ptr += tree * (n_nodes - 1)
    choice_ptr += tree * n_nodes
    width = max_depth + 1
    path_ptr += tree * width
    committed_ptr += tree * width
    idx = tl.arange(0, BLOCK)
    node = (idx > 0) & (idx < n_nodes)
    parent = tl.load(parents_ptr + idx, mask=node, other=-1).to(tl.int64)
    token = tl.load(tokens_ptr + idx - 1, mask=node, other=-1).to(tl.int64)
    # The root's choice (a parent's) is gathered for every node; the root itself never matches here.
    parent_choice = tl.load(choice_ptr + tl.maximum(parent, 0), mask=node, other=-2).to(tl.int64)
    match = node & (token == parent_choice)
    slot = tl.arange(0, BLOCK_W)
    path = tl.zeros([BLOCK_W], dtype=tl.int64)
    committed = tl.zeros([BLOCK_W], dtype=tl.int64)
    cur = tree * 0  # the root (an int64 scalar)
    length = cur + 1
    alive = length > 0  # still descending
    for d in range(1, max_depth + 1):
        nxt = tl.min(tl.where(match & (parent == cur), idx, BLOCK), axis=0).to(tl.int64)
        step = alive & (nxt < BLOCK)
        # the token that moves the path to nxt is committed at slot d - 1
        nxt_token = tl.sum(tl.where(idx == nxt, token, 0), axis=0)
        committed = tl.where(step & (slot == d - 1), nxt_token, committed)
        path = tl.where(step & (slot == d), nxt, path)
        cur = tl.where(step, nxt, cur)
        length = tl.where(step, length + 1, length)
        alive = step
    bonus = tl.load(choice_ptr + cur).to(tl.int64)
    path = tl.where(slot < length, path, cur)
    committed = tl.where(slot == length - 1, bonus, tl.where(slot < length - 1, committed, 0))
    in_row = slot < width
    tl.store(path_ptr + slot, path, mask=in_row)
    tl.store(committed_ptr + slot, committed, mask=in_row)
    tl.store(len_ptr + tree, length)


def walk_tree_triton(parents: torch.Tensor, token_ids: torch.Tensor, target_choice: torch.Tensor, max_depth: int,
                     bits: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`walk_tree_device`: one launch, one program per tree (``bits`` is checked and not
    needed: the descent reads the parents directly). Arguments and outputs as there."""
    n_nodes = _device._check_walk(parents, token_ids, target_choice, max_depth, bits)
    if n_nodes >= 2**31:
        raise ValueError(f"walk_tree_device: at most 2**31 - 1 nodes, got {n_nodes}")
    batched = parents.dim() == 2
    b = parents.shape[0] if batched else 1
    width = max_depth + 1
    long = dict(dtype=torch.int64, device=parents.device)
    path = torch.empty(b, width, **long)
    path_len = torch.empty(b, **long)
    committed = torch.empty(b, width, **long)
    if b > 0:
        block = walk_block(n_nodes)
        _walk_tree_kernel[(b,)](parents.contiguous(), token_ids.contiguous(), target_choice.contiguous(), path,
                                path_len, committed, n_nodes, max_depth, BLOCK=block,
                                BLOCK_W=walk_width_block(max_depth), num_warps=walk_num_warps(block))
    if batched:
        return path, path_len, committed
    return path[0], path_len, committed[0]


# The device build (and the reference backend's walk) are fixed-shape torch code without host reads
# (:mod:`dflash_kernels.tree_device`). Traced on the reference backend they are inlined (inductor fuses the ~60
# small ops of a build + bits + walk into a few loops, which opaque ops would keep apart); on the Triton backend
# each is one custom-op node, the walk's running the Triton walk above.


def build_selector_tree_device(
        child_logprobs: torch.Tensor, candidates: torch.Tensor, budget: int, *,
        backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_ids [.., N], depths [.., N], parents [.., N+1])`` int64 and ``scores [.., N]`` float32 (each node's
    path score, as :func:`build_tree`'s) on the inputs' device, ``N = tree_size(D, k, budget)``: the best-first
    tree over a DFlash2 selector's child log-probs ``[(b,) D, k, k]`` (:func:`selector_child_logprobs`) and
    candidates ``[(b,) D, k]``
    (:func:`dflash_kernels.tree_device.build_selector_tree_device`: the algorithm and the arguments).

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round does), None:
    :func:`dflash_kernels.get_backend`.
    """
    if tracing() and resolve_backend(backend, child_logprobs.device) == "triton":
        return torch.ops.dflash.build_selector_tree_device(child_logprobs, candidates, budget)
    return _device.build_selector_tree_device(child_logprobs, candidates, budget)


def walk_tree_device(parents: torch.Tensor, token_ids: torch.Tensor, target_choice: torch.Tensor, max_depth: int,
                     bits: Optional[torch.Tensor] = None, *,
                     backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(path [(b,) D+1], path_len [1] or [b], committed [(b,) D+1])`` int64: the accepted path of a verified tree,
    or of each tree of a batch (``parents [b, N+1]``), on the inputs' device, fixed shapes, no host sync
    (Triton backend: :func:`walk_tree_triton`, one launch; reference backend: the torch ops of
    :func:`dflash_kernels.tree_device.walk_tree_device`).

    ``backend``: 'triton' or 'reference' to fix the backend (a compiled round does), None:
    :func:`dflash_kernels.get_backend`.
    """
    if resolve_backend(backend, parents.device) == "triton":
        if tracing():
            return torch.ops.dflash.walk_tree_device(parents, token_ids, target_choice, max_depth, bits)
        return walk_tree_triton(parents, token_ids, target_choice, max_depth, bits)
    return _device.walk_tree_device(parents, token_ids, target_choice, max_depth, bits)

"""DDTree build and walk on the device (fixed shapes, no host sync) against the C++ ops.

* ``build_tree(on_device=True)`` must equal the C++ heap ``build_tree`` bit for bit
  when scores are distinct (thousands of random drafts, budgets 1, D, 16, 64,
  257, 1024, K = 1 chains, depth 1, ``-inf`` tails, the full 15 x 1024 draft),
  and on ties follow its documented rule: it equals the brute-force
  :func:`dflash_kernels.reference.build_tree_sorted` and is a valid
  best-first tree (parents first, prefix-closed, every selected score >=
  every unselected one, the same score multiset as the heap).
* ``walk_tree_device`` must give the C++ ``walk_tree``'s path and bonus, with
  and without the ancestor bitmask.
* Neither may read a tensor value on the host: a guard makes ``item``,
  ``tolist``, ``__bool__``, ``nonzero``, boolean-mask indexing, ... raise.
"""

import math
import random

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref
from host_reads import no_host_reads
from dflash_kernels.tree_device import TreeTables, _candidate_pairs, _depth_layout, tree_tables


def distinct_draft(depth, k, gen):
    """``[depth, k]`` sorted float32 log-probs, distinct within a row, and distinct ids per row."""
    base = torch.stack([torch.randperm(50 * k + 50, generator=gen)[:k] for _ in range(depth)]).double()
    lp = -(base + 0.4 * torch.rand(depth, k, generator=gen, dtype=torch.float64)) * (6.0 / (50 * k + 50))
    lp = lp.sort(dim=1, descending=True).values.float()
    ids = torch.rand(depth, 4 * k, generator=gen).argsort(dim=1)[:, :k] * 97 + 3
    return lp, ids


def tie_draft(depth, k, gen, levels=(-0.5, -1.0, -1.5, -2.0)):
    lv = torch.tensor(levels)
    lp = lv[torch.randint(0, len(levels), (depth, k), generator=gen)].sort(dim=1, descending=True).values
    ids = torch.rand(depth, 4 * k, generator=gen).argsort(dim=1)[:, :k] * 97 + 3
    return lp, ids


def same(a, b):
    """The same tree: token_ids, depths and parents (the builds' scores are compared where they are tested)."""
    return all(x.dtype == y.dtype == torch.int64 and torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


def build_on_device(*args, **kw):
    """:func:`dflash_kernels.build_tree` on the device backend."""
    return dk.build_tree(*args, on_device=True, **kw)


def node_scores(lp, ids, tree):
    """Float64 path score of nodes 1..N (the C++ arithmetic), from the outputs alone."""
    tokens, depths, parents = tree[:3]
    lp = lp.double()
    score = [0.0]
    for i in range(1, parents.numel()):
        d = int(depths[i - 1])
        rank = int((ids[d - 1] == tokens[i - 1]).int().argmax())
        score.append(score[int(parents[i])] + float(lp[d - 1, rank]))
    return score


def check_best_first(lp, ids, tree, budget):
    """Structure + best-first properties of a tree, independent of any implementation."""
    tokens, depths, parents = tree[:3]
    n = tokens.numel()
    depth_total, k = lp.shape
    assert n == dk.tree_size(depth_total, k, budget)
    assert parents.shape == (n + 1,) and depths.shape == (n,) and int(parents[0]) == -1
    ranks_used = {}
    for i in range(1, n + 1):
        p = int(parents[i])
        assert 0 <= p < i, "a parent precedes its children"
        assert int(depths[i - 1]) == (1 if p == 0 else int(depths[p - 1]) + 1)
        d = int(depths[i - 1])
        rank = int((ids[d - 1] == tokens[i - 1]).int().argmax())
        assert int(ids[d - 1, rank]) == int(tokens[i - 1])
        ranks_used.setdefault(p, set()).add(rank)
    score = node_scores(lp, ids, tree)
    assert all(a >= b for a, b in zip(score[1:], score[2:])), "numbered by non-increasing score"
    # Frontier: the best unselected child of the root and of every selected node.
    frontier = -math.inf
    lp64 = lp.double()
    for p in range(n + 1):
        d = 0 if p == 0 else int(depths[p - 1])
        if d >= depth_total:
            continue
        used = ranks_used.get(p, set())
        assert used == set(range(len(used))), "siblings are a rank prefix (prefix-closed)"
        if len(used) < k:
            frontier = max(frontier, score[p] + float(lp64[d, len(used)]))
    if n:
        assert min(score[1:]) >= frontier, "every selected node scores >= every unselected one"
    return score


# ----------------------------------------------------------------------------
# tree_size and the static candidate set
# ----------------------------------------------------------------------------

def test_tree_size():
    assert dk.tree_size(15, 32, 512) == 512
    assert dk.tree_size(3, 2, 1024) == 2 + 4 + 8
    assert dk.tree_size(15, 1, 1024) == 15
    assert dk.tree_size(0, 5, 10) == 0 and dk.tree_size(4, 0, 10) == 0 and dk.tree_size(4, 3, 0) == 0
    assert dk.tree_size(200, 1024, 7) == 7  # no huge powers computed
    with pytest.raises(ValueError, match="budget must be >= 0"):
        dk.tree_size(3, 2, -1)
    with pytest.raises(TypeError, match="k must be an int"):
        dk.tree_size(3, 2.0, 4)


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (64, 64), (257, 32), (1024, 1024)])
def test_candidate_pairs_are_the_undominated_set(n, k):
    slots, ranks, prefix = _candidate_pairs(n, k, torch.device("cpu"))
    want = [(s, r) for s in range(n) for r in range(k) if (s + 1) * (r + 1) <= n]
    assert list(zip(slots.tolist(), ranks.tolist())) == want
    assert prefix[-1] == len(want) and all(prefix[m] == sum(1 for s, _ in want if s < m) for m in (0, 1, n // 2, n))


def test_tables_passed_in_give_the_same_tree_and_are_checked(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    lp, ids = distinct_draft(7, 16, gen)
    tables = tree_tables(7, 16, 40, lp.device)
    assert isinstance(tables, TreeTables) and (tables.n, tables.k, tables.depth) == (40, 16, 7)
    with no_host_reads(monkeypatch):  # the tables are made with device ops: no host read, no upload
        tree_tables(7, 16, 40, lp.device)
    assert same(build_on_device(lp, ids, 40, tables=tables), build_on_device(lp, ids, 40))
    assert same(build_on_device(lp, ids, 40, tables=tables), dk.build_tree(lp, ids, 40))
    with pytest.raises(ValueError, match="tables are for N=40"):
        build_on_device(lp, ids, 41, tables=tables)
    with pytest.raises(ValueError, match="K=16, D=7"):
        build_on_device(lp[:6], ids[:6], 40, tables=tables)
    with pytest.raises(TypeError, match="TreeTables"):
        build_on_device(lp, ids, 40, tables=tuple(tables))


def test_the_tables_overload_builds_over_the_callers_tables():
    gen = torch.Generator().manual_seed(8)
    lp, ids = distinct_draft(5, 8, gen)
    tables = tree_tables(5, 8, 12, lp.device)
    want = dk.build_tree(lp, ids, 12)
    for backend in ("reference", "triton"):
        assert same(build_on_device(lp, ids, 12, tables=tables, backend=backend), want), backend
    args = (lp, ids, 12, tables.slots, tables.ranks, tables.depth_of, tables.parent_base)
    torch.library.opcheck(torch.ops.dflash.build_tree_device.tables, args)


@pytest.mark.parametrize("n,k,depth", [(1, 1, 1), (14, 2, 3), (15, 1, 15), (1024, 1024, 15), (1024, 32, 15), (100, 3, 6)])
def test_depth_layout_keeps_min_n_k_pow_d(n, k, depth):
    kept, depth_of, parent_base = _depth_layout(n, k, depth, torch.device("cpu"))
    assert list(kept) == [min(n, k ** d) for d in range(1, depth + 1)]
    assert depth_of.tolist() == [d + 1 for d in range(depth) for _ in range(kept[d])]
    starts = [sum(kept[:d]) for d in range(depth)]
    assert parent_base.tolist()[: depth + 1] == [0, 0] + starts[: depth - 1]


# ----------------------------------------------------------------------------
# Build: exact equality with the C++ heap on distinct scores
# ----------------------------------------------------------------------------

def test_build_matches_cpp_on_random_distinct_drafts():
    rng = random.Random(2024)
    gen = torch.Generator().manual_seed(2024)
    for case in range(2000):
        depth = rng.choice([1, 2, 3, 7, 15]) if rng.random() < 0.5 else rng.randint(1, 15)
        k = rng.choice([1, 2, 3, 8, 32, 64]) if rng.random() < 0.5 else rng.randint(1, 64)
        budget = rng.choice([1, depth, 16, 64, 257, 1024, rng.randint(0, 300)])
        lp, ids = distinct_draft(depth, k, gen)
        if rng.random() < 0.3:
            ids = ids.int()
        ours = build_on_device(lp, ids, budget)
        assert same(ours, dk.build_tree(lp, ids, budget)), (case, depth, k, budget)
        if case % 200 == 0:
            check_best_first(lp, ids, ours, budget)


@pytest.mark.parametrize("budget", [1, 15, 16, 64, 257, 1024])
def test_build_matches_cpp_on_the_full_draft(budget):
    # D = 15, K = 1024: the shape the pruned candidate set is for.
    gen = torch.Generator().manual_seed(budget)
    logits = torch.randn(15, 8192, generator=gen) * 3
    top = logits.log_softmax(-1).topk(1024, dim=-1)
    ours = build_on_device(top.values, top.indices, budget)
    assert ours[0].numel() == budget
    assert same(ours, dk.build_tree(top.values, top.indices, budget))


@pytest.mark.parametrize("depth", [1, 4, 15])
def test_build_of_top1_is_the_chain(depth):
    lp, ids = distinct_draft(depth, 1, torch.Generator().manual_seed(depth))
    for budget in (depth, 1024):
        tokens, depths, parents, _ = build_on_device(lp, ids, budget)
        assert tokens.tolist() == ids[:, 0].tolist()
        assert depths.tolist() == list(range(1, depth + 1)) and parents.tolist() == [-1] + list(range(depth))


def test_build_of_depth_one_is_the_top_tokens():
    lp, ids = distinct_draft(1, 40, torch.Generator().manual_seed(3))
    for budget in (1, 7, 40, 64):
        tokens, depths, parents, _ = build_on_device(lp, ids, budget)
        m = min(budget, 40)
        assert tokens.tolist() == ids[0, :m].tolist() and depths.tolist() == [1] * m and parents.tolist() == [-1] + [0] * m


def test_build_budget_zero_and_exhausted_tree():
    lp, ids = distinct_draft(3, 4, torch.Generator().manual_seed(4))
    tokens, depths, parents, _ = build_on_device(lp, ids, 0)
    assert tokens.shape == (0,) and depths.shape == (0,) and parents.tolist() == [-1]
    full = build_on_device(lp, ids, 1000)
    assert full[0].numel() == 4 + 16 + 64 and same(full, dk.build_tree(lp, ids, 1000))
    empty_k = build_on_device(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.int64), 5)
    assert empty_k[0].shape == (0,) and empty_k[2].tolist() == [-1]


def finite_count(lp):
    """Nodes of the full tree with a finite score (all their path's log-probs finite)."""
    total, level = 0, 1
    for row in lp:
        level *= int(torch.isfinite(row).sum())
        total += level
    return total


def test_build_with_neg_inf_tails():
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for case in range(400):
        depth, k = rng.randint(1, 8), rng.randint(1, 12)
        lp, ids = distinct_draft(depth, k, gen)
        if rng.random() < 0.5:  # a fully -inf depth tail
            lp[rng.randint(0, depth - 1):] = -math.inf
        else:  # -inf rank tails per row
            for d in range(depth):
                lp[d, rng.randint(0, k):] = -math.inf
        budget = rng.choice([1, depth, 16, 64, 257, rng.randint(0, 100)])
        ours = build_on_device(lp, ids, budget)
        heap = dk.build_tree(lp, ids, budget)
        f = min(finite_count(lp), budget)
        # The finite-score nodes are distinct: the same nodes, numbered the same.
        assert torch.equal(ours[0][:f], heap[0][:f]) and torch.equal(ours[1][:f], heap[1][:f])
        assert torch.equal(ours[2][: f + 1], heap[2][: f + 1]), case
        if budget <= finite_count(lp):
            assert same(ours, heap)
        elif k ** depth <= 4096:
            # Past them only -inf ties: the stated rule decides.
            assert same(ours, ref.build_tree_sorted(lp, ids, budget))
            check_best_first(lp, ids, ours, budget)


# ----------------------------------------------------------------------------
# Build: ties follow the stated rule
# ----------------------------------------------------------------------------

def test_tie_rule_by_hand():
    # All log-probs equal: order (score desc, depth asc, parent slot asc, rank asc).
    # Depth 1: a=1 (score -1), b=2 (-1); depth 2: a->3, a->4, b->3, b->4 (all -2).
    lp = torch.full((2, 2), -1.0)
    ids = torch.tensor([[1, 2], [3, 4]])
    tokens, depths, parents, _ = build_on_device(lp, ids, 5)
    assert tokens.tolist() == [1, 2, 3, 4, 3] and depths.tolist() == [1, 1, 2, 2, 2]
    assert parents.tolist() == [-1, 0, 0, 1, 1, 2]
    # Zero log-probs: a child ties with its parent, depth asc puts the parent first.
    lp = torch.zeros(3, 2)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    tree = build_on_device(lp, ids, 6)
    assert tree[2].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert same(tree, ref.build_tree_sorted(lp, ids, 6))
    check_best_first(lp, ids, tree, 6)
    # The C++ heap and the Python one follow the same rule: the same tree, ties included.
    assert same(dk.build_tree(lp, ids, 6), tree) and same(ref.build_tree(lp, ids, 6), tree)


def test_ties_follow_the_rule_and_stay_best_first():
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    for case in range(300):
        depth, k = rng.randint(1, 5), rng.randint(1, 6)
        while k ** depth > 3000:
            depth -= 1
        levels = rng.choice([(-0.5, -1.0, -1.5, -2.0), (0.0, -1.0), (0.0,), (-1.0, -math.inf)])
        lp, ids = tie_draft(depth, k, gen, levels)
        budget = rng.choice([1, depth, 16, 64, rng.randint(0, 200)])
        ours = build_on_device(lp, ids, budget)
        assert same(ours, ref.build_tree_sorted(lp, ids, budget)), case
        score = check_best_first(lp, ids, ours, budget)
        assert same(dk.build_tree(lp, ids, budget), ours), case  # the C++ heap: one tie rule
        assert same(ref.build_tree(lp, ids, budget), ours), case


def test_sorted_reference_equals_the_heap_on_distinct_scores():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(100):
        depth, k = rng.randint(1, 4), rng.randint(1, 6)
        lp, ids = distinct_draft(depth, k, gen)
        budget = rng.randint(0, 80)
        assert same(ref.build_tree_sorted(lp, ids, budget), ref.build_tree(lp, ids, budget))


def test_build_input_dtypes_and_strides():
    gen = torch.Generator().manual_seed(9)
    lp, ids = distinct_draft(6, 5, gen)
    want = dk.build_tree(lp, ids, 20)
    for lp_x, ids_x in ((lp.double(), ids), (lp, ids.int()), (lp.t().contiguous().t(), ids.t().contiguous().t())):
        assert same(build_on_device(lp_x, ids_x, 20), want)
    half = lp.bfloat16()
    assert same(build_on_device(half, ids, 20), dk.build_tree(half, ids, 20))


def test_build_errors_are_clear():
    lp, ids = distinct_draft(3, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="2-D"):
        build_on_device(lp[0], ids[0], 4)
    with pytest.raises(ValueError, match="same shape"):
        build_on_device(lp, ids[:, :2], 4)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_on_device(lp, ids, -1)
    with pytest.raises(ValueError, match="int64 or int32"):
        build_on_device(lp, ids.float(), 4)
    with pytest.raises(ValueError, match="floating point"):
        build_on_device(ids, ids, 4)
    with pytest.raises(TypeError, match="budget must be an int"):
        build_on_device(lp, ids, 4.0)


# ----------------------------------------------------------------------------
# Walk
# ----------------------------------------------------------------------------

def walk_both(parents, tokens, choice, max_depth, bits=None):
    """The device walk against the C++ walk; returns (path list, bonus)."""
    accepted, bonus = dk.walk_tree(parents, tokens, choice)
    path, path_len, committed = dk.walk_tree_device(parents, tokens, choice, max_depth, bits=bits)
    width = max_depth + 1
    assert path.shape == (width,) and committed.shape == (width,) and path_len.shape == (1,)
    assert path.dtype == committed.dtype == path_len.dtype == torch.int64
    a = accepted.numel()
    assert int(path_len) == a and path[:a].tolist() == accepted.tolist()
    assert (path[a:] == accepted[-1]).all(), "entries past path_len repeat the last path node"
    assert committed[:a].tolist() == tokens[accepted[1:] - 1].tolist() + [bonus]
    assert (committed[a:] == 0).all()
    return accepted.tolist(), bonus


def hand_tree():
    #        0
    #      /   \
    #   1:10   2:11
    #   /  \      \
    # 3:20 4:21   5:30
    #  |
    # 6:40
    return torch.tensor([-1, 0, 0, 1, 1, 2, 3]), torch.tensor([10, 11, 20, 21, 30, 40])


@pytest.mark.parametrize("use_bits", [False, True])
def test_walk_by_hand(use_bits):
    parents, tokens = hand_tree()
    bits = ref.ancestor_bits(parents) if use_bits else None
    cases = [
        ([10, 20, 0, 40, 0, 0, 99], [0, 1, 3, 6], 99),  # the top-1 chain
        ([11, 20, 30, 40, 0, 7, 0], [0, 2, 5], 7),  # leaves the top-1 chain at the root
        ([10, 21, 0, 40, 5, 0, 0], [0, 1, 4], 5),  # second child at node 1
        ([12, 20, 30, 40, 0, 0, 0], [0], 12),  # rejects everything
    ]
    for choice, path, bonus in cases:
        assert walk_both(parents, tokens, torch.tensor(choice), 3, bits) == (path, bonus)
        assert walk_both(parents, tokens, torch.tensor(choice), 6, bits) == (path, bonus)  # a looser bound


def test_walk_of_root_only_tree():
    parents, tokens, choice = torch.tensor([-1]), torch.zeros(0, dtype=torch.int64), torch.tensor([5])
    for max_depth in (0, 3):
        for bits in (None, ref.ancestor_bits(parents)):
            assert walk_both(parents, tokens, choice, max_depth, bits) == ([0], 5)


def test_walk_duplicate_sibling_tokens_take_the_lowest_child():
    # Nodes 1 and 2 are both children of the root with token 7 (build_tree never does this).
    parents, tokens = torch.tensor([-1, 0, 0, 2, 1]), torch.tensor([7, 7, 8, 9])
    for choice in ([7, 9, 8, 0, 0], [7, 0, 8, 0, 0]):
        for bits in (None, ref.ancestor_bits(parents)):
            walk_both(parents, tokens, torch.tensor(choice), 2, bits)


def test_walk_of_chains():
    for depth in (1, 2, 15, 31, 32, 40):
        parents = torch.tensor([-1] + list(range(depth)))
        tokens = torch.arange(depth) + 100
        for stop in range(0, depth + 1, max(1, depth // 5)):
            choice = torch.cat([tokens[:stop], torch.tensor([-7] * (depth + 1 - stop))])
            for bits in (None, ref.ancestor_bits(parents)):
                assert walk_both(parents, tokens, choice, depth, bits) == (list(range(stop + 1)), -7)


def random_round(rng, gen, max_depth, k, budget, agree=0.8):
    lp, ids = distinct_draft(max_depth, k, gen)
    tokens, _, parents, _ = dk.build_tree(lp, ids, budget)
    n = tokens.numel()
    choice = torch.randint(0, 50_000, (n + 1,), generator=gen)
    kids = [[] for _ in range(n + 1)]
    for c, p in enumerate(parents.tolist()[1:], start=1):
        kids[p].append(c)
    for i in range(n + 1):
        if kids[i] and rng.random() < agree:
            choice[i] = tokens[rng.choice(kids[i]) - 1]  # often not the top-1 child
    return parents, tokens, choice


def test_walk_random_trees_match_cpp():
    rng = random.Random(99)
    gen = torch.Generator().manual_seed(99)
    off_chain = 0
    for case in range(1500):
        max_depth, k = rng.randint(1, 15), rng.randint(1, 8)
        parents, tokens, choice = random_round(rng, gen, max_depth, k, rng.choice([1, max_depth, 16, 64, 100]))
        bits = ref.ancestor_bits(parents) if case % 2 else None
        accepted, _ = walk_both(parents, tokens, choice, max_depth, bits)
        # Left the top-1 chain: some accepted node is not its parent's first (top-1) child.
        first_child = {}
        for c, p in enumerate(parents.tolist()[1:], start=1):
            first_child.setdefault(p, c)
        off_chain += any(first_child[p] != c for p, c in zip(accepted, accepted[1:]))
    assert off_chain > 100


def test_walk_with_the_triton_ancestor_bits():
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for budget in (40, 200):
        parents, tokens, choice = random_round(rng, gen, 15, 8, budget, agree=0.9)
        walk_both(parents, tokens, choice, 15, dk.ancestor_bits(parents))


def test_a_batch_of_walks_is_each_walk_alone():
    """walk_tree_device over ``[b, N+1]`` trees (one call, as a round walks its batch): row ``r`` is bit for bit the
    walk of tree ``r`` alone (the C++ walk's path), with the batch's ancestor bits and without; ``path_len [b]``.
    The trees are prefixes of larger ones (strided views, as a round verifies a bucket's prefix)."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for budget, n in ((64, 64), (64, 20), (8, 8)):
        rounds = [random_round(rng, gen, 7, 4, budget, agree=0.9) for _ in range(3)]
        parents = torch.stack([r[0] for r in rounds])[:, : n + 1]
        tokens = torch.stack([r[1] for r in rounds])[:, :n]
        choice = torch.stack([r[2] for r in rounds])[:, : n + 1]
        for bits in (None, dk.ancestor_bits(parents)):
            path, path_len, committed = dk.walk_tree_device(parents, tokens, choice, 7, bits)
            assert path.shape == committed.shape == (3, 8) and path_len.shape == (3,)
            for r in range(3):
                alone = dk.walk_tree_device(parents[r], tokens[r], choice[r], 7,
                                            None if bits is None else bits[r])
                assert torch.equal(path[r], alone[0]) and torch.equal(path_len[r : r + 1], alone[1])
                assert torch.equal(committed[r], alone[2])
                walk_both(parents[r], tokens[r], choice[r], 7)
    with pytest.raises(ValueError, match=r"token_ids must be 2-D \[b, N\]"):
        dk.walk_tree_device(parents, tokens[0], choice, 7)
    with pytest.raises(ValueError, match="bits must be"):
        dk.walk_tree_device(parents, tokens, choice, 7, dk.ancestor_bits(parents[0]))

def test_walk_int32_inputs():
    parents, tokens = hand_tree()
    choice = torch.tensor([11, 20, 30, 40, 0, 7, 0])
    path, path_len, committed = dk.walk_tree_device(parents.int(), tokens.int(), choice.int(), 3)
    assert path.tolist() == [0, 2, 5, 5] and path_len.tolist() == [3] and committed.tolist() == [11, 30, 7, 0]


def test_walk_errors_are_clear():
    parents, tokens = hand_tree()
    choice = torch.zeros(7, dtype=torch.int64)
    with pytest.raises(ValueError, match="token_ids must be 1-D"):
        dk.walk_tree_device(parents, tokens[:-1], choice, 3)
    with pytest.raises(ValueError, match="target_choice must be 1-D"):
        dk.walk_tree_device(parents, tokens, choice[:-1], 3)
    with pytest.raises(ValueError, match="int64 or int32"):
        dk.walk_tree_device(parents, tokens, choice.float(), 3)
    with pytest.raises(ValueError, match="max_depth must be >= 0"):
        dk.walk_tree_device(parents, tokens, choice, -1)
    with pytest.raises(ValueError, match="bits must be"):
        dk.walk_tree_device(parents, tokens, choice, 3, bits=torch.zeros(7, 2, dtype=torch.int32))


# ----------------------------------------------------------------------------
# No host reads
# ----------------------------------------------------------------------------

def test_the_host_read_guard_catches_reads(monkeypatch):
    x = torch.arange(4)
    with no_host_reads(monkeypatch):
        for read in (lambda: x.tolist(), lambda: x[0].item(), lambda: bool(x[0] > 1), lambda: x.nonzero(),
                     lambda: x[x > 1], lambda: int(x[1])):
            with pytest.raises(AssertionError, match="host read|boolean-mask"):
                read()


def test_build_and_walk_read_no_tensor_values(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    lp, ids = distinct_draft(15, 64, gen)
    build_on_device(lp, ids, 256)
    want_tree = dk.build_tree(lp, ids, 256)
    choice = torch.randint(0, 50_000, (257,), generator=gen)
    choice[0] = want_tree[0][0]
    choice[1] = want_tree[0][int((want_tree[2] == 1).int().argmax()) - 1]
    bits = ref.ancestor_bits(want_tree[2])
    with no_host_reads(monkeypatch):
        tree = build_on_device(lp, ids, 256)
        walks = [dk.walk_tree_device(tree[2], tree[0], choice, 15, bits=b) for b in (None, bits)]
    assert same(tree, want_tree)
    for path, path_len, _ in walks:
        assert path[: int(path_len)].tolist() == dk.walk_tree(tree[2], tree[0], choice)[0].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_has_no_sync():
    gen = torch.Generator().manual_seed(2)
    lp, ids = distinct_draft(15, 1024, gen)
    lp_d, ids_d = lp.cuda(), ids.cuda()
    build_on_device(lp_d, ids_d, 1024)  # warm-up (allocator, kernels)
    choice = torch.randint(0, 50_000, (1025,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree = build_on_device(lp_d, ids_d, 1024)
        bits = dk.ancestor_bits(tree[2])
        walk_bits = dk.walk_tree_device(tree[2], tree[0], choice, 15, bits=bits)
        walk_plain = dk.walk_tree_device(tree[2], tree[0], choice, 15)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t.device.type == "cuda" for t in (*tree, *walk_bits, *walk_plain))
    assert same([t.cpu() for t in tree], dk.build_tree(lp, ids, 1024))
    accepted, bonus = dk.walk_tree(tree[2].cpu(), tree[0].cpu(), choice.cpu())
    for path, path_len, committed in (walk_bits, walk_plain):
        a = int(path_len)
        assert path[:a].cpu().tolist() == accepted.tolist() and int(committed[a - 1]) == bonus


def test_build_and_walk_make_no_host_uploads():
    """No Python value goes up to the device inside the tree ops (``t[i] = True`` is a pageable host-to-device
    copy, which a CUDA graph capture of the round refuses): counted on the CPU as on a GPU."""
    from host_reads import HostReadCounter

    gen = torch.Generator().manual_seed(3)
    lp, ids = distinct_draft(7, 64, gen)
    tables = tree_tables(7, 64, 64, torch.device("cpu"))
    choice = torch.randint(0, 50_000, (65,), generator=gen)
    with HostReadCounter() as counter:
        tree = build_on_device(lp, ids, 64, tables=tables, backend="reference")
    bits = dk.ancestor_bits(tree[2], backend="reference")  # the reference reads on the host; a GPU's kernel does not
    with HostReadCounter() as walks:
        for b in (None, bits):
            dk.walk_tree_device(tree[2], tree[0], choice, 7, b, backend="reference")
    assert counter.reads == [] and walks.reads == []


def test_walk_backends_agree_bit_for_bit():
    """The Triton walk (one program per tree, a descent from the root) and the reference backend's fixed-shape
    torch ops give the same ``(path, path_len, committed)`` on random batches: int32 and int64 inputs, strided
    prefixes of bigger trees, a depth bound below the trees' depth (the path is cut), siblings that share a
    token (only the lowest-numbered matching child counts), and trees of one node."""
    rng = random.Random(17)
    gen = torch.Generator().manual_seed(17)
    for case in range(40):
        depth, k = rng.randint(1, 9), rng.randint(1, 5)
        rounds = [random_round(rng, gen, depth, k, rng.choice([1, 8, 40]), agree=0.95) for _ in range(3)]
        n = min(r[1].numel() for r in rounds)
        n = rng.randint(0, n)
        parents = torch.stack([r[0][: n + 1] for r in rounds])
        tokens = torch.stack([r[1][:n] for r in rounds])
        choice = torch.stack([r[2][: n + 1] for r in rounds])
        if case % 3 == 0 and n > 2:  # a duplicate sibling token: copy a node's token onto a later sibling
            for r in range(3):
                for j in range(2, n + 1):
                    sib = [i for i in range(1, j) if parents[r, i] == parents[r, j]]
                    if sib:
                        tokens[r, j - 1] = tokens[r, sib[0] - 1]
                        break
        if case % 2:
            parents, tokens, choice = parents.int(), tokens.int(), choice.int()
        big = torch.zeros(3, n + 5, dtype=parents.dtype)
        big[:, : n + 1] = parents
        max_depth = rng.choice([depth, max(0, depth - 2), depth + 3])
        want = dk.walk_tree_device(parents, tokens, choice, max_depth, backend="reference")
        got = dk.walk_tree_device(big[:, : n + 1], tokens, choice, max_depth, backend="triton")
        for g, w in zip(got, want):
            assert g.dtype == torch.int64 and torch.equal(g, w), (case, g, w)
        for r in range(3):
            one = dk.walk_tree_device(parents[r], tokens[r], choice[r], max_depth, backend="triton")
            assert torch.equal(one[0], want[0][r]) and torch.equal(one[1], want[1][r:r + 1])
            assert torch.equal(one[2], want[2][r])


def test_the_triton_walk_is_one_launch(monkeypatch):
    """On the Triton backend an eager walk is one kernel launch: the only aten ops it dispatches allocate its
    three outputs (the torch-op walk dispatches dozens of small ops, each a launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    import dflash_kernels.tree as tree_module
    from torch.utils._python_dispatch import _disable_current_modes

    kernel = tree_module._walk_tree_kernel
    launches = []

    class Counted:
        """The kernel, launched with the dispatch mode off (the interpreter's own tensor work is not the
        walk's), each launch recorded."""

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                with _disable_current_modes():
                    return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tree_module, "_walk_tree_kernel", Counted())
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    rounds = [random_round(rng, gen, 7, 4, 64, agree=0.9) for _ in range(2)]
    parents, tokens, choice = (torch.stack([r[i] for r in rounds]) for i in range(3))
    counts = {}
    for backend in ("triton", "reference"):
        with Ops() as ops:
            got = dk.walk_tree_device(parents, tokens, choice, 7, backend=backend)
        counts[backend] = ops.names
    assert launches == [(2,)]
    assert counts["triton"] == ["empty.memory_format"] * 3, counts["triton"]
    assert len(counts["reference"]) > 20
    assert all(torch.equal(g, w) for g, w in zip(got, dk.walk_tree_device(parents, tokens, choice, 7)))

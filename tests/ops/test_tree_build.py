"""DDTree build and walk: the C++ ops against the Python reference (exact equality).

Inputs are drafted the way a DDTree round makes them: per depth, log-probs
sorted best first with their token ids. Ties (repeated log-probs), ``-inf``
log-probs, budget edge cases and exhausted queues are all covered, and the
structural properties of the output are checked independently of the
reference (parents precede children, depths, best-first score order).
"""

import math
import random

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref


def draft(depth, k, gen, ties=False, with_neg_inf=False):
    """Sorted top-K log-probs ``[depth, k]`` and distinct token ids per row."""
    if ties:
        levels = torch.tensor([-0.5, -1.0, -1.5, -2.0])
        lp = levels[torch.randint(0, 4, (depth, k), generator=gen)]
    else:
        lp = -6 * torch.rand(depth, k, generator=gen, dtype=torch.float64)
    if with_neg_inf:
        lp[torch.rand(depth, k, generator=gen) < 0.2] = -math.inf
    lp = lp.sort(dim=1, descending=True).values
    ids = torch.rand(depth, 4 * k, generator=gen).argsort(dim=1)[:, :k] * 97 + 3
    return lp.to(torch.float32), ids


def assert_same_tree(a, b):
    for x, y, name in zip(a, b, ("token_ids", "depths", "parents")):
        assert x.dtype == torch.int64 and y.dtype == torch.int64, name
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def path_scores(lp, ids, tokens, depths, parents):
    """Sum of log-probs along the path of every node, from the outputs alone."""
    score = [0.0]
    for i in range(1, parents.numel()):
        d = int(depths[i - 1])
        rank = (ids[d - 1] == tokens[i - 1]).nonzero()[0, 0]
        score.append(score[int(parents[i])] + float(lp[d - 1, rank]))
    return score


def check_structure(lp, ids, tree, budget):
    tokens, depths, parents = tree[:3]
    n = tokens.numel()
    assert depths.shape == (n,) and parents.shape == (n + 1,)
    assert n <= budget
    assert int(parents[0]) == -1
    for i in range(1, n + 1):
        p = int(parents[i])
        assert 0 <= p < i, "a parent must precede its child"
        assert int(depths[i - 1]) == (1 if p == 0 else int(depths[p - 1]) + 1)
    # Siblings carry distinct tokens (the walk relies on it).
    seen = set()
    for i in range(1, n + 1):
        key = (int(parents[i]), int(tokens[i - 1]))
        assert key not in seen
        seen.add(key)
    # Best first: with log-probs <= 0 and rows sorted, pop scores never rise.
    scores = path_scores(lp.double(), ids, tokens, depths, parents)[1:]
    assert all(a >= b for a, b in zip(scores, scores[1:]))


def test_small_example_by_hand():
    lp = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]))
    ids = torch.tensor([[10, 11, 12], [20, 21, 22]])
    # Scores: a=10 (.6), child 10->20 (.54), b=11 (.3), 11->20 (.27), c=12 (.1)...
    tokens, depths, parents, _ = dk.build_tree(lp, ids, 5)
    assert tokens.tolist() == [10, 20, 11, 20, 12]
    assert depths.tolist() == [1, 2, 1, 2, 1]
    assert parents.tolist() == [-1, 0, 1, 0, 3, 0]


def test_budget_zero_gives_empty_tree():
    lp, ids = draft(5, 4, torch.Generator().manual_seed(0))
    for build in (dk.build_tree, ref.build_tree):
        tokens, depths, parents = build(lp, ids, 0)[:3]
        assert tokens.shape == (0,) and depths.shape == (0,) and parents.tolist() == [-1]


def test_budget_one_is_the_top_token():
    lp, ids = draft(5, 4, torch.Generator().manual_seed(1))
    tokens, depths, parents, _ = dk.build_tree(lp, ids, 1)
    assert tokens.tolist() == [int(ids[0, 0])] and depths.tolist() == [1] and parents.tolist() == [-1, 0]


@pytest.mark.parametrize("depth", [1, 4, 15])
def test_top1_with_budget_depth_is_the_dflash_chain(depth):
    lp, ids = draft(depth, 1, torch.Generator().manual_seed(depth))
    tokens, depths, parents, _ = dk.build_tree(lp, ids, depth)
    assert tokens.tolist() == ids[:, 0].tolist()
    assert depths.tolist() == list(range(1, depth + 1))
    assert parents.tolist() == [-1] + list(range(depth))
    # A larger budget cannot add anything: the queue runs empty.
    assert_same_tree(dk.build_tree(lp, ids, 1024), (tokens, depths, parents))


@pytest.mark.parametrize("depth,k", [(1, 7), (2, 3), (3, 4)])
def test_exhausted_queue_gives_the_full_tree(depth, k):
    lp, ids = draft(depth, k, torch.Generator().manual_seed(7))
    tree = dk.build_tree(lp, ids, 1024)
    assert tree[0].numel() == sum(k**d for d in range(1, depth + 1))
    assert_same_tree(tree, ref.build_tree(lp, ids, 1024))


def test_ties_follow_the_one_rule():
    # Every log-prob zero: every node ties, so the order is (depth asc, parent asc, rank asc): both depth-1
    # nodes, then node 1's two children, then node 2's (insertion order would put node 2's first child
    # before node 1's second: [-1, 0, 0, 1, 2, 1, 3]).
    lp = torch.zeros(3, 2)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    tokens, depths, parents, _ = dk.build_tree(lp, ids, 6)
    assert parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert tokens.tolist() == [1, 2, 3, 4, 3, 4]
    assert depths.tolist() == [1, 1, 2, 2, 2, 2]
    assert_same_tree((tokens, depths, parents), ref.build_tree(lp, ids, 6))
    assert_same_tree((tokens, depths, parents), ref.build_tree_sorted(lp, ids, 6))
    assert_same_tree((tokens, depths, parents), dk.build_tree(lp, ids, 6, on_device=True))


def test_random_inputs_match_reference_exactly():
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    cases = 0
    for _ in range(3000):
        depth = rng.choice([1, 2, 3, 7, 15]) if rng.random() < 0.5 else rng.randint(1, 15)
        k = rng.choice([1, 2, 3, 8, 32, 64]) if rng.random() < 0.5 else rng.randint(1, 64)
        budget = rng.choice([0, 1, 2, depth - 1, depth, 15, 31, 64, 100, 1024])
        lp, ids = draft(depth, k, gen, ties=rng.random() < 0.4, with_neg_inf=rng.random() < 0.15)
        ours = dk.build_tree(lp, ids, budget)
        assert_same_tree(ours, ref.build_tree(lp, ids, budget))
        if cases % 25 == 0:
            check_structure(lp, ids, ours, budget)
        cases += 1
    assert cases == 3000


@pytest.mark.parametrize("seed,ties", [(0, False), (1, True), (2, False)])
def test_large_budget_matches_reference(seed, ties):
    gen = torch.Generator().manual_seed(seed)
    lp, ids = draft(15, 64, gen, ties=ties)
    ours = dk.build_tree(lp, ids, 1024)
    assert ours[0].numel() == 1024
    assert_same_tree(ours, ref.build_tree(lp, ids, 1024))
    check_structure(lp, ids, ours, 1024)


def test_input_dtypes_are_accepted():
    gen = torch.Generator().manual_seed(5)
    lp, ids = draft(6, 5, gen)
    expected = ref.build_tree(lp, ids, 20)
    for lp_x, ids_x in ((lp.double(), ids), (lp, ids.int()), (lp.half().float(), ids)):
        assert_same_tree(dk.build_tree(lp_x, ids_x, 20), ref.build_tree(lp_x, ids_x, 20))
    assert_same_tree(dk.build_tree(lp.t().contiguous().t(), ids, 20), expected)


def test_inputs_are_read_in_place_in_any_layout():
    # The C++ op reads float32/float64 and int64/int32 through their strides
    # (no conversion copies): transposed, sliced and broadcast (stride 0) views.
    gen = torch.Generator().manual_seed(15)
    lp, ids = draft(6, 10, gen)
    wide_lp = torch.cat([lp, lp], dim=1)[:, ::2]
    wide_ids = torch.cat([ids, ids], dim=1)[:, ::2]
    row_lp, row_ids = lp[:1].expand(4, 10), ids[:1].expand(4, 10)
    grad_lp = lp.clone().requires_grad_()
    for lp_x, ids_x in ((wide_lp, wide_ids), (row_lp, row_ids), (row_lp.double(), row_ids.int()), (grad_lp, ids),
                        (lp.t().contiguous().t().double(), ids.t().contiguous().t().int())):
        for budget in (0, 1, 7, 40, 500):
            assert_same_tree(dk.build_tree(lp_x, ids_x, budget), ref.build_tree(lp_x.detach(), ids_x, budget))


def test_signed_zeros_and_neg_inf_tie_like_the_reference():
    # The C++ queue orders 128-bit integer keys made from the float64 scores:
    # -0.0 and +0.0 must be one key (equal as doubles, so the insertion order
    # decides), and -inf sorts below every finite score.
    rng = random.Random(21)
    gen = torch.Generator().manual_seed(21)
    values = torch.tensor([0.0, -0.0, -0.25, -1.0, -math.inf], dtype=torch.float64)
    for _ in range(300):
        depth, k = rng.randint(1, 6), rng.randint(1, 6)
        lp = values[torch.randint(0, 5, (depth, k), generator=gen)].sort(dim=1, descending=True).values
        ids = torch.rand(depth, 4 * k, generator=gen).argsort(dim=1)[:, :k]
        budget = rng.choice([1, depth, 16, 64, rng.randint(0, 200)])
        for lp_x in (lp, lp.float()):
            assert_same_tree(dk.build_tree(lp_x, ids, budget), ref.build_tree(lp_x, ids, budget))


def test_outputs_are_separate_tensors():
    tokens, depths, parents, _ = dk.build_tree(*draft(4, 3, torch.Generator().manual_seed(16)), 10)
    assert tokens.is_contiguous() and depths.is_contiguous() and parents.is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in (tokens, depths, parents)}) == 3
    assert tokens._base is None and depths._base is None and parents._base is None


def test_huge_budget_stops_at_the_full_tree():
    lp, ids = draft(3, 4, torch.Generator().manual_seed(17))
    tree = dk.build_tree(lp, ids, 2**62)
    assert tree[0].numel() == 4 + 16 + 64
    assert_same_tree(tree, ref.build_tree(lp, ids, 2**62))


def test_too_large_a_tree_is_refused():
    # 2**40 - 2 nodes: refused up front instead of running out of memory.
    lp, ids = draft(39, 2, torch.Generator().manual_seed(18))
    with pytest.raises(RuntimeError, match="at most"):
        dk.build_tree(lp, ids, 2**40)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_inputs_are_copied_to_host():
    lp, ids = draft(6, 5, torch.Generator().manual_seed(6))
    out = dk.build_tree(lp.cuda(), ids.cuda(), 20)
    assert all(t.device.type == "cpu" for t in out)
    assert_same_tree(out, ref.build_tree(lp, ids, 20))


def test_build_errors_are_clear():
    lp, ids = draft(3, 4, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="2-D"):
        dk.build_tree(lp[0], ids[0], 4)
    with pytest.raises(RuntimeError, match="shape"):
        dk.build_tree(lp, ids[:, :2], 4)
    with pytest.raises(RuntimeError, match="budget"):
        dk.build_tree(lp, ids, -1)
    with pytest.raises(RuntimeError, match="NaN"):
        bad = lp.clone()
        bad[1, 2] = math.nan
        dk.build_tree(bad, ids, 4)
    with pytest.raises(RuntimeError, match="int64 or int32"):
        dk.build_tree(lp, ids.float(), 4)
    with pytest.raises(TypeError, match="budget"):
        dk.build_tree(lp, ids, 4.0)


# ----------------------------------------------------------------------------
# Walk
# ----------------------------------------------------------------------------

def walk_both(parents, tokens, choice):
    ours = dk.walk_tree(parents, tokens, choice)
    theirs = ref.walk_tree(parents, tokens, choice)
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1], (ours, theirs)
    assert ours[0].dtype == torch.int64 and isinstance(ours[1], int)
    return ours[0].tolist(), ours[1]


def hand_tree():
    #        0
    #      /   \
    #   1:10   2:11
    #   /  \      \
    # 3:20 4:21   5:30
    #  |
    # 6:40
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.tensor([10, 11, 20, 21, 30, 40])
    return parents, tokens


def test_walk_follows_the_top1_chain():
    parents, tokens = hand_tree()
    choice = torch.tensor([10, 20, 0, 40, 0, 0, 99])
    assert walk_both(parents, tokens, choice) == ([0, 1, 3, 6], 99)


def test_walk_leaves_the_top1_chain():
    parents, tokens = hand_tree()
    # The target prefers 11 at the root (not the top-1 draft 10), then 30.
    choice = torch.tensor([11, 20, 30, 40, 0, 7, 0])
    assert walk_both(parents, tokens, choice) == ([0, 2, 5], 7)
    # At node 1 it prefers the second child 21, then stops at a leaf.
    choice = torch.tensor([10, 21, 0, 40, 5, 0, 0])
    assert walk_both(parents, tokens, choice) == ([0, 1, 4], 5)


def test_walk_rejects_everything():
    parents, tokens = hand_tree()
    choice = torch.tensor([12, 20, 30, 40, 0, 0, 0])
    assert walk_both(parents, tokens, choice) == ([0], 12)


def test_walk_of_root_only_tree():
    assert walk_both(torch.tensor([-1]), torch.zeros(0, dtype=torch.int64), torch.tensor([5])) == ([0], 5)


def test_walk_random_trees_match_reference():
    rng = random.Random(99)
    gen = torch.Generator().manual_seed(99)
    for _ in range(300):
        depth, k = rng.randint(1, 8), rng.randint(1, 6)
        lp, ids = draft(depth, k, gen)
        tokens, _, parents, _ = dk.build_tree(lp, ids, rng.randint(0, 60))
        n = tokens.numel()
        # The target agrees with a random child most of the time.
        choice = torch.randint(0, 50_000, (n + 1,), generator=gen)
        kids = [[] for _ in range(n + 1)]
        for c, p in enumerate(parents.tolist()[1:], start=1):
            kids[p].append(c)
        for i in range(n + 1):
            if kids[i] and rng.random() < 0.8:
                choice[i] = tokens[rng.choice(kids[i]) - 1]
        accepted, bonus = walk_both(parents, tokens, choice)
        for a, b in zip(accepted, accepted[1:]):
            assert int(parents[b]) == a and int(tokens[b - 1]) == int(choice[a])
        assert bonus == int(choice[accepted[-1]])


def random_walk_batch(b, n, vocab, gen):
    """``b`` random trees of ``n`` nodes (parents ``[b, n+1]``, tokens ``[b, n]``, choices ``[b, n+1]``) over a small
    vocabulary, so siblings share tokens and walks go deep; and their depth bound ``D``."""
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n + 1)])
                           for _ in range(b)])
    tokens = torch.randint(0, vocab, (b, n), generator=gen)
    choices = torch.randint(0, vocab, (b, n + 1), generator=gen)
    depth = torch.zeros(b, n + 1, dtype=torch.int64)
    for i in range(1, n + 1):
        depth[:, i] = depth.gather(1, parents[:, i : i + 1])[:, 0] + 1
    return parents, tokens, choices, int(depth.max())


def walk_rows_one_by_one(parents, tokens, choices, max_depth):
    """The batched walk as the round computed it before, one C++ walk per row, padded with 0."""
    paths, lens, committed = [], [], []
    for par, tok, choice in zip(parents, tokens, choices):
        accepted, _ = dk.walk_tree(par, tok, choice)
        n = accepted.numel()
        path = torch.zeros(max_depth + 1, dtype=torch.long)
        path[:n] = accepted
        com = torch.zeros(max_depth + 1, dtype=torch.long)
        com[: n - 1] = tok[accepted[1:] - 1]
        com[n - 1 : n] = choice.index_select(0, accepted[-1:])
        paths.append(path), lens.append(torch.tensor(n)), committed.append(com)
    return torch.stack(paths), torch.stack(lens), torch.stack(committed)


@pytest.mark.parametrize("b,n,vocab", [(1, 0, 3), (1, 6, 2), (4, 12, 2), (5, 30, 3), (3, 50, 4)])
def test_batched_walk_is_the_walk_of_each_row(b, n, vocab):
    """``walk_tree(.., max_depth)`` on ``[b, N+1]`` trees: one C++ call, the same padded ``(path, path_len,
    committed)`` as the per-row walks, the reference's too; int32 inputs and one tree (a batch of one) alike."""
    gen = torch.Generator().manual_seed(b * 1000 + n)
    for _ in range(5):
        parents, tokens, choices, depth = random_walk_batch(b, n, vocab, gen)
        for max_depth in (depth, depth + 2):
            want = walk_rows_one_by_one(parents, tokens, choices, max_depth)
            got = dk.walk_tree(parents, tokens, choices, max_depth)
            assert [tuple(t.shape) for t in got] == [(b, max_depth + 1), (b,), (b, max_depth + 1)]
            for g, w in zip(got, want):
                assert g.dtype == torch.int64 and torch.equal(g, w), (g, w)
            for g, w in zip(ref.walk_tree(parents, tokens, choices, max_depth), want):
                assert torch.equal(g, w)
            for g, w in zip(dk.walk_tree(parents.int(), tokens.int(), choices.int(), max_depth), want):
                assert torch.equal(g, w)
            one = dk.walk_tree(parents[0], tokens[0], choices[0], max_depth)
            assert torch.equal(one[0], want[0][0]) and torch.equal(one[1], want[1][:1])
            assert torch.equal(one[2], want[2][0])


def test_batched_walk_errors_are_clear():
    parents, tokens = hand_tree()
    choice = torch.zeros(7, dtype=torch.int64)
    batch = (parents.expand(2, -1), tokens.expand(2, -1), choice.expand(2, -1))
    with pytest.raises(RuntimeError, match="token_ids must be 2-D"):
        dk.walk_tree(batch[0], batch[1][:1], batch[2], 3)
    with pytest.raises(RuntimeError, match="target_choice must be 2-D"):
        dk.walk_tree(batch[0], batch[1], batch[2][:, :-1], 3)
    with pytest.raises(RuntimeError, match=r"parents\[3\] = 3"):
        dk.walk_tree(torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 0, 3, 1, 2, 3]]), *batch[1:], 3)
    with pytest.raises(RuntimeError, match="1-D"):
        dk.walk_tree(*batch)  # the unpadded walk is of one tree
    deep = torch.tensor([10, 20, 0, 0, 0, 0, 0])  # accepts 0 -> 1 -> 3: three nodes
    with pytest.raises(RuntimeError, match="more than max_depth"):
        dk.walk_tree(parents, tokens, deep, 1)
    with pytest.raises(ValueError, match="more than max_depth"):
        ref.walk_tree(parents, tokens, deep, 1)


def test_walk_errors_are_clear():
    parents, tokens = hand_tree()
    choice = torch.zeros(7, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"parents\[0\] must be -1"):
        dk.walk_tree(torch.tensor([0, 0, 0, 1, 1, 2, 3]), tokens, choice)
    with pytest.raises(RuntimeError, match=r"parents\[3\] = 3"):
        dk.walk_tree(torch.tensor([-1, 0, 0, 3, 1, 2, 3]), tokens, choice)
    with pytest.raises(RuntimeError, match="token_ids"):
        dk.walk_tree(parents, tokens[:-1], choice)
    with pytest.raises(RuntimeError, match="target_choice"):
        dk.walk_tree(parents, tokens, choice[:-1])
    with pytest.raises(RuntimeError, match="int64 or int32"):
        dk.walk_tree(parents, tokens, choice.float())


def test_tree_positions():
    lp, ids = draft(4, 3, torch.Generator().manual_seed(8))
    _, depths, _, _ = dk.build_tree(lp, ids, 10)
    positions = dk.tree_positions(depths, 100)
    assert positions.dtype == torch.int64 and positions.tolist() == [100] + (100 + depths).tolist()


def _want_scores(lp, ids, tokens, depths, parents):
    """Each node's float64 path sum of log-probs, recomputed parent by parent from the outputs."""
    rows = lp.double().tolist()
    want = [0.0]
    for i in range(1, tokens.numel() + 1):
        d, t = int(depths[i - 1]), int(tokens[i - 1])
        rank = ids[d - 1].tolist().index(t)
        want.append(want[int(parents[i])] + rows[d - 1][rank])
    return want[1:]


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_scores_are_each_nodes_path_sum(on_device):
    """build_tree's scores: each node's float64 sum of the log-probs along its path (recomputed here parent by
    parent; the device's rounded to fp32), non-increasing in node order (the pop order); the same tree on both
    backends."""
    gen = torch.Generator().manual_seed(7)
    for depth, k, budget in [(1, 3, 2), (7, 8, 64), (15, 32, 200), (4, 2, 30)]:
        lp, ids = draft(depth, k, gen)
        tokens, depths, parents, scores = dk.build_tree(lp, ids, budget, on_device=on_device)
        assert_same_tree((tokens, depths, parents), ref.build_tree(lp, ids, budget))
        want = torch.tensor(_want_scores(lp, ids, tokens, depths, parents), dtype=torch.float64)
        assert scores.dtype == (torch.float32 if on_device else torch.float64) and scores.shape == tokens.shape
        assert torch.equal(scores, want.to(scores.dtype))
        assert all(a >= b for a, b in zip(scores.tolist(), scores.tolist()[1:]))
    with pytest.raises(TypeError, match="budget must be an int"):
        dk.build_tree(lp, ids, 2.0, on_device=on_device)


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_a_batch_is_build_tree_row_by_row(on_device):
    """build_tree of ``[b, D, K]``: row ``r``'s tree and scores bit for bit the build of row ``r`` alone, on both
    backends; float32 / float64 and int32 / int64 inputs, strided views, ties, -inf entries, odd shapes, a tree
    smaller than the budget."""
    gen = torch.Generator().manual_seed(11)
    for b, depth, k, budget, ties, neg_inf in [(1, 15, 64, 64, False, False), (3, 7, 8, 30, True, False),
                                               (2, 4, 2, 100, False, True), (4, 1, 5, 3, False, False),
                                               (2, 3, 3, 39, True, True), (2, 3, 3, 0, False, False)]:
        pairs = [draft(depth, k, gen, ties=ties, with_neg_inf=neg_inf) for _ in range(b)]
        lp = torch.stack([p[0] for p in pairs])
        ids = torch.stack([p[1] for p in pairs])
        if b == 3:
            lp, ids = lp.double(), ids.int()
        if b == 4:  # a strided view of the batch
            lp, ids = torch.cat([lp, lp], 2)[:, :, :k], torch.cat([ids, ids], 2)[:, :, :k]
        n = dk.tree_size(depth, k, budget)
        batch = dk.build_tree(lp, ids, budget, on_device=on_device)
        assert [tuple(t.shape) for t in batch] == [(b, n), (b, n), (b, n + 1), (b, n)]
        for r in range(b):
            one = dk.build_tree(lp[r], ids[r], budget, on_device=on_device)
            assert_same_tree([t[r] for t in batch[:3]], one)
            assert_same_tree(one, ref.build_tree(lp[r], ids[r], budget))
            assert torch.equal(batch[3][r], one[3])


def test_build_tree_bad_batches():
    gen = torch.Generator().manual_seed(2)
    lp, ids = draft(5, 4, gen)
    lp, ids = lp[None].repeat(2, 1, 1), ids[None].repeat(2, 1, 1)
    with pytest.raises(RuntimeError, match=r"3-D \[b, depth, K\]"):
        dk.build_tree(lp[None], ids[None], 12)
    with pytest.raises(RuntimeError, match="shape of top_logprobs"):
        dk.build_tree(lp, ids[:1], 12)
    with pytest.raises(ValueError, match="2-D \\[D, K\\] or 3-D"):
        dk.build_tree(lp[None], ids[None], 12, on_device=True)
    with pytest.raises(ValueError, match="same shape"):
        dk.build_tree(lp, ids[:1], 12, on_device=True)
    with pytest.raises(ValueError, match="tables are the device build's"):
        dk.build_tree(lp, ids, 12, tables=dk.tree_device.tree_tables(5, 4, 12, "cpu"))

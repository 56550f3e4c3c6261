"""DDTree over a DFlash2 candidate selector: the child log-probs and the best-first tree.

* ``selector_child_logprobs`` equals the selector's score, entry by entry, for every (parent, child) pair,
  and its rows along the greedy chain are the selector's own ``log q``;
* ``build_selector_tree_device`` equals the heap ``build_selector_tree`` bit for bit at odd shapes, budgets
  below D, above the full tree, ``k = 1``, ``-inf`` entries and exact ties (one documented rule);
* the tree is best-first (parents first, every selected score >= every unselected one) and its first path is
  the selector's greedy chain;
* the device build reads no tensor value on the host.
"""

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref
from host_reads import no_host_reads


def selector_inputs(D, k, gen, V=40, r=6):
    unary = torch.randn(D, k, generator=gen)
    candidates = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(D)])
    return (unary, candidates, torch.randn(D, r, generator=gen), torch.randn(V, r, generator=gen),
            torch.randn(V, r, generator=gen), torch.randint(0, V, (1,), generator=gen))


def same(a, b):
    """The same tree: token_ids, depths and parents."""
    return all(x.dtype == y.dtype == torch.int64 and torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


def lattice_scores(L, candidates, tree):
    """Float64 path scores of nodes 0..N recomputed from the outputs, and each node's candidate slot."""
    tokens, depths, parents = tree[:3]
    score, slot = [0.0], [0]
    for i in range(1, parents.numel()):
        d, p = int(depths[i - 1]), int(parents[i])
        j = int((candidates[d - 1] == tokens[i - 1]).int().argmax())
        assert int(candidates[d - 1, j]) == int(tokens[i - 1])
        slot.append(j)
        score.append(score[p] + float(L[d - 1, slot[p], j]))
    return score, slot


def full_lattice(L, D, k):
    """Every node's score of the full tree, sorted descending."""
    out, level = [], [(0.0, 0)]
    for d in range(D):
        level = [(s + float(L[d, i, j]), j) for s, i in level for j in range(k)]
        out += [s for s, _ in level]
    return sorted(out, reverse=True)


def test_child_logprobs_are_the_selectors_scores():
    gen = torch.Generator().manual_seed(0)
    unary, cand, proj, pred, succ, anchor = selector_inputs(4, 3, gen)
    L = dk.selector_child_logprobs(unary, cand, proj, pred, succ, anchor)
    assert L.shape == (4, 3, 3) and L.dtype == torch.float64
    for d in range(4):
        for i in range(3):
            prev = anchor[0] if d == 0 else cand[d - 1, i]
            s = unary[d] + (succ[cand[d]] * (pred[prev] * proj[d])).sum(-1)
            torch.testing.assert_close(L[d, i], torch.log_softmax(s.double(), -1), atol=1e-5, rtol=0)


def test_rows_along_the_greedy_chain_are_the_selectors_q():
    gen = torch.Generator().manual_seed(1)
    inputs = selector_inputs(6, 5, gen)
    L = dk.selector_child_logprobs(*inputs)
    tokens, index, q = ref.select_chain(*inputs)
    prev = torch.cat([torch.zeros(1, dtype=torch.long), index[:-1]])
    rows = L[torch.arange(6), prev]
    torch.testing.assert_close(rows.exp().float(), q, atol=1e-6, rtol=1e-5)
    assert torch.equal(rows.argmax(-1), index)


SHAPES = [(1, 1, 1), (1, 5, 3), (3, 1, 2), (3, 1, 9), (2, 3, 50), (5, 3, 2), (5, 3, 4), (4, 4, 37), (7, 2, 255),
          (6, 5, 64), (3, 7, 400), (15, 8, 32), (15, 16, 16), (9, 3, 0)]


@pytest.mark.parametrize("D,k,budget", SHAPES)
def test_device_equals_the_heap(D, k, budget):
    gen = torch.Generator().manual_seed(D * 1000 + k * 10 + budget)
    inputs = selector_inputs(D, k, gen)
    L = dk.selector_child_logprobs(*inputs)
    want = ref.build_selector_tree(L, inputs[1], budget)
    got = dk.build_selector_tree_device(L, inputs[1], budget)
    assert same(got, want)
    n = dk.tree_size(D, k, budget)
    assert got[0].numel() == n and got[2].numel() == n + 1
    assert torch.equal(dk.build_selector_tree_device(L.float(), inputs[1].int(), budget)[2],
                       dk.build_selector_tree_device(L.float(), inputs[1], budget)[2])


@pytest.mark.parametrize("D,k,budget", [(4, 3, 30), (6, 4, 64), (3, 5, 155)])
def test_the_tree_is_best_first(D, k, budget):
    gen = torch.Generator().manual_seed(7)
    inputs = selector_inputs(D, k, gen)
    L = dk.selector_child_logprobs(*inputs)
    tree = dk.build_selector_tree_device(L, inputs[1], budget)
    tokens, depths, parents = tree[:3]
    n = tokens.numel()
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n + 1))
    assert all(depths[i - 1] == (1 if parents[i] == 0 else depths[parents[i] - 1] + 1) for i in range(1, n + 1))
    score, _ = lattice_scores(L, inputs[1], tree)
    assert score[1:] == sorted(score[1:], reverse=True)  # numbered by descending score
    everything = full_lattice(L, D, k)
    assert sorted(score[1:], reverse=True) == everything[:n]  # the n best nodes of the whole lattice


@pytest.mark.parametrize("budget", [1, 3, 5, 12, 40, 1000])
def test_first_path_is_the_greedy_chain(budget):
    gen = torch.Generator().manual_seed(budget)
    inputs = selector_inputs(5, 3, gen)
    chain = ref.select_chain(*inputs)[0]
    tokens, depths, parents, _ = dk.build_selector_tree_device(dk.selector_child_logprobs(*inputs), inputs[1], budget)
    path, node = [], 0
    while True:  # follow the lowest-numbered child
        children = [i for i in range(1, parents.numel()) if parents[i] == node]
        if not children:
            break
        node = children[0]
        path.append(int(tokens[node - 1]))
    assert len(path) >= 1
    assert path == chain[: len(path)].tolist()
    if budget >= dk.tree_size(5, 3, 10**9):
        assert len(path) == 5


def test_k1_is_the_chain():
    gen = torch.Generator().manual_seed(3)
    inputs = selector_inputs(6, 1, gen)
    tokens, depths, parents, _ = dk.build_selector_tree_device(dk.selector_child_logprobs(*inputs), inputs[1], 10)
    assert tokens.tolist() == inputs[1][:, 0].tolist()
    assert depths.tolist() == list(range(1, 7)) and parents.tolist() == list(range(-1, 6))


@pytest.mark.parametrize("b,D,k", [(1, 4, 3), (3, 5, 4), (4, 1, 2), (2, 6, 1)])
def test_child_logprobs_of_a_batch_are_each_rows(b, D, k):
    """``[b, D, k]`` inputs with ``anchor [b]``: one call, each row bit for bit the call for that sequence alone
    (int32 candidates, fp32 and bf16 scores alike)."""
    gen = torch.Generator().manual_seed(b * 100 + D * 10 + k)
    rows = [selector_inputs(D, k, gen) for _ in range(b)]
    pred, succ = rows[0][3], rows[0][4]
    for dtype in (torch.float32, torch.bfloat16):
        unary = torch.stack([x[0] for x in rows]).to(dtype)
        cand = torch.stack([x[1] for x in rows]).int()
        proj = torch.stack([x[2] for x in rows]).to(dtype)
        anchor = torch.cat([x[5] for x in rows])
        L = dk.selector_child_logprobs(unary, cand, proj, pred, succ, anchor)
        assert L.shape == (b, D, k, k) and L.dtype == torch.float64
        for r in range(b):
            one = dk.selector_child_logprobs(unary[r], cand[r], proj[r], pred, succ, anchor[r : r + 1])
            assert torch.equal(L[r], one)
            assert torch.equal(one, dk.selector_child_logprobs(unary[r], cand[r], proj[r], pred, succ, anchor[r]))


def test_scores_and_a_batch():
    """The build's scores are each node's float64 path sum (recomputed parent by parent) rounded to fp32; a batch
    ``[b, D, k, k]`` builds each row's tree and scores bit for bit as that row alone."""
    gen = torch.Generator().manual_seed(3)
    rows = [selector_inputs(4, 3, gen) for _ in range(3)]
    L = torch.stack([dk.selector_child_logprobs(*x) for x in rows])
    cand = torch.stack([x[1] for x in rows])
    batch = dk.build_selector_tree_device(L, cand, 30)
    assert [tuple(t.shape) for t in batch] == [(3, 30), (3, 30), (3, 31), (3, 30)] and batch[3].dtype == torch.float32
    for r in range(3):
        one = dk.build_selector_tree_device(L[r], cand[r], 30)
        assert same([t[r] for t in batch], one) and torch.equal(batch[3][r], one[3])
        assert same(one, ref.build_selector_tree(L[r], cand[r], 30))
        score, _ = lattice_scores(L[r], cand[r], one)
        assert torch.equal(one[3], torch.tensor(score[1:], dtype=torch.float64).float())
    with pytest.raises(ValueError, match=r"\[b, D, k, k\] = \[3, 4, 3, 3\]"):
        dk.build_selector_tree_device(L[:, :, :2], cand, 30)

def test_ties_by_hand():
    # depth 1: both root children tie; depth 2: every entry ties. Order (score desc, depth asc, parent's slot
    # asc, j asc): 1 = (d1, j0), 2 = (d1, j1), then node 1's children j0, j1, then node 2's.
    L = torch.full((2, 2, 2), -0.6931471805599453, dtype=torch.float64)
    cand = torch.tensor([[10, 11], [20, 21]])
    for build in (ref.build_selector_tree, dk.build_selector_tree_device):
        tokens, depths, parents = build(L, cand, 6)[:3]
        assert tokens.tolist() == [10, 11, 20, 21, 20, 21]
        assert depths.tolist() == [1, 1, 2, 2, 2, 2]
        assert parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    # at the budget boundary the tie goes to the lower parent slot, then the lower j
    assert dk.build_selector_tree_device(L, cand, 3)[0].tolist() == [10, 11, 20]


@pytest.mark.parametrize("D,k,budget", [(4, 3, 20), (5, 4, 60), (6, 2, 17)])
def test_exact_ties_follow_the_heap(D, k, budget):
    gen = torch.Generator().manual_seed(D + k)
    levels = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64))
    L = levels[torch.randint(0, 4, (D, k, k), generator=gen)]
    if k > 2:
        L[:, :, -1] = float("-inf")  # -inf ties too
    cand = torch.stack([torch.randperm(30, generator=gen)[:k] for _ in range(D)])
    assert same(dk.build_selector_tree_device(L, cand, budget), ref.build_selector_tree(L, cand, budget))


def test_errors_are_clear():
    cand = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[D, k, k\] = \[3, 2, 2\]"):
        dk.build_selector_tree_device(torch.zeros(3, 2), cand, 4)
    with pytest.raises(ValueError, match="floating point"):
        dk.build_selector_tree_device(torch.zeros(3, 2, 2, dtype=torch.long), cand, 4)
    with pytest.raises(ValueError, match="int64 or int32"):
        dk.build_selector_tree_device(torch.zeros(3, 2, 2), cand.float(), 4)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        dk.build_selector_tree_device(torch.zeros(3, 2, 2), cand, -1)
    with pytest.raises(ValueError, match="NaN"):
        ref.build_selector_tree(torch.full((3, 2, 2), float("nan")), cand, 4)
    gen = torch.Generator().manual_seed(0)
    unary, c, proj, pred, succ, anchor = selector_inputs(3, 2, gen)
    with pytest.raises(ValueError, match=r"anchor must be \[2\]"):
        dk.selector_child_logprobs(unary[None].expand(2, -1, -1), c[None].expand(2, -1, -1),
                                   proj[None].expand(2, -1, -1), pred, succ, anchor)


def test_the_device_build_reads_no_tensor_values(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    inputs = selector_inputs(15, 16, gen, V=100)
    want = ref.build_selector_tree(dk.selector_child_logprobs(*inputs), inputs[1], 32)
    with no_host_reads(monkeypatch):
        L = dk.selector_child_logprobs(*inputs)
        got = dk.build_selector_tree_device(L, inputs[1], 32)
    assert same(got, want)


def test_compiled_build_equals_eager():
    gen = torch.Generator().manual_seed(9)
    inputs = selector_inputs(5, 4, gen)

    def build(*a):
        return dk.build_selector_tree_device(dk.selector_child_logprobs(*a), a[1], 12, backend="reference")

    got = torch.compile(build, fullgraph=True, backend="eager")(*inputs)
    assert same(got, build(*inputs))

"""Ancestor bitmask kernel and dense tree mask against their references.

The Triton paths run under the interpreter on CPU (see conftest.py). Word
boundaries (31, 32, 33, 64, 65 nodes) and deep chains are the risky shapes.
"""

import random

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref
from dflash_kernels.tree import ancestor_bits_triton
from dflash_kernels.tree_attention import tree_attention_mask, tree_attention_mask_triton

# The Triton launchers need CUDA tensors on a GPU machine, CPU ones under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_parents(n_nodes, rng, shape="random"):
    """``[n_nodes]`` parents with ``parents[i] < i``.

    Shapes: ``random`` (uniform earlier parent), ``chain``, ``star``, and
    ``deep`` (DDTree-like: depth up to 15, parents mostly among recent nodes,
    so ancestors spread over many bitmask words).
    """
    parents, depth = [-1], [0]
    for i in range(1, n_nodes):
        if shape == "chain":
            p = i - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":
            p = rng.randint(max(0, i - 40), i - 1)
            while depth[p] >= 15:
                p = parents[p]
        else:
            p = rng.randint(0, i - 1)
        parents.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(parents, dtype=torch.int64, device=DEVICE)


def bits_by_definition(parents):
    """Independent check: set bit j of row i for every node on i's path to the root."""
    parents = parents.cpu()
    n = parents.numel()
    out = torch.zeros(n, (n + 31) // 32, dtype=torch.int64)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j // 32] |= 1 << (j % 32)
            j = int(parents[j])
    return out.to(torch.int32)  # wraps bit 31 into the sign, as int32 storage does


@pytest.mark.parametrize("n_nodes", [1, 2, 17, 31, 32, 33, 64, 65, 257, 1025])
def test_kernel_matches_reference(n_nodes):
    rng = random.Random(n_nodes)
    shapes = ["random", "chain", "deep"] if n_nodes <= 65 else ["random", "deep"]
    for shape in shapes:
        parents = random_parents(n_nodes, rng, shape)
        expected = ref.ancestor_bits(parents)
        got = ancestor_bits_triton(parents)
        assert got.dtype == torch.int32 and got.shape == (n_nodes, (n_nodes + 31) // 32)
        assert torch.equal(got, expected), shape
    assert torch.equal(dk.ancestor_bits(parents), expected)  # the public op dispatches to the same path


@pytest.mark.parametrize("n_nodes", [1, 33, 70])
def test_reference_matches_the_definition(n_nodes):
    rng = random.Random(3)
    for shape in ("random", "chain", "star", "deep"):
        parents = random_parents(n_nodes, rng, shape)
        assert torch.equal(ref.ancestor_bits(parents).cpu(), bits_by_definition(parents))


def test_bits_of_a_built_tree():
    gen = torch.Generator().manual_seed(0)
    lp = (-3 * torch.rand(15, 8, generator=gen)).sort(dim=1, descending=True).values
    ids = torch.arange(15 * 8).view(15, 8)
    _, depths, parents, _ = dk.build_tree(lp, ids, 200)
    parents = parents.to(DEVICE)
    bits = ancestor_bits_triton(parents)
    assert torch.equal(bits, ref.ancestor_bits(parents))
    bits, depths = bits.cpu(), depths.cpu()
    # Each row holds depth + 1 bits (itself and every ancestor, root included).
    counts = [bin(int(w) & 0xFFFFFFFF).count("1") for w in bits.flatten()]
    per_row = torch.tensor(counts).view(bits.shape).sum(1)
    assert per_row.tolist() == [1] + (depths + 1).tolist()


@pytest.mark.parametrize("n_nodes", [1, 33, 100])
def test_a_batch_is_each_tree_alone(n_nodes):
    """``[b, N+1]`` parents: one launch (the trees on grid dim 2), each tree's bits those of the tree alone; the
    references (row-copy loop, pointer doubling) take the batch too; int32 parents and a strided view of a batch
    (as a round's prefix of its trees)."""
    rng = random.Random(n_nodes + 7)
    trees = torch.stack([random_parents(n_nodes, rng, shape) for shape in ("random", "chain", "star", "deep")])
    want = torch.stack([bits_by_definition(p) for p in trees])
    assert torch.equal(ancestor_bits_triton(trees).cpu(), want)
    assert torch.equal(ancestor_bits_triton(trees.int()).cpu(), want)
    assert torch.equal(ancestor_bits_triton(torch.cat([trees, trees], 1)[:, :n_nodes]).cpu(), want)
    assert torch.equal(ref.ancestor_bits(trees).cpu(), want)
    assert torch.equal(ref.ancestor_bits_doubling(trees).cpu(), want)
    with dk.force_backend("reference"):
        assert torch.equal(dk.ancestor_bits(trees, check=False).cpu(), want)
    assert ancestor_bits_triton(trees[:0]).shape == (0, n_nodes, (n_nodes + 31) // 32)

def test_int32_parents():
    parents = random_parents(40, random.Random(1))
    assert torch.equal(ancestor_bits_triton(parents.int()), ref.ancestor_bits(parents))


def test_errors_are_clear():
    with pytest.raises(ValueError, match="1-D"):
        dk.ancestor_bits(torch.zeros(2, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D"):
        dk.ancestor_bits(torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64 or int32"):
        dk.ancestor_bits(torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match=r"parents\[2\] = 2"):
        ref.ancestor_bits(torch.tensor([-1, 0, 2]))


def test_malformed_parents_do_not_hang_the_kernel():
    # parents[2] = 2 is a self loop: the kernel must stop (treating it as a chain end).
    bits = ancestor_bits_triton(torch.tensor([-1, 0, 2, 1], device=DEVICE))
    assert bits.shape == (4, 1)


# ----------------------------------------------------------------------------
# Dense mask
# ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "n_nodes,prefix_len,dtype",
    [(n, p, dt) for n, p in [(1, 0), (17, 5), (33, 0), (65, 300)] for dt in (torch.float32, torch.bfloat16, torch.float16)]
    + [(257, 1, torch.float32)],
)
def test_dense_mask_matches_reference(n_nodes, prefix_len, dtype):
    parents = random_parents(n_nodes, random.Random(n_nodes + prefix_len))
    bits = ref.ancestor_bits(parents)
    expected = ref.tree_attention_mask(bits, prefix_len, dtype)
    got = tree_attention_mask_triton(bits, prefix_len, dtype)
    assert got.dtype == dtype and got.shape == (n_nodes, prefix_len + n_nodes)
    assert torch.equal(got, expected)
    assert torch.equal(tree_attention_mask(bits, prefix_len, dtype), expected)


def test_dense_mask_semantics():
    parents = torch.tensor([-1, 0, 0, 1], device=DEVICE)
    mask = ref.tree_attention_mask(ref.ancestor_bits(parents), 2, torch.float32)
    hidden = torch.finfo(torch.float32).min
    visible = (mask == 0).int().tolist()
    assert visible == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]
    assert set(mask.unique().tolist()) == {0.0, hidden}
    assert torch.equal(tree_attention_mask(ref.ancestor_bits(parents), 2, torch.float32), mask)
    # Softmax over the finite mask never produces NaN.
    assert torch.isfinite(torch.softmax(mask + torch.randn_like(mask), dim=-1)).all()


def test_dense_mask_errors():
    bits = ref.ancestor_bits(torch.tensor([-1, 0], device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        tree_attention_mask(bits, 0, torch.int32)
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention_mask(bits, -1, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        tree_attention_mask(bits.long(), 0, torch.float32)


@pytest.mark.parametrize("n_nodes", [1, 2, 31, 32, 33, 65, 257, 1025])
def test_doubling_reference_equals_the_loop(n_nodes):
    """The host-read-free reference (pointer doubling, used by the decode loop) == the row-copy loop."""
    gen = torch.Generator().manual_seed(n_nodes)
    for chain in (False, True):
        if chain:
            parents = torch.arange(-1, n_nodes - 1)
        else:
            parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n_nodes)])
        assert torch.equal(ref.ancestor_bits_doubling(parents), ref.ancestor_bits(parents))
        with dk.force_backend("reference"):
            assert torch.equal(dk.ancestor_bits(parents, check=False), ref.ancestor_bits(parents))

"""The bitonic top-R networks of ``dflash_kernels._bitonic`` against ``torch.topk``, in one Triton program.

Random int64 keys over the whole range (the extremes included, so the pair sums that give each key its
partner wrap around), rows full of duplicates, sizes from one key (R = 1) to a whole row (R = T), and a
running set that a tile beats in part, wholly or not at all.
"""

import pytest
import torch
import triton
import triton.language as tl

from dflash_kernels._bitonic import _log2, merge_top, top_desc

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOWEST, HIGHEST = -2 ** 63, 2 ** 63 - 1


@triton.jit
def _top_kernel(x_ptr, run_ptr, top_ptr, merged_ptr, M: tl.constexpr, T: tl.constexpr, R: tl.constexpr):
    rows = tl.arange(0, M)[:, None]
    x = tl.load(x_ptr + rows * T + tl.arange(0, T)[None, :])
    run = tl.load(run_ptr + rows * R + tl.arange(0, R)[None, :])
    best = top_desc(x, R)
    tl.store(top_ptr + rows * R + tl.arange(0, R)[None, :], best)
    tl.store(merged_ptr + rows * R + tl.arange(0, R)[None, :], merge_top(run, best))


def run_networks(x, run):
    M, T = x.shape
    R = run.shape[1]
    top = torch.empty(M, R, dtype=torch.int64, device=DEVICE)
    merged = torch.empty_like(top)
    _top_kernel[(1,)](x.to(DEVICE), run.to(DEVICE), top, merged, M, T, R)
    return top.cpu(), merged.cpu()


def random_keys(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(LOWEST, HIGHEST, shape, generator=g)


@pytest.mark.parametrize("M,T,R", [(16, 128, 64), (64, 128, 64), (16, 64, 64), (16, 1024, 8), (4, 8, 1),
                                   (2, 16, 16), (2, 4, 2), (16, 256, 128)])
def test_top_and_merge_match_topk(M, T, R):
    x = random_keys((M, T), M * T + R)
    x[:, ::3] = x[:, :1]  # a key repeated across the row
    x[0, :2] = torch.tensor([LOWEST, HIGHEST])
    run = random_keys((M, R), 7 * R).sort(dim=1).values
    top, merged = run_networks(x, run)
    assert torch.equal(top, x.topk(R, dim=1).values)
    assert torch.equal(merged, torch.cat([x, run], dim=1).topk(R, dim=1).values.flip(1))


@pytest.mark.parametrize("case", ["tile wins all", "run wins all", "equal keys"])
def test_merge_extremes(case):
    M, T, R = 16, 64, 16
    x = random_keys((M, T), 3)
    if case == "tile wins all":
        run = torch.full((M, R), LOWEST)
    elif case == "run wins all":
        run = torch.full((M, R), HIGHEST)
    else:
        x = torch.full((M, T), 5)
        run = torch.full((M, R), 5)
    run = run.sort(dim=1).values
    top, merged = run_networks(x, run)
    assert torch.equal(top, x.topk(R, dim=1).values)
    assert torch.equal(merged, torch.cat([x, run], dim=1).topk(R, dim=1).values.flip(1))


def test_sizes_must_be_powers_of_two():
    assert [_log2(n) for n in (1, 2, 64, 128)] == [0, 1, 6, 7]
    for n in (0, 12, 96):
        with pytest.raises(ValueError, match=f"bitonic stages need power-of-two sizes, got {n}"):
            _log2(n)

"""Tree attention kernel against SDPA with the dense ancestor mask.

The kernel runs under the Triton interpreter here, so heads and head dims stay
small (Hq=4, Hkv=2, D=16/32); the sweep over prefix lengths x tree sizes uses
every combination for small sizes and a diagonal for the big ones. Key/value
come from a ``[L, 2, Hkv, Smax, D]`` cache as strided views, as the model
layer passes them.
"""

import random

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import reference as ref
from dflash_kernels.tree_attention import (
    tree_attention_config,
    tree_attention_configs,
    tree_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# dtype -> (atol, rtol) against the float32 reference. bf16/fp16 cover the
# rounding of the output (1 ulp, the interpreter truncates) and of the
# probabilities fed to the second matmul on a GPU.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


def random_tree_bits(n_tree, seed):
    """Ancestor bits of a DDTree-like random tree of ``n_tree`` tokens (depth <= 15)."""
    rng = random.Random(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_tree):
        p = rng.randint(max(0, i - 24), i - 1)
        while depth[p] >= 15:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    return dk.ancestor_bits(torch.tensor(parents, dtype=torch.int64, device=DEVICE))


def make_inputs(hq, hkv, n_tree, prefix_len, head_dim, dtype, seed, smax_extra=7, layers=2):
    """Query ``[Hq, T, D]`` (a transposed view) and key/value views into a cache."""
    gen = torch.Generator().manual_seed(seed)
    s = prefix_len + n_tree
    q = torch.randn(n_tree, hq, head_dim, generator=gen).to(DEVICE, dtype).transpose(0, 1)
    cache = torch.randn(layers, 2, hkv, s + smax_extra, head_dim, generator=gen).to(DEVICE, dtype)
    layer = layers - 1
    return q, cache[layer, 0, :, :s], cache[layer, 1, :, :s]


def check(out, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


SWEEP = [(p, t) for p in (0, 1, 100, 1000) for t in (1, 17, 64, 257)]


@pytest.mark.parametrize("prefix_len,n_tree", SWEEP)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa_with_dense_mask(prefix_len, n_tree, dtype):
    big = prefix_len >= 1000 or n_tree >= 257
    hq, hkv, d = (4, 2, 16) if big else (4, 2, 32)
    q, k, v = make_inputs(hq, hkv, n_tree, prefix_len, d, dtype, seed=prefix_len * 7 + n_tree)
    bits = random_tree_bits(n_tree, n_tree)
    assert not k.is_contiguous()
    expected = ref.tree_attention(q, k, v, bits, prefix_len)
    check(dk.tree_attention(q, k, v, bits, prefix_len), expected, dtype)


def test_largest_tree():
    q, k, v = make_inputs(2, 1, 1024, 3, 16, torch.float32, seed=1024)
    bits = random_tree_bits(1024, 1024)
    check(dk.tree_attention(q, k, v, bits, 3), ref.tree_attention(q, k, v, bits, 3), torch.float32)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 3), (4, 1)])
def test_gqa_and_plain_heads(hq, hkv):
    q, k, v = make_inputs(hq, hkv, 33, 40, 16, torch.float32, seed=hq * 10 + hkv)
    bits = random_tree_bits(33, 5)
    check(dk.tree_attention(q, k, v, bits, 40), ref.tree_attention(q, k, v, bits, 40), torch.float32)


def test_each_query_head_reads_its_own_kv_head():
    # Only kv head 1 has non-zero values: query heads 2, 3 (group 2) must see
    # them, query heads 0, 1 must output zeros.
    q, k, v = make_inputs(4, 2, 9, 5, 16, torch.float32, seed=1)
    v = v.clone()
    v[0].zero_()
    out = dk.tree_attention(q, k, v, random_tree_bits(9, 1), 5)
    assert out[:2].abs().max() == 0 and out[2:].abs().min() > 0


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("prefix_len,n_tree", [(0, 17), (100, 40), (150, 1)])
def test_key_splits_merge_exactly(num_splits, prefix_len, n_tree):
    q, k, v = make_inputs(4, 2, n_tree, prefix_len, 16, torch.float32, seed=num_splits)
    bits = random_tree_bits(n_tree, num_splits)
    expected = ref.tree_attention(q, k, v, bits, prefix_len)
    check(tree_attention_triton(q, k, v, bits, prefix_len, num_splits=num_splits), expected, torch.float32)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_query_tile_size(block_m):
    cfg = next(c for c in tree_attention_configs(32, torch.bfloat16) if c["BLOCK_M"] == block_m)
    q, k, v = make_inputs(2, 1, 50, 30, 32, torch.bfloat16, seed=block_m)
    bits = random_tree_bits(50, block_m)
    expected = ref.tree_attention(q, k, v, bits, 30)
    check(tree_attention_triton(q, k, v, bits, 30, config=cfg), expected, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 80, 128])
def test_head_dims(head_dim):
    q, k, v = make_inputs(2, 1, 20, 10, head_dim, torch.float32, seed=head_dim)
    bits = random_tree_bits(20, head_dim)
    check(dk.tree_attention(q, k, v, bits, 10), ref.tree_attention(q, k, v, bits, 10), torch.float32)


def test_fp16_and_batched_rank_and_scale():
    q, k, v = make_inputs(4, 2, 17, 20, 16, torch.float16, seed=3)
    bits = random_tree_bits(17, 3)
    out = dk.tree_attention(q[None], k[None], v[None], bits, 20, scale=0.3)
    assert out.shape == (1, 4, 17, 16)
    check(out, ref.tree_attention(q[None], k[None], v[None], bits, 20, scale=0.3), torch.float16)


def test_ancestor_only_visibility():
    # Chain 0 <- 1 and a sibling 2 of node 1. Query 2 must ignore key 1 even
    # if key 1 is hugely attractive; query 1 must attend to it.
    parents = torch.tensor([-1, 0, 0], device=DEVICE)
    bits = dk.ancestor_bits(parents)
    q = torch.ones(1, 3, 16, device=DEVICE)
    k = torch.zeros(1, 3, 16, device=DEVICE)
    k[0, 1] = 10.0
    v = torch.zeros(1, 3, 16, device=DEVICE)
    v[0, 1] = 1.0
    out = dk.tree_attention(q, k, v, bits, 0)
    assert out[0, 1].min() > 0.99
    assert out[0, 2].abs().max() == 0 and out[0, 0].abs().max() == 0


def test_launcher_picks_small_query_tiles_for_small_trees():
    assert tree_attention_config(128, torch.bfloat16, 1)["BLOCK_M"] == 16
    assert tree_attention_config(128, torch.bfloat16, 30)["BLOCK_M"] == 32
    assert tree_attention_config(128, torch.bfloat16, 300)["BLOCK_M"] == 64
    for cfg in tree_attention_configs(256, torch.float32):
        assert cfg["BLOCK_D"] == 256 and cfg["BLOCK_N"] >= 16


def test_errors_are_clear():
    q, k, v = make_inputs(4, 2, 5, 3, 16, torch.float32, seed=0)
    bits = random_tree_bits(5, 0)
    with pytest.raises(ValueError, match="prefix_len"):
        dk.tree_attention(q, k, v, bits, 2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        dk.tree_attention(q[:3], k, v, bits, 3)
    with pytest.raises(ValueError, match="one dtype"):
        dk.tree_attention(q.half(), k, v, bits, 3)
    with pytest.raises(ValueError, match="head dim"):
        dk.tree_attention(q[..., :8], k, v, bits, 3)
    with pytest.raises(ValueError, match="bits must be"):
        dk.tree_attention(q, k, v, bits[:4], 3)
    with pytest.raises(ValueError, match="int32"):
        dk.tree_attention(q, k, v, bits.long(), 3)
    with pytest.raises(ValueError, match="batch size 1"):
        dk.tree_attention(torch.stack([q, q]), k, v, bits, 3)
    with pytest.raises(ValueError, match="value shape"):
        dk.tree_attention(q, k, v[:1], bits, 3)

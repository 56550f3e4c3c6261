"""Benchmark: tree attention over the packed bitmask vs SDPA with a dense mask.

Run: ``python -m pytest bench/bench_tree_attention.py --benchmark-columns=median,rounds``

Providers, at equal inputs (bf16 K/V as strided views of a ``[L, 2, Hkv, Smax, D]``
cache, the tree's ancestor bits already built):

* ``tree_attention``: :func:`dflash_kernels.tree_attention` (Triton).
* ``sdpa_dense_mask``: :func:`dflash_kernels.tree_attention_mask` builds the
  ``[T, prefix + T]`` additive mask (its torch reference on a CPU), then
  ``torch.nn.functional.scaled_dot_product_attention`` (GQA via
  ``enable_gqa``), as an attention backend without a tree kernel must do.

With CUDA: Hq 32, Hkv 8, D 128, prefix 1000-8000, tree 64-1024 tokens, and the
peak extra GPU memory of each provider in ``extra_info["peak_extra_mib"]``.
Without CUDA: one small shape, and the Triton kernel runs under the
interpreter (a correctness tool, not a speed path: one round only); the dense
mask's size is recorded for both so the memory argument stays visible.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash_kernels import reference as ref  # noqa: E402
from dflash_kernels._dispatch import triton_interpreting  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    HQ, HKV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
    SHAPES = [(p, t) for p in (1000, 4000, 8000) for t in (64, 256, 1024)]
else:
    HQ, HKV, HEAD_DIM, DTYPE = 4, 2, 64, torch.bfloat16
    SHAPES = [(256, 64)]


def tree_bits(n_tree, seed=0):
    """Ancestor bits of a DDTree-like tree (depth <= 15) on the bench device."""
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_tree):
        p = int(torch.randint(max(0, i - 32), i, (1,), generator=gen))
        while depth[p] >= 15:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    return dk.ancestor_bits(torch.tensor(parents, dtype=torch.int64, device=DEVICE))


def inputs(prefix_len, n_tree):
    s = prefix_len + n_tree
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, HQ, n_tree, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    cache = torch.randn(2, 2, HKV, s + 64, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    return q, cache[1, 0, :, :s][None], cache[1, 1, :, :s][None], tree_bits(n_tree)


def sdpa_dense_mask(q, k, v, bits, prefix_len):
    # On a GPU the mask comes from the Triton builder; on a CPU from the torch
    # reference (the interpreted kernel would dominate the timing).
    build = dk.tree_attention_mask if CUDA else ref.tree_attention_mask
    mask = build(bits, prefix_len, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)


def run_provider(benchmark, fn, args, slow):
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def call():
            out = fn(*args)
            torch.cuda.synchronize()
            return out

        out = benchmark(call)
        benchmark.extra_info["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 2)
        return out
    if slow:
        return benchmark.pedantic(fn, args=args, rounds=1, iterations=1)
    return benchmark(fn, *args)


@pytest.mark.parametrize("prefix_len,n_tree", SHAPES)
@pytest.mark.parametrize("provider", ["tree_attention", "sdpa_dense_mask"])
def test_tree_attention(benchmark, provider, prefix_len, n_tree):
    q, k, v, bits = inputs(prefix_len, n_tree)
    benchmark.group = f"tree_attention prefix={prefix_len} T={n_tree}"
    benchmark.extra_info.update(
        hq=HQ, hkv=HKV, head_dim=HEAD_DIM, dtype=str(DTYPE), device=DEVICE,
        dense_mask_mib=round(n_tree * (prefix_len + n_tree) * q.element_size() / 2**20, 3),
    )
    if provider == "tree_attention":
        out = run_provider(benchmark, dk.tree_attention, (q, k, v, bits, prefix_len), slow=triton_interpreting())
    else:
        out = run_provider(benchmark, sdpa_dense_mask, (q, k, v, bits, prefix_len), slow=False)
    assert out.shape == q.shape

"""Benchmark: tree attention (packed bits / causal chain / sliding window) vs SDPA with a dense mask.

Run: ``python -m pytest bench/bench_tree_attention.py --benchmark-columns=median,rounds``

Shapes at Qwen3-8B (Hq 32, Hkv 8, D 128, bf16 K/V as strided views of a
``[L, 2, Hkv, Smax, D]`` cache): prefixes 1k / 4k / 8k, T = 16 (a DFlash
block), 65 (a DDTree budget of 64), 257 and 1025 (big trees, prefill chunks).
Providers, at equal inputs (the tree's ancestor bits already built):

* ``tree_attention``: :func:`dflash_kernels.tree_attention` (Triton on a GPU;
  on a CPU the pure-torch reference, since the interpreter is no speed path).
  Modes: ``tree`` (random DDTree-like ancestor bits), ``chain`` (``bits=None``,
  the DFlash verify / AR / prefill-chunk pass) and ``window`` (tree bits and a
  4096-key sliding window at positions ``prefix + depth``), the last two at
  T = 16 and 65 only; and ``batch4``: 4 independent sequences in one call
  (a tree each, per-row committed lengths ``prefix - 0/37/100/250`` as a
  device tensor ``[4]``, K/V the whole views ``kv[:, l, 0/1]`` of a ``[4, L, 2,
  Hkv, Smax, D]`` cache), T = 16 and 65.
* ``sdpa_dense_mask``: the ``[T, prefix + T]`` mask (``tree_attention_mask``
  for bits; the reference's ``tree_visibility`` for chain / window), then
  ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa``, as
  an attention backend without a tree kernel must do (``batch4``: the
  ``[4, T, Smax]`` visibility over the whole cache views, one batched SDPA).

With CUDA every provider also records its peak extra GPU memory in
``extra_info["peak_extra_mib"]``; without CUDA only prefix 1k, T 16 / 65 run.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash_kernels import reference as ref  # noqa: E402
from dflash_kernels.tree_attention import tree_attention_mask  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HQ, HKV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
WINDOW = 4096
if CUDA:
    PREFIXES, TREES = (1024, 4096, 8192), (16, 65, 257, 1025)
else:
    PREFIXES, TREES = (1024,), (16, 65)
CASES = [(p, t, "tree") for p in PREFIXES for t in TREES]
CASES += [(p, t, mode) for p in PREFIXES for t in TREES if t <= 65 for mode in ("chain", "window", "batch4")]
#: ``batch4``: the rows of the batch and how far each row's committed length is below ``prefix``.
BATCH, BATCH_SHORTFALL = 4, (0, 37, 100, 250)


def tree_parents(n_tree, seed=0):
    """Parents and depths of a DDTree-like tree (depth <= 15)."""
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_tree):
        p = int(torch.randint(max(0, i - 32), i, (1,), generator=gen))
        while depth[p] >= 15:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents, depth


def batch_inputs(prefix_len, n_tree):
    """``batch4``: query ``[4, Hq, T, D]``, the whole K/V views ``[4, Hkv, Smax, D]``, a tree per row, the
    committed lengths ``[4]`` on the device."""
    s_max = prefix_len + n_tree + 64
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(BATCH, n_tree, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen).transpose(1, 2)
    kv = torch.randn(BATCH, 2, 2, HKV, s_max, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    bits = torch.stack([dk.ancestor_bits(torch.tensor(tree_parents(n_tree, seed=r)[0], dtype=torch.int64,
                                                      device=DEVICE)) for r in range(BATCH)])
    prefixes = torch.tensor([max(0, prefix_len - d) for d in BATCH_SHORTFALL], device=DEVICE)
    return q, kv[:, 1, 0], kv[:, 1, 1], bits, prefixes, {}


def inputs(prefix_len, n_tree, mode):
    if mode == "batch4":
        return batch_inputs(prefix_len, n_tree)
    s = prefix_len + n_tree
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    # [1, Hq, T, D] as the model passes it: a transposed view of [1, T, Hq, D].
    q = torch.randn(1, n_tree, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen).transpose(1, 2)
    cache = torch.randn(2, 2, HKV, s + 64, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    parents, depth = tree_parents(n_tree)
    kwargs = {}
    if mode == "chain":
        bits = None
    else:
        bits = dk.ancestor_bits(torch.tensor(parents, dtype=torch.int64, device=DEVICE))
    if mode == "window":
        kwargs = {"positions": torch.tensor([prefix_len + d for d in depth], device=DEVICE), "window": WINDOW}
    return q, cache[1, 0, :, :s][None], cache[1, 1, :, :s][None], bits, prefix_len, kwargs


def sdpa_dense_mask(q, k, v, bits, prefix_len, positions=None, window=None):
    if isinstance(prefix_len, torch.Tensor):  # batch4: [b, T, Smax] over the whole cache views
        mask = ref.tree_visibility(bits, prefix_len, q.shape[2], n_keys=k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    if bits is not None and window is None and CUDA:
        mask = tree_attention_mask(bits, prefix_len, q.dtype) == 0
    else:
        mask = ref.tree_visibility(bits, prefix_len, q.shape[2], positions=positions, window=window,
                                   device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)


def tree_attention(q, k, v, bits, prefix_len, **kwargs):
    if CUDA:
        return dk.tree_attention(q, k, v, bits, prefix_len, **kwargs)
    with dk.force_backend("reference"):
        return dk.tree_attention(q, k, v, bits, prefix_len, **kwargs)


def run_provider(benchmark, fn, args, kwargs):
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def call():
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            return out

        out = benchmark(call)
        benchmark.extra_info["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 2)
        return out
    return benchmark.pedantic(fn, args=args, kwargs=kwargs, rounds=3, iterations=1)


@pytest.mark.parametrize("prefix_len,n_tree,mode", CASES, ids=[f"p{p}-T{t}-{m}" for p, t, m in CASES])
@pytest.mark.parametrize("provider", ["tree_attention", "sdpa_dense_mask"])
def test_tree_attention(benchmark, provider, prefix_len, n_tree, mode):
    q, k, v, bits, prefix, kwargs = inputs(prefix_len, n_tree, mode)
    batch = q.shape[0] if mode == "batch4" else 1
    benchmark.group = f"tree_attention {mode} prefix={prefix_len} T={n_tree}"
    benchmark.extra_info.update(
        hq=HQ, hkv=HKV, head_dim=HEAD_DIM, dtype=str(DTYPE), device=DEVICE, mode=mode, batch=batch,
        window=kwargs.get("window"), backend="triton" if CUDA else "reference",
        dense_mask_mib=round(batch * n_tree * k.shape[-2] * q.element_size() / 2**20, 3),
    )
    if provider == "tree_attention":
        if CUDA:
            dk.warmup_tree_attention(q, k, v, bits, prefix, **kwargs)
        out = run_provider(benchmark, tree_attention, (q, k, v, bits, prefix), kwargs)
    else:
        out = run_provider(benchmark, sdpa_dense_mask, (q, k, v, bits, prefix), kwargs)
    assert out.shape == q.shape

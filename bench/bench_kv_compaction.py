"""Benchmark: KV compaction of an accepted tree path, one Triton launch vs a torch loop.

Run: ``python -m pytest bench/bench_kv_compaction.py --benchmark-columns=median,rounds``

Providers, on a ``[L, 2, Hkv, Smax, D]`` cache whose accepted rows lie among
the tree rows after the prefix:

* ``triton``: :func:`dflash_kernels.compact_kv_` (one launch for all layers).
* ``torch_loop``: :func:`dflash_kernels.reference.compact_kv_`
  (``index_select`` + ``copy_`` per layer, 2 launches per layer on a GPU).

With CUDA: a Qwen3-8B-sized cache (36 layers, 8 kv heads, head dim 128, bf16,
Smax 8192), prefix 4000, tree of 256 tokens, 4 and 16 accepted rows. Without
CUDA: a small cache; the kernel runs under the Triton interpreter (a
correctness tool, not a speed path: one round only).

A batch of ``b = 4`` such caches (``kv [4, L, 2, Hkv, Smax, D]``, each row its
own committed length and accepted path, row counts ``[n, n - 1, 0, n // 2]``
on the device: one finished row), ``test_compact_kv_batched``:

* ``triton``: the batched :func:`dflash_kernels.compact_kv_` (one launch for
  every row, layer, key/value and head);
* ``triton_per_row``: ``b`` single-sequence device-destination launches;
* ``torch_reference``: :func:`dflash_kernels.reference.compact_kv_` on the
  batch (one gather and one scatter over every row).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dflash_kernels import reference as ref  # noqa: E402
from dflash_kernels._dispatch import triton_interpreting  # noqa: E402
from dflash_kernels.kv_compaction import compact_kv_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    LAYERS, HKV, SMAX, HEAD_DIM, DTYPE, PREFIX, TREE = 36, 8, 8192, 128, torch.bfloat16, 4000, 256
else:
    LAYERS, HKV, SMAX, HEAD_DIM, DTYPE, PREFIX, TREE = 4, 2, 1024, 64, torch.bfloat16, 300, 64


BATCH = 4


def accepted_rows(n_rows, seed=0, prefix=PREFIX):
    """Root stays at ``prefix``; the other accepted nodes lie at increasing tree offsets."""
    gen = torch.Generator().manual_seed(seed)
    tail = torch.randperm(TREE - 1, generator=gen)[: n_rows - 1].sort().values + prefix + 1
    return torch.cat([torch.tensor([prefix]), tail])


def timed(benchmark, fn, args, interpreted):
    """CUDA: synchronized calls (and the peak extra memory); the interpreter: one round; else plain rounds."""
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

        def call():
            fn(*args)
            torch.cuda.synchronize()

        benchmark(call)
        benchmark.extra_info["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 3)
    elif interpreted:
        benchmark.pedantic(fn, args=args, rounds=1, iterations=1)
    else:
        benchmark(fn, *args)


@pytest.mark.parametrize("n_rows", [4, 16])
@pytest.mark.parametrize("provider", ["triton", "torch_loop"])
def test_compact_kv(benchmark, provider, n_rows):
    kv = torch.randn(LAYERS, 2, HKV, SMAX, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    src = accepted_rows(n_rows)
    fn = compact_kv_triton if provider == "triton" else ref.compact_kv_
    args = (kv, src.to(DEVICE) if provider == "torch_loop" else src, PREFIX)
    benchmark.group = f"compact_kv rows={n_rows}"
    moved = LAYERS * 2 * HKV * n_rows * HEAD_DIM * kv.element_size()
    benchmark.extra_info.update(layers=LAYERS, hkv=HKV, head_dim=HEAD_DIM, device=DEVICE, moved_bytes=moved)
    timed(benchmark, fn, args, provider == "triton" and triton_interpreting())


def _per_row(kv, src, dst, counts):
    for r in range(kv.shape[0]):
        compact_kv_triton(kv[r], src[r], dst[r:r + 1], num_rows=counts[r:r + 1], check=False)


@pytest.mark.parametrize("n_rows", [4, 16])
@pytest.mark.parametrize("provider", ["triton", "triton_per_row", "torch_reference"])
def test_compact_kv_batched(benchmark, provider, n_rows):
    kv = torch.randn(BATCH, LAYERS, 2, HKV, SMAX, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    prefixes = [PREFIX - 37 * r for r in range(BATCH)]  # every row its own committed length
    src = torch.stack([accepted_rows(n_rows, seed=r, prefix=p) for r, p in enumerate(prefixes)]).to(DEVICE)
    dst = torch.tensor(prefixes, device=DEVICE)
    counts = torch.tensor([n_rows, n_rows - 1, 0, n_rows // 2], device=DEVICE)  # row 2: a finished sequence
    fn = {"triton": lambda *a: compact_kv_triton(*a[:3], num_rows=a[3], check=False), "triton_per_row": _per_row,
          "torch_reference": lambda *a: ref.compact_kv_(*a[:3], num_rows=a[3])}[provider]
    benchmark.group = f"compact_kv batched b={BATCH} rows={n_rows}"
    moved = int(counts.clamp(min=0).sum()) * LAYERS * 2 * HKV * HEAD_DIM * kv.element_size()
    benchmark.extra_info.update(batch=BATCH, layers=LAYERS, hkv=HKV, head_dim=HEAD_DIM, device=DEVICE,
                                moved_bytes=moved)
    timed(benchmark, fn, (kv, src, dst, counts), provider != "torch_reference" and triton_interpreting())

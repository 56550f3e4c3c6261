"""Benchmark: gather + concat of captured layers, ours vs the plain torch composition.

Run: ``python -m pytest bench/bench_gather.py --benchmark-columns=median,rounds``

Providers, for ``n`` selected layers of ``[T, H]`` hidden states and R rows:

* ``ours``: :func:`dflash_kernels.gather_concat` through the dispatcher (one
  Triton launch on a GPU).
* ``torch``: ``torch.cat(selected layers, -1)[rows]`` (builds the whole
  ``[T, n*H]`` concatenation, then indexes it).

With CUDA: Qwen3-8B shapes (H 4096, 36 captured layers of which 5 are read,
as DFlash's layer map picks them), prefill of 4096 rows, a verify block of 16
rows keeping 8, a DDTree verify of 65 nodes keeping 8. Without CUDA: small
shapes, and ``ours`` runs the **reference** backend, because the Triton CPU
interpreter is a correctness tool, not a speed path; CPU times compare two
torch compositions.

Memory, in ``extra_info["peak_extra_bytes"]``: the peak of memory allocated
during one call above what was allocated before it
(``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the torch profiler's
allocation records, ``profile_memory=True``, summed in time order: torch's CPU
allocator keeps no statistics and tracemalloc does not see torch tensors).
It includes the returned tensor.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dflash_kernels import force_backend, gather_concat  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LAYER_IDS = [1, 9, 17, 25, 33]  # Qwen3-8B (36 layers), 5 drafter layers
if CUDA:
    H, N_CAPTURED, DTYPE = 4096, 37, torch.bfloat16
    CASES = [("prefill", 4096, None), ("verify_block", 16, 8), ("ddtree_verify", 65, 8)]
else:
    H, N_CAPTURED, DTYPE = 256, 37, torch.bfloat16
    CASES = [("prefill", 512, None), ("verify_block", 16, 8), ("ddtree_verify", 65, 8)]
OURS_BACKEND = "triton" if CUDA else "reference"


def peak_extra_bytes(fn) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before (see the module doc)."""
    if CUDA:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    stamp = (lambda e: e.start_ns()) if records and hasattr(records[0], "start_ns") else (lambda e: e.start_us())
    live = peak = 0
    for e in sorted(records, key=stamp):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def torch_gather(layers, rows):
    full = torch.cat(layers, dim=-1)
    return full if rows is None else full[rows]


def synced(fn, *args):
    def call():
        out = fn(*args)
        if CUDA:
            torch.cuda.synchronize()
        return out

    return call


@pytest.mark.parametrize("case,T,keep", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_gather_concat(benchmark, provider, case, T, keep):
    captured = [torch.randn(T, H, device=DEVICE, dtype=DTYPE) for _ in range(N_CAPTURED)]
    layers = [captured[i + 1] for i in LAYER_IDS]  # entry k + 1 is the output of layer k
    rows = None if keep is None else torch.randperm(T, device=DEVICE)[:keep]
    if provider == "ours":
        with force_backend(OURS_BACKEND):
            call = synced(gather_concat, layers, rows)
            expected = torch_gather(layers, rows)
            assert torch.equal(call(), expected)
            benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes(call)
            benchmark(call)
    else:
        call = synced(torch_gather, layers, rows)
        benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes(call)
        benchmark(call)
    benchmark.group = f"gather_concat {case}"
    benchmark.extra_info.update(T=T, rows=keep if keep is not None else T, layers=len(layers), hidden=H,
                                device=DEVICE, backend=OURS_BACKEND if provider == "ours" else "torch",
                                output_bytes=(keep or T) * len(layers) * H * captured[0].element_size())

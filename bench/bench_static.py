"""Benchmark: the fixed-shape (device-length / device-seed) forms of the ops a compiled round calls.

Run: ``python -m pytest bench/bench_static.py --benchmark-columns=median,rounds``

:func:`dflash_kernels.tree_attention` with a device prefix (a 16-row chain and a 65-node tree
over a whole 8192-row cache, 4096 committed), :func:`dflash_kernels.lm_head_sample`
and :func:`dflash_kernels.lm_head_sample` with filters and a device seed (16 rows, top-k 50),
:func:`dflash_kernels.compact_kv_` with a device destination (16 accepted rows of every layer),
:func:`dflash_kernels.noise.gumbel_noise_block` (the noise alone), :func:`dflash_kernels.kv_write_`
(one layer's 16 rows) and :func:`dflash_kernels.masked_attention` (the reference backend's attention
over the whole cache). With CUDA: Qwen3-8B
shapes (32/8 heads, head dim 128, hidden 4096, vocab 151936, 36 layers), bf16,
Triton vs reference. Without CUDA: small shapes, the reference only (the
interpreter is a correctness tool, not a speed path). The whole compiled round
is timed by ``bench/compile_speed.py`` (CPU) and ``bench/gpu_compiled_round.py`` (GPU).
"""

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.noise import gumbel_noise_block

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
if CUDA:
    HQ, HKV, D, H, V, L, S, PREFIX = 32, 8, 128, 4096, 151936, 36, 8192, 4096
else:
    HQ, HKV, D, H, V, L, S, PREFIX = 4, 2, 32, 64, 512, 4, 512, 256
PROVIDERS = ["triton", "reference"] if CUDA else ["reference"]


def run(benchmark, provider, fn, *args, **kwargs):
    benchmark.extra_info.update(device=DEVICE, dtype=str(DTYPE))

    def call():
        with dk.force_backend(provider):
            fn(*args, **kwargs)
        if CUDA:
            torch.cuda.synchronize()

    benchmark(call)


def _tree_bits(n, gen):
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    return dk.ancestor_bits(parents.to(DEVICE))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("kind", ["chain16", "tree65"])
def test_tree_attention_device_prefix(benchmark, provider, kind):
    gen = torch.Generator().manual_seed(0)
    T = 16 if kind == "chain16" else 65
    q = torch.randn(1, HQ, T, D, generator=gen).to(DEVICE, DTYPE)
    k = torch.randn(1, HKV, S, D, generator=gen).to(DEVICE, DTYPE)
    v = torch.randn(1, HKV, S, D, generator=gen).to(DEVICE, DTYPE)
    bits = None if kind == "chain16" else _tree_bits(T, gen)
    prefix = torch.tensor([PREFIX], device=DEVICE)
    benchmark.group = f"tree_attention device prefix {kind}"
    run(benchmark, provider, dk.tree_attention, q, k, v, bits, prefix)


def _head(n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen).to(DEVICE, DTYPE)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(DEVICE, DTYPE)
    return hidden, weight, torch.tensor([1234], device=DEVICE)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_lm_head_sample_device_seed(benchmark, provider):
    hidden, weight, seed = _head()
    benchmark.group = "lm_head_sample device seed"
    run(benchmark, provider, dk.lm_head_sample, hidden, weight, 0.7, seed=seed, check_bounds=False)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_lm_head_sample_processed_device_seed(benchmark, provider):
    hidden, weight, seed = _head()
    benchmark.group = "lm_head_sample_processed device seed"
    run(benchmark, provider, dk.lm_head_sample, hidden, weight, 0.7, seed=seed, top_k=50, top_p=0.9,
        check_bounds=False)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_compact_kv_device_destination(benchmark, provider):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(L, 2, HKV, S, D, generator=gen).to(DEVICE, DTYPE)
    start = torch.tensor([PREFIX], device=DEVICE)
    src = (PREFIX + torch.tensor(sorted(torch.randperm(64, generator=gen)[:16].tolist()))).to(DEVICE)
    benchmark.group = "compact_kv_ device destination"
    run(benchmark, provider, dk.compact_kv_, kv, src, start, num_rows=torch.tensor([12], device=DEVICE), check=False)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_gumbel_noise_block(benchmark, provider):
    seed = torch.tensor([99], device=DEVICE)
    benchmark.group = "gumbel_noise_block"
    run(benchmark, provider, gumbel_noise_block, seed, 0, 16, 0, V)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_kv_write_one_layer(benchmark, provider):
    """A round pass's cache write of one layer: 16 rows at the device length (the C++ op on every backend)."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(L, 2, HKV, S, D, generator=gen).to(DEVICE, DTYPE)
    key = torch.randn(HKV, 16, D, generator=gen).to(DEVICE, DTYPE)
    value = torch.randn(HKV, 16, D, generator=gen).to(DEVICE, DTYPE)
    rows = PREFIX + torch.arange(16, device=DEVICE)
    benchmark.group = "kv_write_ 16 rows"
    run(benchmark, provider, dk.kv_write_, kv, 1, rows, key, value)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_masked_attention_whole_cache(benchmark, provider):
    """The reference backend's round attention: SDPA over the whole cache under one [T, S] visibility mask."""
    gen = torch.Generator().manual_seed(0)
    T = 16
    q = torch.randn(1, HQ, T, D, generator=gen).to(DEVICE, DTYPE)
    k = torch.randn(1, HKV, S, D, generator=gen).to(DEVICE, DTYPE)
    v = torch.randn(1, HKV, S, D, generator=gen).to(DEVICE, DTYPE)
    visible = dk.tree_visibility(None, torch.tensor([PREFIX], device=DEVICE), T, n_keys=S)
    benchmark.group = "masked_attention chain16"
    run(benchmark, provider, dk.masked_attention, q, k, v, visible)

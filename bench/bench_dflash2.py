"""Benchmark: the DFlash2 drafter ops, ours vs the reference torch composition.

Run: ``python -m pytest bench/bench_dflash2.py --benchmark-columns=median,rounds``
(launch counts per drafter layer: ``python bench/dflash2_kernels.py``).

Providers:

* ``ours``: :func:`dflash_kernels.dynamic_conv` (the finish form: ``residual + conv``; forward, and
  forward + backward) and
  :func:`dflash_kernels.select_candidates` (greedy and sampling) on the Triton backend: one launch each.
* ``torch``: the same ops on the reference backend (``2K`` + a few tensor ops per conv, ``~10 D`` per
  selector chain).

With CUDA: a Qwen3-8B-sized drafter (hidden 4096, block 16, 4 taps, 64 channels per group; selector
rank 128, top 16 of vocab 151936), one block (a decoding round) and 64 blocks (a training batch). Without
CUDA: small shapes, and ``ours`` runs the **reference** backend too (the Triton CPU interpreter is a
correctness tool, not a speed path), so CPU times compare a composition with itself.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dflash_kernels import dynamic_conv, force_backend, select_candidates  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    H, B, K, G_SIZE, DTYPE, R, TOPK, V = 4096, 16, 4, 64, torch.bfloat16, 128, 16, 151936
    BLOCKS = [1, 64]
else:
    H, B, K, G_SIZE, DTYPE, R, TOPK, V = 256, 16, 4, 32, torch.float32, 32, 8, 1024
    BLOCKS = [1, 8]
OURS_BACKEND = "triton" if CUDA else "reference"


def synced(fn, *args):
    def call():
        out = fn(*args)
        if CUDA:
            torch.cuda.synchronize()
        return out

    return call


@pytest.mark.parametrize("nb", BLOCKS)
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_dynamic_conv(benchmark, provider, nb):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(nb, B, H, generator=gen).to(DEVICE, DTYPE)
    residual = torch.randn(nb, B, H, generator=gen).to(DEVICE, DTYPE)
    proj = (torch.randn(nb, B, 2, K, H // G_SIZE, generator=gen) * 0.1).to(DEVICE, DTYPE)
    base = torch.randn(2, K, H, generator=gen).to(DEVICE, DTYPE)
    backend = OURS_BACKEND if provider == "ours" else "reference"
    call = synced(dynamic_conv, x, proj[:, :, 1], base[1], residual)
    with force_backend(backend), torch.no_grad():
        if provider == "ours":
            with force_backend("reference"):
                want = call().float()
            torch.testing.assert_close(call().float(), want, rtol=2e-2, atol=2e-2)
        benchmark(call)
    benchmark.group = f"dynamic_conv nb={nb}"
    benchmark.extra_info.update(blocks=nb, block=B, hidden=H, taps=K, group_size=G_SIZE, device=DEVICE,
                                backend=backend)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_select_candidates(benchmark, provider, temperature):
    gen = torch.Generator().manual_seed(1)
    D = B - 1
    logits = torch.randn(D, V, generator=gen).to(DEVICE)
    unary, candidates = logits.topk(TOPK, dim=-1)
    args = (unary, candidates, torch.randn(D, R, generator=gen).to(DEVICE, DTYPE),
            torch.randn(V, R, generator=gen).to(DEVICE, DTYPE), torch.randn(V, R, generator=gen).to(DEVICE, DTYPE),
            torch.tensor([3], device=DEVICE), temperature, torch.tensor([5], device=DEVICE))
    backend = OURS_BACKEND if provider == "ours" else "reference"
    call = synced(select_candidates, *args)
    with force_backend(backend):
        if provider == "ours":
            with force_backend("reference"):
                want = call()
            assert torch.equal(call()[0], want[0])
        benchmark(call)
    benchmark.group = f"select_candidates T={temperature}"
    benchmark.extra_info.update(positions=D, top_k=TOPK, rank=R, vocab=V, device=DEVICE, backend=backend)


@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_dynamic_conv_train(benchmark, provider):
    """Forward + backward of ``residual + conv`` (a training step's share): our Triton backward vs autograd
    through the reference."""
    nb = BLOCKS[-1]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(nb, B, H, generator=gen).to(DEVICE, DTYPE).requires_grad_()
    residual = torch.randn(nb, B, H, generator=gen).to(DEVICE, DTYPE).requires_grad_()
    proj = (torch.randn(nb, B, 2, K, H // G_SIZE, generator=gen) * 0.1).to(DEVICE, DTYPE).requires_grad_()
    base = torch.randn(2, K, H, generator=gen).to(DEVICE, DTYPE).requires_grad_()
    backend = OURS_BACKEND if provider == "ours" else "reference"

    def step():
        dynamic_conv(x, proj[:, :, 1], base[1], residual).float().square().sum().backward()

    with force_backend(backend):
        benchmark(synced(step))
    benchmark.group = f"dynamic_conv train nb={nb}"
    benchmark.extra_info.update(blocks=nb, block=B, hidden=H, taps=K, group_size=G_SIZE, device=DEVICE,
                                backend=backend)

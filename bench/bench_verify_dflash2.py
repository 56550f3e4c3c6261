"""Benchmark: the round ops of sampled chains and DFlash2 trees, ours vs the reference torch composition.

Run: ``python -m pytest bench/bench_verify_dflash2.py --benchmark-columns=median,rounds``

* ``rejection_sample``: the rejection rule over a chain's verify rows (dense ``q`` from drafter rows, or
  sparse ``q`` over the selector's candidates). ``ours`` = :func:`dflash_kernels.rejection_sample` on the
  default backend (vocabulary-chunked, no ``[rows, V]`` probabilities beyond a chunk); ``torch`` = the
  reference (whole ``[rows, V]`` softmaxes).
* ``selector_child_logprobs`` (the tree's table) and ``build_selector_tree_device``: the best-first tree over a DFlash2 selector's lattice. ``ours`` = the
  fixed-shape device build a traced round runs; ``torch`` = the heap reference
  (:func:`dflash_kernels.reference.build_selector_tree`), host code.

With CUDA: Qwen3-8B's head (hidden 4096, vocab 151936), block 16, top 16, budget 64. Without CUDA: small
shapes; CPU times say nothing about a GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash_kernels import reference as ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    H, V, B, TOPK, BUDGET, DTYPE = 4096, 151936, 16, 16, 64, torch.bfloat16
else:
    H, V, B, TOPK, BUDGET, DTYPE = 64, 1024, 8, 8, 16, torch.float32


def synced(fn, *args, **kwargs):
    def call():
        out = fn(*args, **kwargs)
        if CUDA:
            torch.cuda.synchronize()
        return out

    return call


@pytest.mark.parametrize("form", ["dense", "sparse"])
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_rejection_sample(benchmark, provider, form):
    gen = torch.Generator(device=DEVICE).manual_seed(0)  # drawn on the device: a [V, H] host draw takes seconds
    D = B - 1
    hidden = torch.randn(B, H, generator=gen, device=DEVICE).to(DTYPE)
    weight = (torch.randn(V, H, generator=gen, device=DEVICE) * H ** -0.5).to(DTYPE)
    q_hidden = (hidden[1:].float() + 0.3 * torch.randn(D, H, generator=gen, device=DEVICE)).to(DTYPE)
    proposals = (q_hidden.float() @ weight.float().T).argmax(-1)
    if form == "dense":
        q = dict(q_hidden=q_hidden)
    else:
        logits = q_hidden.float() @ weight.float().T
        top, ids = logits.topk(TOPK, dim=-1)
        ids[:, 0] = proposals
        q = dict(q_ids=ids, q_probs=torch.softmax(top, -1))
    seed = torch.tensor([7], device=DEVICE)
    kw = dict(top_k=50, top_p=0.95, seed=seed, **q)
    backend = None if provider == "ours" else "reference"
    call = synced(dk.rejection_sample, hidden, weight, proposals, 0.8, backend=backend, **kw)
    if provider == "ours":
        want = dk.rejection_sample(hidden, weight, proposals, 0.8, backend="reference", **kw)
        got = call()
        assert torch.equal(got[1], want[1])  # the same uniforms: the same accepted count
    benchmark(call)
    benchmark.group = f"rejection_sample {form}"
    benchmark.extra_info.update(rows=B, hidden=H, vocab=V, form=form, device=DEVICE)


@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_build_selector_tree_device(benchmark, provider):
    gen = torch.Generator().manual_seed(1)
    D = B - 1
    child = torch.log_softmax(torch.randn(D, TOPK, TOPK, generator=gen, dtype=torch.float64), -1).to(DEVICE)
    candidates = torch.randint(0, V, (D, TOPK), generator=gen).to(DEVICE)
    if provider == "ours":
        call = synced(dk.build_selector_tree_device, child, candidates, BUDGET)
        want = ref.build_selector_tree(child.cpu(), candidates.cpu(), BUDGET)
        for a, b in zip(call(), want):
            assert torch.equal(a.cpu(), b)
    else:
        call = synced(ref.build_selector_tree, child, candidates, BUDGET)
    benchmark(call)
    benchmark.group = "build_selector_tree"
    benchmark.extra_info.update(positions=D, top_k=TOPK, budget=BUDGET, device=DEVICE)


def test_selector_child_logprobs(benchmark):
    """The ``[D, k, k]`` table a selector tree is built from: one batched contraction (one implementation;
    its time beside the tree build's)."""
    gen = torch.Generator().manual_seed(2)
    D, R = B - 1, 32
    unary, candidates = torch.randn(D, V, generator=gen).to(DEVICE).topk(TOPK, dim=-1)
    args = (unary, candidates, torch.randn(D, R, generator=gen).to(DEVICE, DTYPE),
            torch.randn(V, R, generator=gen).to(DEVICE, DTYPE), torch.randn(V, R, generator=gen).to(DEVICE, DTYPE),
            torch.tensor([3], device=DEVICE))
    call = synced(dk.selector_child_logprobs, *args)
    assert call().shape == (D, TOPK, TOPK)
    benchmark(call)
    benchmark.group = "build_selector_tree"
    benchmark.extra_info.update(positions=D, top_k=TOPK, rank=R, device=DEVICE)

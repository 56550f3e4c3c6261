"""Benchmark: the Gated-DeltaNet ops of hybrid targets, Triton kernels vs the pure-torch references.

Run: ``python -m pytest bench/bench_gated_delta.py --benchmark-columns=median,rounds``

Ops, per linear layer and round: :func:`dflash_kernels.gated_delta_tree` (a
chain of 16, a tree of 65 nodes), :func:`dflash_kernels.gated_delta_replay_`
(16 accepted rows, all layers in one launch), :func:`dflash_kernels.causal_conv_tree`
and :func:`dflash_kernels.conv_window_after`. With CUDA: Qwen3.5-27B shapes
(Hk 16, Hv 48, Dk = Dv = 128, conv 10240 channels x 4, bf16 activations, fp32
state; replay over 48 layers). Without CUDA: small shapes; the Triton
providers run under the interpreter (one round: a correctness tool, not a
speed path). The chain-vs-replay rollback comparison is ``bench/gated_delta_rollback.py``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash_kernels._dispatch import triton_interpreting  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    HK, HV, DK, DV, LAYERS, CONV_K = 16, 48, 128, 128, 48, 4
else:
    HK, HV, DK, DV, LAYERS, CONV_K = 2, 4, 32, 32, 3, 4
CHANNELS = 2 * HK * DK + HV * DV


def layer_inputs(n, layers=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lead = () if layers is None else (layers,)
    rnd = lambda *s: torch.randn(*lead, *s, generator=gen)  # noqa: E731
    q, k, v = rnd(n, HK, DK), rnd(n, HK, DK), rnd(n, HV, DV)
    g, beta = -F.softplus(rnd(n, HV)), torch.sigmoid(rnd(n, HV))
    state = torch.randn(*lead, HV, DK, DV, generator=gen) * 0.5
    to = lambda t, dt=torch.bfloat16: t.to(DEVICE, dt)  # noqa: E731
    return to(q), to(k), to(v), to(g, torch.float32), to(beta), to(state, torch.float32)


def tree_parents(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor(par, device=DEVICE)


def run(benchmark, provider, fn, *args, **kwargs):
    benchmark.extra_info.update(device=DEVICE, shape=f"Hk{HK} Hv{HV} Dk{DK} Dv{DV} C{CHANNELS}")

    def call():
        with dk.force_backend(provider):
            fn(*args, **kwargs)
        if CUDA:
            torch.cuda.synchronize()

    if provider == "triton" and triton_interpreting():
        benchmark.pedantic(call, rounds=1, iterations=1)
    else:
        benchmark(call)


@pytest.mark.parametrize("provider", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["chain16", "tree65"])
def test_gated_delta_tree(benchmark, provider, kind):
    n = 16 if kind == "chain16" else 65
    q, k, v, g, beta, state = layer_inputs(n)
    parents = None if kind == "chain16" else tree_parents(n)
    benchmark.group = f"gated_delta_tree {kind}"
    kw = {} if parents is None or provider == "reference" else {"store_states": "branches"}
    run(benchmark, provider, dk.gated_delta_tree, q, k, v, g, beta, state, parents, **kw)


@pytest.mark.parametrize("provider", ["triton", "reference"])
def test_gated_delta_replay_(benchmark, provider):
    q, k, v, g, beta, state = layer_inputs(16, layers=LAYERS)
    rows, count = torch.arange(16, device=DEVICE), torch.tensor([16], device=DEVICE)
    benchmark.group = f"gated_delta_replay_ 16 rows x {LAYERS} layers"
    run(benchmark, provider, dk.gated_delta_replay_, state, q, k, v, g, beta, rows, count)


@pytest.mark.parametrize("provider", ["triton", "reference"])
def test_causal_conv_tree(benchmark, provider):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(65, CHANNELS, generator=gen).to(DEVICE, torch.bfloat16)
    window = torch.randn(CONV_K - 1, CHANNELS, generator=gen).to(DEVICE, torch.bfloat16)
    weight = torch.randn(CHANNELS, CONV_K, generator=gen).to(DEVICE, torch.bfloat16)
    benchmark.group = "causal_conv_tree 65 nodes"
    run(benchmark, provider, dk.causal_conv_tree, x, window, weight, tree_parents(65))


def test_conv_window_after(benchmark):
    x = torch.randn(LAYERS, 65, CHANNELS, device=DEVICE, dtype=torch.bfloat16)
    window = torch.randn(LAYERS, CONV_K - 1, CHANNELS, device=DEVICE, dtype=torch.bfloat16)
    rows, count = torch.arange(16, device=DEVICE), torch.tensor([9], device=DEVICE)
    benchmark.group = f"conv_window_after x {LAYERS} layers"
    run(benchmark, "reference", dk.conv_window_after, window, x, rows, count)

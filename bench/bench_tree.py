"""Benchmarks of the DDTree host side: tree build (C++ vs Python reference) and ancestor bits.

Run: ``python -m pytest bench/bench_tree.py --benchmark-columns=mean,stddev,rounds``

* ``build_tree``: the C++ op against the heapq reference at budgets 16, 64,
  256, 1024 (D = 15 depths, K = min(budget, 32)). Each C++ result records the
  reference's median time over its own in ``extra_info["python_over_cpp"]``;
  the session end prints the ratios.
* ``ancestor_bits``: the Triton kernel against the NumPy row-copy loop of the
  reference. On a CPU-only machine only the reference runs: the Triton
  interpreter executes kernels program by program in Python and is a
  correctness tool, not a speed path. With CUDA both run on the GPU-resident
  parents (the reference pays the copy to the host and back, as a caller would).
"""

import os

import torch

if not torch.cuda.is_available():  # the kernel import below must see the interpreter flag
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash_kernels import reference as ref  # noqa: E402
from dflash_kernels.tree import ancestor_bits_triton  # noqa: E402

CUDA = torch.cuda.is_available()
BUDGETS = [16, 64, 256, 1024]
DEPTH = 15
_BUILD_MEANS = {}


def draft_inputs(budget, seed=0):
    """Sorted top-K log-probs and ids as a drafter produces them: ``[15, min(budget, 32)]``."""
    gen = torch.Generator().manual_seed(seed)
    k = min(budget, 32)
    logits = torch.randn(DEPTH, 4096, generator=gen) * 3
    top = logits.log_softmax(-1).topk(k, dim=-1)
    return top.values, top.indices


def _median(benchmark):
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else stats.stats.median


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("impl", ["python", "cpp"])
def test_build_tree(benchmark, impl, budget):
    logprobs, ids = draft_inputs(budget)
    build = dk.build_tree if impl == "cpp" else ref.build_tree
    benchmark.group = f"build_tree budget={budget}"
    benchmark.extra_info.update(budget=budget, depth=DEPTH, k=ids.shape[1])
    tokens, _, _ = benchmark(build, logprobs, ids, budget)
    assert tokens.numel() == budget
    _BUILD_MEANS[(impl, budget)] = _median(benchmark)
    python, cpp = _BUILD_MEANS.get(("python", budget)), _BUILD_MEANS.get(("cpp", budget))
    if impl == "cpp" and python and cpp:
        benchmark.extra_info["python_over_cpp"] = round(python / cpp, 2)


def random_parents(n_nodes, seed=0):
    """DDTree-like parents (depth <= 15) of ``n_nodes`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for i in range(1, n_nodes):
        p = int(torch.randint(max(0, i - 32), i, (1,), generator=gen))
        while depth[p] >= 15:
            p = parents[p]
        parents.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(parents, dtype=torch.int64)


def _sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("n_nodes", [17, 65, 257, 1025])
@pytest.mark.parametrize("impl", ["numpy_loop", "triton"])
def test_ancestor_bits(benchmark, impl, n_nodes):
    if impl == "triton" and not CUDA:
        pytest.skip("no CUDA: the Triton interpreter is a correctness tool, not a speed path")
    parents = random_parents(n_nodes).to("cuda" if CUDA else "cpu")
    fn = ancestor_bits_triton if impl == "triton" else ref.ancestor_bits
    benchmark.group = f"ancestor_bits N+1={n_nodes}"
    benchmark.extra_info.update(n_nodes=n_nodes, device=str(parents.device))

    def run():
        out = fn(parents)
        _sync()
        return out

    bits = benchmark(run)
    assert bits.shape == (n_nodes, (n_nodes + 31) // 32)


@pytest.fixture(scope="module", autouse=True)
def _print_build_ratios(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    ratios = [
        f"budget {b}: python/cpp = {_BUILD_MEANS[('python', b)] / _BUILD_MEANS[('cpp', b)]:.1f}x"
        for b in BUDGETS
        if _BUILD_MEANS.get(("python", b)) and _BUILD_MEANS.get(("cpp", b))
    ]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if ratios and reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\nbuild_tree speedup of C++ over the Python reference (medians): " + "; ".join(ratios))

"""Benchmark: fused final RMSNorm + lm_head consumers, ours vs the plain torch composition.

Run: ``python -m pytest bench/bench_lm_head.py --benchmark-columns=median,rounds``

Providers, for ``hidden [N, H]`` at the needed positions, lm_head ``[V, H]``:

* ``ours``: the dispatcher ops of :mod:`dflash_kernels.lm_head`
  (``lm_head_argmax``, ``lm_head_topk``, ``lm_head_sample``,
  ``lm_head_cross_entropy``).
* ``torch``: what a Hugging Face model does: ``rms_norm -> F.linear`` (logits
  in the model dtype, ``[N, V]``) then ``argmax`` / ``log_softmax + topk`` /
  ``softmax + multinomial`` / ``F.cross_entropy`` (forward + backward).

With CUDA: Qwen3-8B shapes (H 4096, V 151936, bf16): decode-sized N (1, 16,
64), top-64 at the 15 draft positions of a 16-token block, cross-entropy over
1024 and 8192 positions. Without CUDA: small shapes in fp32, and ``ours`` runs
the **reference** backend (the Triton CPU interpreter is a correctness tool,
not a speed path), so CPU times compare two torch compositions.

Memory, in ``extra_info["peak_extra_bytes"]``: the peak of memory allocated
during one call above what was allocated before it
(``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the torch profiler's
allocation records summed in time order, see ``bench_gather.peak_extra_bytes``).

``test_cross_entropy_memory_8192x151936`` checks the claim that the fused
cross-entropy over 8192 positions x 151936 vocab keeps its vocabulary-sized
buffers (the chunk plan's) under an eighth of the unfused logits tensor
(``8192 * 151936 * 4`` bytes = 4.98 GB). On a GPU it measures both providers
at the real shape (H 4096) and asserts the fused peak is under an eighth of
the unfused one, side by side: the fused peak also holds what any path needs
at ``[N, H]`` (the norm's fp32 activations and gradients, about 5 x 128 MB
there; 805 MB in all against 15.1 GB on an H200), which does not scale with
the vocabulary. On a CPU neither can run at
that shape (the unfused path needs > 10 GB; the fused Triton kernels would run
under the interpreter for hours), so it records (a) the fused op's chunk plan
at the real shape with H 64: the bytes of the largest buffers it allocates,
and (b) a profiler-measured peak of the fused Triton path (interpreter) at a
scaled shape with the same structure, 1024 positions x 1000 vocab in chunks of
64 rows, against the reference's.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dflash_kernels.cross_entropy as cross_entropy_module  # noqa: E402
from bench_gather import peak_extra_bytes  # noqa: E402
from dflash_kernels import (force_backend, lm_head_argmax, lm_head_cross_entropy, lm_head_sample,  # noqa: E402
                            lm_head_topk)
from dflash_kernels.reference import rms_norm  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OURS_BACKEND = "triton" if CUDA else "reference"
if CUDA:
    H, V, DTYPE = 4096, 151936, torch.bfloat16
    DECODE_N, TOPK_N, TOPK_K, CE_N = [1, 16, 64], 15, 64, [1024, 8192]
else:
    H, V, DTYPE = 256, 32000, torch.float32
    DECODE_N, TOPK_N, TOPK_K, CE_N = [1, 16, 64], 15, 64, [128, 512]


def model_tensors(n, seed=0):
    """Drawn on the device: a [V, H] draw on the host takes seconds per test at the real vocabulary."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, device=DEVICE).to(DTYPE)
    weight = (torch.randn(V, H, generator=g, device=DEVICE) / H ** 0.5).to(DTYPE)
    norm_weight = (1 + 0.1 * torch.randn(H, generator=g, device=DEVICE)).to(DTYPE)
    return hidden, weight, norm_weight


def torch_logits(hidden, weight, norm_weight):
    return F.linear(rms_norm(hidden, norm_weight), weight)


def torch_argmax(hidden, weight, norm_weight):
    return torch_logits(hidden, weight, norm_weight).argmax(dim=-1)


def torch_topk(hidden, weight, norm_weight, k):
    return torch.log_softmax(torch_logits(hidden, weight, norm_weight).float(), dim=-1).topk(k, dim=-1)


def torch_sample(hidden, weight, norm_weight, temperature):
    probs = torch.softmax(torch_logits(hidden, weight, norm_weight).float() / temperature, dim=-1)
    return torch.multinomial(probs, 1).squeeze(1)


def torch_cross_entropy(hidden, weight, norm_weight, targets):
    loss = F.cross_entropy(torch_logits(hidden, weight, norm_weight).float(), targets, reduction="none")
    loss.sum().backward()
    return loss


def ours_cross_entropy(hidden, weight, norm_weight, targets):
    loss = lm_head_cross_entropy(hidden, weight, targets, norm_weight=norm_weight)
    loss.sum().backward()
    return loss


def run(benchmark, provider, call, group, **info):
    """Record peak memory of one call, then time it (synchronized on a GPU)."""

    def synced():
        out = call()
        if CUDA:
            torch.cuda.synchronize()
        return out

    with force_backend(OURS_BACKEND if provider == "ours" else None):
        synced()  # warm-up (compiles the kernels on a GPU)
        benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes(synced)
        benchmark(synced)
    benchmark.group = group
    benchmark.extra_info.update(hidden=H, vocab=V, dtype=str(DTYPE), device=DEVICE,
                                backend=OURS_BACKEND if provider == "ours" else "torch",
                                logits_bytes_unfused=info.get("n", 0) * V * 4, **info)


@pytest.mark.parametrize("n", DECODE_N)
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_argmax(benchmark, provider, n):
    hidden, weight, norm_weight = model_tensors(n)
    if provider == "ours":
        call = lambda: lm_head_argmax(hidden, weight, norm_weight=norm_weight)  # noqa: E731
    else:
        call = lambda: torch_argmax(hidden, weight, norm_weight)  # noqa: E731
    run(benchmark, provider, call, f"argmax N={n}", n=n)


@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_topk(benchmark, provider):
    hidden, weight, norm_weight = model_tensors(TOPK_N)
    if provider == "ours":
        call = lambda: lm_head_topk(hidden, weight, TOPK_K, norm_weight=norm_weight)  # noqa: E731
    else:
        call = lambda: torch_topk(hidden, weight, norm_weight, TOPK_K)  # noqa: E731
    run(benchmark, provider, call, f"topk N={TOPK_N} k={TOPK_K}", n=TOPK_N, k=TOPK_K)


@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_sample(benchmark, provider):
    n = DECODE_N[1]
    hidden, weight, norm_weight = model_tensors(n)
    if provider == "ours":
        call = lambda: lm_head_sample(hidden, weight, 0.8, norm_weight=norm_weight, seed=0)  # noqa: E731
    else:
        call = lambda: torch_sample(hidden, weight, norm_weight, 0.8)  # noqa: E731
    run(benchmark, provider, call, f"sample N={n}", n=n)


@pytest.mark.parametrize("n", CE_N)
@pytest.mark.parametrize("provider", ["ours", "torch"])
def test_cross_entropy_fwd_bwd(benchmark, provider, n):
    hidden, weight, norm_weight = model_tensors(n)
    hidden.requires_grad_(True)
    targets = torch.randint(0, V, (n,), device=DEVICE)
    fn = ours_cross_entropy if provider == "ours" else torch_cross_entropy
    run(benchmark, provider, lambda: fn(hidden, weight, norm_weight, targets), f"cross_entropy fwd+bwd N={n}", n=n)


def test_cross_entropy_memory_8192x151936(benchmark):
    n, vocab = 8192, 151936
    full_logits = n * vocab * 4
    info = benchmark.extra_info
    info["unfused_logits_bytes"] = full_logits
    if CUDA:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        hidden = torch.randn(n, 4096, generator=g, device=DEVICE).to(torch.bfloat16).requires_grad_(True)
        weight = (torch.randn(vocab, 4096, generator=g, device=DEVICE) / 64).to(torch.bfloat16)
        norm_weight = torch.ones(4096, device=DEVICE, dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (n,), device=DEVICE)
        with force_backend("triton"):
            fused = peak_extra_bytes(lambda: ours_cross_entropy(hidden, weight, norm_weight, targets))
        hidden.grad = None
        unfused = peak_extra_bytes(lambda: torch_cross_entropy(hidden, weight, norm_weight, targets))
        info.update(measured="cuda max_memory_allocated, H 4096", fused_peak_bytes=fused, unfused_peak_bytes=unfused)
        with force_backend("triton"):
            benchmark.pedantic(lambda: ours_cross_entropy(hidden, weight, norm_weight, targets), rounds=3)
    else:
        plan = cross_entropy_module.cross_entropy_chunk_plan(n, vocab, 64, torch.bfloat16)
        fused = plan["chunk_bytes"] + 2 * n * 64 * 2  # chunk buffers + operand and its gradient [N, H] bf16
        info.update(measured="chunk plan at the real shape (H 64, bf16); see scaled_* for a profiler measurement",
                    fused_chunk_plan=plan, fused_peak_bytes=fused)
        scaled = scaled_cross_entropy_peaks()
        info.update(scaled)
        assert scaled["scaled_fused_peak_bytes"] < scaled["scaled_unfused_logits_bytes"] / 8
        benchmark.pedantic(lambda: None, rounds=1)
    info["fused_over_unfused_logits"] = round(fused / full_logits, 4)
    plan = cross_entropy_module.cross_entropy_chunk_plan(n, vocab, 4096 if CUDA else 64, torch.bfloat16)
    assert plan["chunk_bytes"] < full_logits / 8, f"the fused CE's chunk buffers ({plan['chunk_bytes']} B) are not " \
        f"below 1/8 of the logits ({full_logits} B)"
    if CUDA:
        assert fused < unfused / 8, f"fused CE peak {fused} B is not below 1/8 of the unfused peak ({unfused} B)"
    else:
        assert fused < full_logits / 8, f"fused CE peak {fused} B is not below 1/8 of the logits ({full_logits} B)"


def scaled_cross_entropy_peaks():
    """Profiler-measured peaks (CPU) of the fused Triton CE (interpreter) and the reference, 1024 x 1000 vocab."""
    n, hidden_size, vocab, rows = 1024, 16, 1000, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, hidden_size, generator=g).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=g) / 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), generator=g)
    peaks = {}
    for backend in ("triton", "reference"):
        with force_backend(backend):
            call = lambda: lm_head_cross_entropy(hidden, weight, targets,  # noqa: E731
                                                 chunk_elements=rows * vocab).sum().backward()
            peak_extra_bytes(lambda: lm_head_cross_entropy(hidden[:rows], weight, targets[:rows]))  # warm-up
            peaks[backend] = peak_extra_bytes(call)
    return dict(scaled_shape=f"N {n}, V {vocab}, H {hidden_size}, bf16, chunks of {rows} rows",
                scaled_fused_peak_bytes=peaks["triton"], scaled_reference_peak_bytes=peaks["reference"],
                scaled_unfused_logits_bytes=n * vocab * 4)

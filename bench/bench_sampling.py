"""Benchmark: sampling from the processed distribution (temperature, top-k, top-p, min-p).

Run: ``python -m pytest bench/bench_sampling.py --benchmark-columns=median,rounds``

Providers, for ``hidden [N, H]``, lm_head ``[V, H]``:

* ``ours``: :func:`dflash_kernels.lm_head_sample` with filters (Triton backend on a
  GPU: the chunked histogram method, two passes over the weight, no host sync).
* ``torch``: what transformers does: ``rms_norm -> F.linear`` (``[N, V]`` logits
  in the model dtype) -> fp32 -> the warpers -> ``softmax`` -> ``multinomial``
  (the reference op).
* ``plain``: :func:`dflash_kernels.lm_head_sample` (temperature only), the
  cost floor of one fused pass.

With CUDA: Qwen3-8B shapes (H 4096, V 151936, bf16), N in (16, 65) (a DFlash
block, a DDTree verify), Qwen3's shipped settings (T 0.6, top-k 20, top-p
0.95) and Llama-3.1's (top-p 0.9). Without CUDA: small shapes, and ``ours``
runs the reference backend (the interpreter is not a speed path).
``extra_info["peak_extra_bytes"]`` records the extra memory of one call.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from bench_gather import peak_extra_bytes  # noqa: E402
from dflash_kernels import force_backend, lm_head_sample  # noqa: E402
from dflash_kernels.reference import sampling as ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OURS_BACKEND = "triton" if CUDA else "reference"
if CUDA:
    H, V, DTYPE, ROWS = 4096, 151936, torch.bfloat16, [16, 65]
else:
    H, V, DTYPE, ROWS = 128, 32000, torch.bfloat16, [16]
SETTINGS = {"qwen3": dict(top_k=20, top_p=0.95), "llama31": dict(top_p=0.9)}
TEMPERATURE = {"qwen3": 0.6, "llama31": 0.6}


def _inputs(n):
    g = torch.Generator(device=DEVICE).manual_seed(0)  # drawn on the device: a [V, H] host draw takes seconds
    hidden = torch.randn(n, H, generator=g, device=DEVICE).to(DTYPE)
    weight = (torch.randn(V, H, generator=g, device=DEVICE) * H ** -0.5 * 4).to(DTYPE)
    norm = torch.ones(H, dtype=DTYPE, device=DEVICE)
    return hidden, weight, norm


def _sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("provider", ["ours", "torch", "plain"])
def test_sample_processed(benchmark, provider, setting, n):
    hidden, weight, norm = _inputs(n)
    kw, t = SETTINGS[setting], TEMPERATURE[setting]

    def ours():
        with force_backend(OURS_BACKEND):
            out = lm_head_sample(hidden, weight, t, norm_weight=norm, seed=1, check_bounds=False, **kw)
        _sync()
        return out

    def torch_path():
        with force_backend("reference"):
            out = ref.lm_head_sample_processed(hidden, weight, t, norm_weight=norm, seed=1, **kw)
        _sync()
        return out

    def plain():
        with force_backend(OURS_BACKEND):
            out = lm_head_sample(hidden, weight, t, norm_weight=norm, seed=1, check_bounds=False)
        _sync()
        return out

    fn = {"ours": ours, "torch": torch_path, "plain": plain}[provider]
    fn()
    benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes(fn)
    benchmark.pedantic(fn, rounds=20 if CUDA else 3, warmup_rounds=1)
